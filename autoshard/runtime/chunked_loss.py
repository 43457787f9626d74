"""The LM head and its (vocab-parallel) cross-entropy, chunked over tokens: the logits never exist whole.

Liger's fused linear cross-entropy, over a vocab sharded on tp (Megatron's vocab-parallel loss): for
each chunk of ``chunk`` rows, the local logits ``h_c W^T`` (fp32), the row max (all-reduce MAX over tp),
the sum of exps and the target logit (one stacked all-reduce), the loss rows, and, when a gradient is
wanted, the gradient in place (``softmax - onehot``, scaled) folded at once into ``dh_c = g_c W`` and
``dW += g_c^T h_c``; then the chunk is dropped. The loss is a scalar at the end of the program, so its
gradient is computed in forward and backward only scales it by the incoming ``g`` and all-reduces
``dh`` over tp (the partial sum over vocab shards that the column-parallel matmul's ``f`` would have
reduced). Peak memory for the loss is one ``[chunk, V/t]`` buffer plus ``dW`` and ``dh``, against two
``[rows, V/t]`` buffers unchunked.

Semantics are the unchunked loss's: ``ignore_index`` rows have loss and gradient 0; the mean divides by
the kept rows (NaN when none are, with a zero gradient); padded vocab columns (``>= valid``) take no
probability; statistics in fp32 whatever the dtype.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, comm, start: int, valid: int, ignore_index: int, reduction: int,
                chunk: int, grad_enabled: bool = True, out_dtype=None):
        if h.is_meta:
            return h.new_empty(())
        rows, local_vocab = h.shape[0], weight.shape[0]
        # needs_input_grad is set under no_grad too: the caller passes whether autograd will ask
        want_h, want_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
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
        for s in range(0, rows, chunk):
            e = min(s + chunk, rows)
            hc = h[s:e]
            x = (hc @ weight.t()).float()                                  # [c, V/t]: the one buffer
            if valid < local_vocab:
                x[:, valid:] = float("-inf")
            row_max = x[:, :valid].amax(dim=1) if valid else x.new_full((x.shape[0],), float("-inf"))
            if comm is not None:
                row_max = comm.all_reduce(row_max, "fwd", op=dist.ReduceOp.MAX)
            x.sub_(row_max.unsqueeze(1))
            lt = local_t[s:e].unsqueeze(1)
            target_logit = torch.where(in_shard[s:e], x.gather(1, lt).squeeze(1), 0.0)
            exp = x.exp_()
            stats = torch.stack([exp.sum(dim=1), target_logit])
            if comm is not None:
                stats = comm.all_reduce(stats, "fwd")
            losses[s:e] = torch.where(keep[s:e], stats[0].log() - stats[1], 0.0)
            if want_h or want_w:
                # softmax * scale - onehot * scale in one pass over the chunk: exp * (scale / sum of exps)
                row_scale = scale[s:e]
                grad = exp.mul_((row_scale / stats[0]).unsqueeze(1))
                grad.scatter_add_(1, lt, -(hit[s:e] * row_scale).unsqueeze(1))
                g = grad.to(h.dtype)
                if want_h:
                    dh[s:e] = g @ weight
                if want_w:
                    dw.addmm_(g.t().float(), hc.float())
            del x, exp
        total = losses.sum()
        loss = total / count if reduction == 1 else total
        ctx.save_for_backward(*(t for t in (dh, dw) if t is not None))
        ctx.has = (want_h, want_w)
        ctx.comm, ctx.w_dtype, ctx.spent = comm, weight.dtype, False
        return loss.to(out_dtype or h.dtype)      # fp32 when the model cast its logits (HF's logits.float())

    @staticmethod
    def backward(ctx, g):
        if ctx.spent:
            raise RuntimeError("the chunked LM head + loss computes its gradients in forward and hands them over "
                               "once: backward through it twice (retain_graph=True) is not supported; compile "
                               "with loss_chunk_rows=None for that")
        ctx.spent = True
        saved = list(ctx.saved_tensors)
        one = bool(g == 1)       # loss.backward(): the gradients are ready, handed over without a copy
        dh = dw = None
        if ctx.has[0]:
            dh = saved.pop(0)
            dh = dh if one else dh * g
        if ctx.has[1]:
            dw = saved.pop(0)
            dw = (dw if one else dw * g.float()).to(ctx.w_dtype)
        if dh is not None and ctx.comm is not None:
            dh = ctx.comm.all_reduce(dh, "bwd")
        return dh, dw, None, None, None, None, None, None, None, None, None
