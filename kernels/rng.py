"""Dropout whose mask is a function of a seed and the element's index, so a kernel can recompute it.

The ``fuse`` pass rewrites ``dropout(x, p, train=True)`` on a tp-replicated activation as
``x * dropout_keep(seed, shape, p, stream)``: one seed per forward (drawn from torch's generator on the
activation's device), one ``stream`` per dropout site. In a generated kernel the mask is
``tl.rand(seed + stream, index) >= p`` (Philox), computed in the forward kernel and again in the backward
kernel: nothing is saved but the seed. Every tp rank draws the same seed (ranks are seeded alike, as in
Megatron), and the index is the element's position in the replicated activation, so the masks are
identical on every tp rank. A dropout on a tp-sharded activation would need per-shard masks (Megatron's
model-parallel RNG region) and stays torch's own dropout.

Outside a kernel (a group that did not fuse) ``dropout_keep`` runs the same Philox4x32-10 in torch
(``philox_uniform``), bit for bit what ``tl.rand`` draws, so a mask does not depend on whether its
dropout landed in a kernel: a tp=2 program whose groups differ from the tp=1 program's draws the same.
"""
from __future__ import annotations

import torch

SEED_RANGE = 2**31 - 2**16      # seed + stream stays a positive int32

_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57


def _mul32(a: int, b: torch.Tensor) -> tuple:
    """(high, low) 32 bits of ``a * b`` for a constant ``a`` and uint32 values in an int64 tensor,
    without overflowing int64: ``b`` is split into 16-bit halves."""
    lo_part, hi_part = a * (b & 0xFFFF), a * (b >> 16)           # each < 2**48
    high = (hi_part + (lo_part >> 16)) >> 16
    low = (((hi_part & 0xFFFF) << 16) + lo_part) & _M32
    return high & _M32, low


def philox_uniform(seed, numel: int, device) -> torch.Tensor:
    """``tl.rand(seed, offset)`` for ``offset = 0 .. numel - 1`` (Triton's Philox4x32-10 and its uint to
    float conversion), computed in int64 torch ops. ``seed``: an int, or a 0-d int64 tensor on ``device``."""
    offset = torch.arange(numel, dtype=torch.int64, device=device)
    c0, c1 = offset & _M32, offset >> 32
    c2 = c3 = torch.zeros_like(offset)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mul32(_ROUND_B, c2)
        hi_a, lo_a = _mul32(_ROUND_A, c0)
        c0, c2, c1, c3 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1, lo_b, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0).to(torch.int32)   # the uint32 read as int32
    x = torch.where(x < 0, ~x, x)
    return x.to(torch.float32) * 4.6566127342e-10


@torch.library.custom_op("autoshard::dropout_keep", mutates_args=())
def dropout_keep(seed: torch.Tensor, shape: list[int], p: float, stream: int) -> torch.Tensor:
    """``1 / (1 - p)`` where an element is kept, else 0 (fp32), on ``seed``'s device: the kernels' mask."""
    n = 1
    for s in shape:
        n *= s
    if p >= 1.0:                       # torch's dropout(p=1) zeroes everything
        return torch.zeros(shape, device=seed.device)
    # the seed stays a tensor on its device: int(seed) would make the host wait for the GPU at every dropout
    keep = philox_uniform(seed.to(torch.int64).reshape(()) + stream, n, seed.device).view(shape) >= p
    return keep.to(torch.float32) / (1.0 - p)


@dropout_keep.register_fake
def _(seed, shape, p, stream):
    return seed.new_empty(shape, dtype=torch.float32)


def draw_seed(like: torch.Tensor) -> torch.Tensor:
    """A fresh seed on ``like``'s device, from torch's generator there (so ``torch.manual_seed`` fixes it)."""
    return torch.randint(0, SEED_RANGE, (), device=like.device, dtype=torch.int64)


def dropout_expr(seed: str, stream: int, p: float) -> str:
    """The mask as a Triton expression over the kernel's ``rows`` and ``cols`` (``{n}``: columns)."""
    if p >= 1.0:
        return "0.0"
    return f"tl.where(tl.rand(({seed} + {stream}).to(tl.int32), rows * {{n}} + cols) >= {p!r}, {1.0 / (1.0 - p)!r}, 0.0)"
