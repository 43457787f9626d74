"""Dropout whose mask is a function of a seed and the element's index, so a kernel can recompute it.

The ``fuse`` pass rewrites ``dropout(x, p, train=True)`` on a tp-replicated activation as
``x * dropout_keep(seed, shape, p, stream)``: one seed per forward (drawn from torch's generator on the
activation's device), one ``stream`` per dropout site. In a generated kernel the mask is
``tl.rand(seed + stream, index) >= p`` (Philox), computed in the forward kernel and again in the backward
kernel: nothing is saved but the seed. Every tp rank draws the same seed (ranks are seeded alike, as in
Megatron), and the index is the element's position in the replicated activation, so the masks are
identical on every tp rank. A dropout on a tp-sharded activation would need per-shard masks (Megatron's
model-parallel RNG region) and stays torch's own dropout.

Outside a kernel (a group that did not fuse) ``dropout_keep`` runs in torch from a generator seeded with
``(seed, stream)``: still reproducible and the same on every tp rank, with different bits than Philox.
"""
from __future__ import annotations

import torch

SEED_RANGE = 2**31 - 1


@torch.library.custom_op("autoshard::dropout_keep", mutates_args=())
def dropout_keep(seed: torch.Tensor, shape: list[int], p: float, stream: int) -> torch.Tensor:
    """``1 / (1 - p)`` where an element is kept, else 0 (fp32), on ``seed``'s device."""
    g = torch.Generator(device=seed.device).manual_seed(int(seed) * 8191 + stream)
    keep = torch.rand(shape, generator=g, device=seed.device) >= p
    return keep.to(torch.float32) / (1.0 - p)


@dropout_keep.register_fake
def _(seed, shape, p, stream):
    return seed.new_empty(shape, dtype=torch.float32)


def draw_seed(like: torch.Tensor) -> torch.Tensor:
    """A fresh seed on ``like``'s device, from torch's generator there (so ``torch.manual_seed`` fixes it)."""
    return torch.randint(0, SEED_RANGE, (), device=like.device, dtype=torch.int64)


def dropout_expr(seed: str, stream: int, p: float) -> str:
    """The mask as a Triton expression over the kernel's ``rows`` and ``cols`` (``{n}``: columns)."""
    return f"tl.where(tl.rand(({seed} + {stream}).to(tl.int32), rows * {{n}} + cols) >= {p!r}, {1.0 / (1.0 - p)!r}, 0.0)"
