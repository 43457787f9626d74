"""The LM head and its (vocab-parallel) cross-entropy, chunked over tokens: the logits never exist whole.

Liger's fused linear cross-entropy, over a vocab sharded on tp (Megatron's vocab-parallel loss): for
each chunk of ``chunk`` rows, the local logits ``h_c W^T`` (fp32), the row max (all-reduce MAX over tp),
the sum of exps and the target logit (one stacked all-reduce, plus the row sum of the logits with label
smoothing), the loss rows, and, when a gradient is wanted, the gradient in place (``softmax - onehot``,
scaled) folded at once into ``dh_c = g_c W`` and ``dW += g_c^T h_c``; then the chunk is dropped. The
loss is a scalar at the end of the program, so its gradient is computed in forward and backward only
scales it by the incoming ``g`` and, where the head's ``f`` was fused into it, all-reduces ``dh`` over
tp (the partial sum over vocab shards that the column-parallel matmul's backward would have reduced).
Peak memory for the loss is one ``[chunk, V/t]`` buffer plus ``dW`` and ``dh``, against one
``[rows, V/t]`` buffer plus ``dW`` and ``dh`` unchunked.

Semantics are the unchunked loss's (``runtime/losses.py``): ``ignore_index`` rows have loss and gradient
0; the mean divides by the kept rows (NaN when none are, with a zero gradient); padded vocab columns
(``>= valid``) take no probability and no smoothing mass; statistics in fp32 whatever the dtype.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autoshard.kernels import cross_entropy as fused_ce
from autoshard.runtime.input_checks import check_range


def _epilogue_forward(x: torch.Tensor, epilogue: tuple, tanhs: list) -> None:
    """Apply the epilogue to a chunk's logits in place, keeping each tanh's output in ``tanhs`` (if any)."""
    keep = iter(tanhs)
    for kind, c in epilogue:
        if kind == "mul":
            x.mul_(c)
        elif kind == "div":
            x.div_(c)
        else:
            x.tanh_()
            t = next(keep, None)
            if t is not None:
                t.copy_(x)


def _epilogue_backward(grad: torch.Tensor, epilogue: tuple, tanhs: list) -> None:
    """The gradient at the epilogue's output to the gradient at its input, in place (last step first)."""
    keep = list(tanhs)
    for kind, c in reversed(epilogue):
        if kind == "mul":
            grad.mul_(c)
        elif kind == "div":
            grad.div_(c)
        else:
            t = keep.pop()
            grad.mul_(1.0 - t * t)


_MIXED_MM: dict = {}     # device type -> whether addmm takes bf16 operands into an fp32 output there


def mixed_mm_works(device: torch.device) -> bool:
    """Whether ``torch.addmm(fp32, bf16, bf16, out_dtype=torch.float32, out=fp32)`` runs on ``device``'s
    kind and gives the fp32 product (asked once per process, on a 16 x 16 problem). CUDA has it since
    torch 2.8 and runs it on tensor cores; CPU has no kernel for it. Where it is missing, the weight
    gradient of a low-precision head is an fp32 GEMM of upcast operands: right, but on a GPU a SIMT one."""
    kind = device.type
    if kind not in _MIXED_MM:
        ok = False
        if kind == "cuda":
            try:
                a = torch.randn(16, 16, device=device).to(torch.bfloat16)
                out = torch.ones(16, 16, device=device)
                torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
                ok = bool(torch.allclose(out, 1 + a.float() @ a.float(), rtol=1e-3, atol=1e-3))
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _MIXED_MM[kind] = ok
    return _MIXED_MM[kind]


def _chunk_loss_composed(x, kept, epilogue, comm, valid, local_t, in_shard, hit, keep, scale, eps, vocab, want_grad):
    """One chunk's per-row losses from its local logits ``x`` (fp32, overwritten), and when ``want_grad``,
    ``x`` turned into the gradient at the head's output (through the epilogue): the composed torch ops."""
    _epilogue_forward(x, epilogue, kept)
    local_vocab = x.shape[1]
    real = x
    if valid < local_vocab:
        x[:, valid:] = float("-inf")
        real = x[:, :valid]
    row_max = real.amax(dim=1) if valid else x.new_full((x.shape[0],), float("-inf"))
    if comm is not None:
        row_max = comm.all_reduce(row_max, "fwd", op=dist.ReduceOp.MAX)
    x.sub_(row_max.unsqueeze(1))
    lt = local_t.unsqueeze(1)
    # where, not a product: a -inf logit on a rank that does not hold the target must not make NaN
    stats = [torch.where(in_shard, x.gather(1, lt).squeeze(1), 0.0)]
    if eps:  # the row sum of the (shifted) real logits, before exp_ overwrites them
        stats.append(real.sum(dim=1))
    exp = x.exp_()
    stats = torch.stack([exp.sum(dim=1)] + stats)
    if comm is not None:
        stats = comm.all_reduce(stats, "fwd")
    lse = stats[0].log()           # of the shifted row: the row max cancels in every term
    loss = lse - stats[1]
    if eps:
        loss = (1.0 - eps) * loss + eps * (lse - stats[2] / vocab)
    loss = torch.where(keep, loss, 0.0)
    if not want_grad:
        return loss, None
    # (softmax - (1 - eps) onehot - eps / V) * scale in place: exp * (scale / sum of exps) first
    grad = exp.mul_((scale / stats[0]).unsqueeze(1))
    grad.scatter_add_(1, lt, -((1.0 - eps) * hit * scale).unsqueeze(1))
    if eps:  # the uniform target: real columns only
        grad[:, :valid].sub_((eps / vocab * scale).unsqueeze(1))
    _epilogue_backward(grad, epilogue, kept)   # to the head's output
    return loss, grad


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``apply(h [rows, H], weight [V/t, H], target [rows], comm, start, valid, ignore_index, reduction,
    chunk, grad_enabled, out_dtype, label_smoothing, vocab, reduce_input_grad, bias [V/t] or None,
    epilogue, kernel)``: the arguments of ``ir.ops.VocabParallelLinearCrossEntropy``; ``kernel``: each chunk's
    loss and gradient by ``kernels/cross_entropy.py`` where it can run. ``epilogue`` is the pointwise
    steps from the head's output to the loss's logits (``("mul", c)``, ``("div", c)``, ``("tanh", None)``),
    applied to each chunk in fp32; backward multiplies by their derivatives, the tanh's from its output
    kept for the chunk. ``grad_enabled`` is the caller's grad mode:
    ``needs_input_grad`` is still true inside ``forward`` under ``no_grad``, and the gradients are
    computed only where autograd will ask for them. ``comm`` is None at tp = 1."""

    @staticmethod
    def forward(ctx, h, weight, target, comm, start: int, valid: int, ignore_index: int, reduction: int,
                chunk: int, grad_enabled: bool = True, out_dtype=None, label_smoothing: float = 0.0,
                vocab: int | None = None, reduce_input_grad: bool = True, bias=None, epilogue: tuple = (),
                kernel: bool = False):
        out_dtype = out_dtype or h.dtype    # fp32 when the model cast its logits (HF's logits.float())
        if h.is_meta:
            return h.new_empty((), dtype=out_dtype)
        eps = float(label_smoothing)
        if eps and not vocab:
            raise ValueError("a label-smoothed chunked cross-entropy needs the global vocab size")
        check_range(target, vocab, "label", ignore_index)
        rows, local_vocab = h.shape[0], weight.shape[0]
        # the Triton kernels for the loss of each chunk where asked (fuse on) and they run here; a chunk with
        # an epilogue (a tanh soft cap) keeps the composed ops, which carry its derivative
        use_kernel = kernel and not epilogue and fused_ce.available(h.device)
        want_h, want_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        want_b = bias is not None and grad_enabled and ctx.needs_input_grad[14]     # bias: the 15th input
        keep = target != ignore_index
        count = keep.sum()
        in_shard = (target >= start) & (target < start + valid)
        local_t = (target - start).masked_fill(~in_shard, 0)
        hit = in_shard & keep
        # the gradient of the mean or the sum, per row (0 on ignored rows; 1/0 never reaches a kept row)
        scale = torch.where(keep, 1.0 / count.clamp(min=1), 0.0) if reduction == 1 else keep.float()
        losses = torch.empty(rows, dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h) if want_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if want_w else None
        db = torch.zeros(local_vocab, dtype=torch.float32, device=h.device) if want_b else None
        # one [chunk, V/t] fp32 buffer for every chunk (and one in h's dtype when that is not fp32): a fresh
        # allocation per chunk is a fresh mapping of pages on CPU, which cost ~20% of the matmul it fed
        buf = torch.empty((min(chunk, rows), local_vocab), dtype=torch.float32, device=h.device)
        low = None if h.dtype == torch.float32 else torch.empty(buf.shape, dtype=h.dtype, device=h.device)
        tanhs = [torch.empty_like(buf) for kind, _ in epilogue if kind == "tanh"] if (want_h or want_w or want_b) \
            else []
        for s in range(0, rows, chunk):
            e = min(s + chunk, rows)
            hc, x, kept = h[s:e], buf[: e - s], [t[: e - s] for t in tanhs]
            if low is None and bias is None:
                torch.mm(hc, weight.t(), out=x)                             # the local logits, fp32
            elif low is None:
                torch.addmm(bias, hc, weight.t(), out=x)
            else:  # the matmul in h's dtype, then fp32, as the unchunked loss casts its logits
                mm = torch.mm(hc, weight.t(), out=low[: e - s]) if bias is None else \
                    torch.addmm(bias, hc, weight.t(), out=low[: e - s])
                x.copy_(mm)
            sl = slice(s, e)
            if use_kernel:   # kernels/cross_entropy.py: two passes over the chunk instead of ~ten ops
                losses[sl] = fused_ce.chunk_loss_and_grad(x, target[sl], comm, start, valid, ignore_index,
                                                             scale[sl], eps, vocab, want_h or want_w or want_b)
                grad = x
            else:
                losses[sl], grad = _chunk_loss_composed(x, kept, epilogue, comm, valid, local_t[sl], in_shard[sl],
                                                        hit[sl], keep[sl], scale[sl], eps, vocab,
                                                        want_h or want_w or want_b)
            if not (want_h or want_w or want_b):
                continue
            mixed = low is not None and want_w and mixed_mm_works(h.device)
            if want_h or mixed:  # in h's dtype, as the head's matmul backward computes it
                g = grad if low is None else low[: e - s].copy_(grad)
            if want_h:
                torch.mm(g, weight, out=dh[s:e])
            if mixed:   # bf16 operands on tensor cores, accumulated in fp32 over the chunks (Liger's wgrad)
                torch.addmm(dw, g.t(), hc, out_dtype=torch.float32, out=dw)
            elif want_w:  # summed over chunks in fp32 (from the fp32 gradient: one rounding, at the end)
                dw.addmm_(grad.t(), hc if hc.dtype == torch.float32 else hc.float())
            if want_b:
                db += grad.sum(dim=0)
        del buf, low, tanhs
        total = losses.sum()
        loss = total / count if reduction == 1 else total
        ctx.save_for_backward(*(t for t in (dh, dw, db) if t is not None))
        ctx.has = (want_h, want_w, want_b)
        ctx.comm, ctx.w_dtype, ctx.spent = comm, weight.dtype, False
        ctx.b_dtype = bias.dtype if bias is not None else None
        ctx.reduce_input_grad = reduce_input_grad
        return loss.to(out_dtype)

    @staticmethod
    def backward(ctx, g):
        if ctx.spent:
            raise RuntimeError("the chunked LM head + loss computes its gradients in forward and hands them over "
                               "once: backward through it twice (retain_graph=True) is not supported; compile "
                               "with loss_chunk_rows=None for that")
        ctx.spent = True
        saved = list(ctx.saved_tensors)
        # loss.backward() on the CPU: the gradients are ready, handed over without a copy. On a GPU the test
        # would make the host wait for the whole forward, so there they are always scaled
        one = g.device.type == "cpu" and bool(g == 1)
        dh = dw = db = None
        if ctx.has[0]:
            dh = saved.pop(0)
            dh = dh if one else dh * g.to(dh.dtype)
            if ctx.reduce_input_grad and ctx.comm is not None:
                dh = ctx.comm.all_reduce(dh, "bwd")
        if ctx.has[1]:
            dw = saved.pop(0)
            dw = (dw if one else dw * g.float()).to(ctx.w_dtype)
        if ctx.has[2]:
            db = saved.pop(0)
            db = (db if one else db * g.float()).to(ctx.b_dtype)
        return (dh, dw) + (None,) * 12 + (db, None, None)
