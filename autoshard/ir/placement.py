"""Placements: DTensor's vocabulary, one placement per mesh axis, plus the two facts DTensor leaves implicit.

On one mesh axis of size t a tensor is

- ``Replicate()``: every rank holds the whole tensor (and, by our invariant, the whole gradient);
- ``Shard(dim)``: rank r holds the r-th of t equal chunks of ``dim``;
- ``Shard(dim, blocks=k)``: ``dim`` is k equal blocks side by side (the q|k|v of a fused projection) and
  rank r holds the r-th chunk *of every block*, DTensor's ``_StridedShard``. Cutting a fused ``c_attn``
  in one contiguous chunk would give rank 0 all of q and half of k: the classic silent wrong result;
- ``Shard(dim, blocks=(n0, n1, ...))``: the same with blocks of unequal sizes (a grouped-query q|k|v,
  Phi-3-medium's and Phi-4's: q is larger than k and v). DTensor has no such placement (see
  ``runtime/params.py`` for how such a parameter is shown);
- ``Partial()``: every rank holds a summand; the tensor is their sum (a row-parallel matmul's output).

A dim that t does not divide may still be sharded where the consumer can mask the tail (the vocab dim of
embedding and LM head): the local chunk is ``ceil(n / t)`` long and the last rank's tail is padding.

A tensor's ``DistSpec`` holds one placement per mesh axis (``dp``, ``pp``, ``tp``), as a DTensor's
``placements`` does. Graph shapes are per data-parallel replica (each dp rank traces its own batch), so
only the ``tp`` placement changes a local shape; ``dp``'s ``Shard(0)`` records that the global batch is
``dp`` of these, and ``pp`` is ``Replicate`` (stages own whole tensors).

Gradient invariant (what makes the inserted collectives Megatron's f and g): the gradient of a tensor has
the same placement as the tensor, except that a ``Partial`` tensor's gradient is replicated.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union

from autoshard.ir.mesh import AXES


@dataclass(frozen=True)
class Replicate:
    def __repr__(self):
        return "R"


@dataclass(frozen=True)
class Partial:
    def __repr__(self):
        return "P"


@dataclass(frozen=True)
class Shard:
    dim: int
    blocks: int | tuple = 1        # k equal blocks, or the sizes of unequal ones

    @property
    def unequal(self) -> bool:
        """Blocks of unequal sizes (a grouped-query q|k|v)."""
        return isinstance(self.blocks, tuple)

    def __repr__(self):
        if self.unequal:
            return f"S({self.dim},b{'|'.join(map(str, self.blocks))})"
        return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim},b{self.blocks})"


def block_sizes(n: int, blocks) -> tuple | None:
    """The block sizes of a dim of length ``n`` under ``blocks`` (None for a plain shard)."""
    if isinstance(blocks, tuple):
        return blocks
    return None if blocks == 1 else (n // blocks,) * blocks


Placement = Union[Replicate, Partial, Shard]
R = Replicate()
P = Partial()


@dataclass(frozen=True)
class DistSpec:
    """One placement per mesh axis, in ``AXES`` order: ``DistSpec(dp=Shard(0), tp=Shard(2))``."""
    dp: Placement = R
    pp: Placement = R
    tp: Placement = R

    def on(self, axis: str) -> Placement:
        return getattr(self, axis)

    def with_axis(self, axis: str, placement: Placement) -> "DistSpec":
        return replace(self, **{axis: placement})

    @property
    def placements(self) -> tuple:
        return tuple(self.on(a) for a in AXES)

    def __repr__(self):
        shown = [f"{a}={self.on(a)!r}" for a in AXES if self.on(a) != R]
        return "(" + ", ".join(shown) + ")" if shown else "R"


def local_size(n: int, t: int, blocks=1) -> int:
    """Local length of a dim of global length ``n`` sharded t ways (padded up when t does not divide)."""
    sizes = block_sizes(n, blocks)
    if sizes:
        return sum(b // t for b in sizes)
    return -(-n // t)


def local_shape(shape, placement: Placement, t: int):
    """The local shape of a tensor of global ``shape`` under one placement on an axis of size t."""
    shape = list(shape)
    if isinstance(placement, Shard):
        shape[placement.dim] = local_size(shape[placement.dim], t, placement.blocks)
    return tuple(shape)


def shard_range(n: int, t: int, rank: int, blocks=1):
    """Global index ranges ``[(start, stop), ...]`` rank ``rank`` holds of a dim of length ``n``.

    One range per block; the last rank's range of a padded dim is clipped to ``n`` (the rest is padding).
    """
    sizes = block_sizes(n, blocks)
    if sizes:
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        return [(s + rank * (b // t), s + (rank + 1) * (b // t)) for s, b in zip(starts, sizes)]
    c = -(-n // t)
    return [(min(rank * c, n), min((rank + 1) * c, n))]


def shardable(n: int, t: int, blocks=1, allow_pad: bool = False) -> bool:
    """Whether a dim of length n can be sharded t ways (evenly, or padded when the consumer allows)."""
    if t == 1:
        return True
    if isinstance(blocks, tuple):
        return sum(blocks) == n and all(b % t == 0 for b in blocks)
    if blocks > 1:
        return n % blocks == 0 and (n // blocks) % t == 0
    # padded: every rank must keep at least one real element (a shard of pure padding has no max)
    return n % t == 0 or (allow_pad and local_size(n, t) * (t - 1) < n)
