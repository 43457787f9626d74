"""Sharding specs: the placement vocabulary of DTensor, plus the two facts it leaves implicit.

A tensor's spec has one placement per mesh axis. On the tensor-parallel axis a placement is one of

- ``Replicate()``: every rank holds the whole tensor (and, by our invariant, the whole gradient);
- ``Shard(dim)``: rank r holds the r-th of t equal chunks of ``dim``;
- ``Shard(dim, blocks=k)``: ``dim`` is k equal blocks side by side (the q|k|v of a fused projection) and
  rank r holds the r-th chunk *of every block* — DTensor's ``_StridedShard``. Cutting a fused ``c_attn``
  in one contiguous chunk would give rank 0 all of q and half of k: the classic silent wrong result;
- ``Partial()``: every rank holds a summand; the tensor is their sum (a row-parallel matmul's output).

A dim that is not divisible by t may still be sharded where the consumer can mask the tail (the vocab
dim of embedding and LM head): the local chunk is ``ceil(n / t)`` long and the last rank's tail is
padding (see ``local_size``).

Gradient invariant (what makes the inserted collectives Megatron's f and g): the gradient of a tensor has
the same placement as the tensor, except that a ``Partial`` tensor's gradient is replicated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


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
    blocks: int = 1

    def __repr__(self):
        return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim},b{self.blocks})"


Placement = Union[Replicate, Partial, Shard]
R = Replicate()
P = Partial()


def local_size(n: int, t: int, blocks: int = 1) -> int:
    """Local length of a dim of global length ``n`` sharded t ways (padded up when t does not divide)."""
    if blocks > 1:
        return blocks * (n // blocks // t)
    return -(-n // t)


def local_shape(shape, placement: Placement, t: int):
    """The local shape of a tensor of global ``shape`` under one tensor-parallel placement."""
    shape = list(shape)
    if isinstance(placement, Shard):
        shape[placement.dim] = local_size(shape[placement.dim], t, placement.blocks)
    return tuple(shape)


def is_padded(shape, placement: Placement, t: int) -> bool:
    return isinstance(placement, Shard) and placement.blocks == 1 and shape[placement.dim] % t != 0


def shard_range(n: int, t: int, rank: int, blocks: int = 1):
    """Global index ranges ``[(start, stop), ...]`` rank ``rank`` holds of a dim of length ``n``.

    One range per block; the last rank's range of a padded dim is clipped to ``n`` (the rest is padding).
    """
    if blocks > 1:
        b, c = n // blocks, n // blocks // t
        return [(k * b + rank * c, k * b + (rank + 1) * c) for k in range(blocks)]
    c = -(-n // t)
    return [(min(rank * c, n), min((rank + 1) * c, n))]


def shardable(n: int, t: int, blocks: int = 1, allow_pad: bool = False) -> bool:
    """Whether a dim of length n can be sharded t ways (evenly, or padded when the consumer allows)."""
    if t == 1:
        return True
    if blocks > 1:
        return n % blocks == 0 and (n // blocks) % t == 0
    # padded: every rank must keep at least one real element (a shard of pure padding has no max)
    return n % t == 0 or (allow_pad and local_size(n, t) * (t - 1) < n)
