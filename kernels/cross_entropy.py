"""The vocab-parallel cross-entropy of one chunk of logits in two Triton kernels (Liger's fused linear
cross-entropy, over a vocab sharded on tp).

``ChunkedLinearCrossEntropy`` (``runtime/chunked_loss.py``) computes each chunk's logits with a matmul,
then the loss and its gradient with about ten torch ops per chunk (max, shift, gather, exp, sums,
scale, scatter), each a pass over the ``[chunk, V/t]`` buffer. Here they are two passes:

1. ``row_stats``: per row, in one read of the row, the online max and sum of exps of the real columns
   (padded vocab columns take no part), the target's logit where this shard holds the target, and the
   row sum (for label smoothing). The launcher then combines the shards: an all-reduce (MAX) of the
   maxima, each sum rescaled to the global max, one stacked all-reduce (SUM), as the composed ops do.
2. ``grad``: per row, in one read and one write, ``(softmax - (1 - eps) onehot - eps / V) * scale`` in
   place, zero on padded columns.

The statistics are fp32 whatever the logits' dtype, as in the composed path, and the results match it
to fp32 rounding (``tests/kernels/test_cross_entropy_kernel.py``, in Triton's interpreter). What Inductor
cannot write here is the collective between the two passes and the in-place reuse of the chunk's
buffer across the forward and the gradient.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

_KERNELS: dict = {}     # interpreting? -> (row_stats, grad): made on first use, after TRITON_INTERPRET is read


def _kernels():
    """The two ``@triton.jit`` functions, made on first use (Triton reads ``TRITON_INTERPRET`` when a
    function is decorated: defined at import they would ignore a later switch to the interpreter)."""
    key = os.environ.get("TRITON_INTERPRET") == "1"
    if key in _KERNELS:
        return _KERNELS[key]
    import triton
    import triton.language as tl

    @triton.jit
    def row_stats(x_ptr, stride, target_ptr, stats_ptr, cols, valid, start, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        total = tl.zeros((), tl.float32)
        for c in range(0, cols, BLOCK):
            idx = c + offs
            real = idx < valid
            x = tl.load(base + idx, mask=real, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row of -inf stays -inf, not NaN
            s = s * tl.exp(m - safe) + tl.sum(tl.where(real, tl.exp(x - safe), 0.0), axis=0)
            total += tl.sum(tl.where(real, x, 0.0), axis=0)
            m = m_new
        t = tl.load(target_ptr + row) - start
        hit = (t >= 0) & (t < valid)
        logit = tl.load(base + tl.where(hit, t, 0)).to(tl.float32)
        tl.store(stats_ptr + row * 4 + 0, m)
        tl.store(stats_ptr + row * 4 + 1, s)
        tl.store(stats_ptr + row * 4 + 2, tl.where(hit, logit, 0.0))
        tl.store(stats_ptr + row * 4 + 3, total)

    @triton.jit
    def grad(x_ptr, stride, target_ptr, lse_ptr, scale_ptr, cols, valid, start, keep_target, smooth,
             BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        lse = tl.load(lse_ptr + row)
        scale = tl.load(scale_ptr + row)
        t = tl.load(target_ptr + row) - start
        for c in range(0, cols, BLOCK):
            idx = c + offs
            inside = idx < cols
            real = idx < valid
            x = tl.load(base + idx, mask=inside, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - smooth - tl.where(idx == t, keep_target, 0.0)
            g = tl.where(real, g * scale, 0.0)
            tl.store(base + idx, g.to(x_ptr.dtype.element_ty), mask=inside)

    _KERNELS[key] = (row_stats, grad)
    return _KERNELS[key]


def _block(cols: int) -> int:
    return min(4096, 1 << max(4, (cols - 1).bit_length()))


def available(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: a GPU with Triton, or Triton's interpreter on CPU."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def chunk_loss_and_grad(x, target, comm, start: int, valid: int, ignore_index: int, row_scale,
                        label_smoothing: float, vocab: int, want_grad: bool):
    """Per-row losses of one chunk of local logits ``x`` ``[rows, V/t]`` (fp32, contiguous rows), and when
    ``want_grad``, ``x`` turned in place into the gradient of ``sum(loss_i * row_scale_i)``: what the
    composed ops of ``ChunkedLinearCrossEntropy`` compute for a chunk with no epilogue. ``comm``: the tp
    communicator (None at tp = 1). Returns the losses ``[rows]`` in fp32."""
    row_stats, grad = _kernels()
    rows, cols = x.shape
    stats = torch.empty((rows, 4), dtype=torch.float32, device=x.device)
    target = target.contiguous()
    row_stats[(rows,)](x, x.stride(0), target, stats, cols, valid, start, BLOCK=_block(cols))
    m = stats[:, 0]
    if comm is not None:
        m = comm.all_reduce(m.clone(), "fwd", op=dist.ReduceOp.MAX)
    finite = torch.where(torch.isinf(m), 0.0, m)
    sums = stats[:, 1] * torch.exp(stats[:, 0] - finite).nan_to_num(0.0)
    parts = [sums, stats[:, 2]] + ([stats[:, 3]] if label_smoothing else [])
    combined = torch.stack(parts)
    if comm is not None:
        combined = comm.all_reduce(combined, "fwd")
    lse = combined[0].log() + finite
    loss = lse - combined[1]
    eps = float(label_smoothing)
    if eps:
        loss = (1.0 - eps) * loss + eps * (lse - combined[2] / vocab)
    keep = target != ignore_index
    loss = torch.where(keep, loss, 0.0)
    if want_grad:
        grad[(rows,)](x, x.stride(0), target, lse.contiguous(), row_scale.to(torch.float32).contiguous(), cols,
                      valid, start, 1.0 - eps, eps / vocab if eps else 0.0, BLOCK=_block(cols))
    return loss


__all__ = ["available", "chunk_loss_and_grad"]
