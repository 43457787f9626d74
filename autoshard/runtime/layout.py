"""Where a rank's chunk of a sharded dim lives: per block (fused q|k|v), padded at the end (vocab)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard.ir.placement import local_size


def take_shard(x, dim, n, size, rank, blocks=1):
    """Rank ``rank``'s chunk (of ``size``) of the full ``x`` along ``dim`` (length ``n``)."""
    if isinstance(blocks, tuple):   # unequal blocks: rank r's chunk of each, side by side
        return torch.cat([b.narrow(dim, rank * (len_ // size), len_ // size)
                          for b, len_ in zip(x.split(list(blocks), dim), blocks)], dim)
    if blocks > 1:
        b = x.unflatten(dim, (blocks, n // blocks))
        c = n // blocks // size
        return b.narrow(dim + 1, rank * c, c).flatten(dim, dim + 1)
    c = local_size(n, size)
    return pad_to(x, dim, c * size).narrow(dim, rank * c, c)


def pad_to(x, dim, length):
    """``x`` with zeros after its end along ``dim`` up to ``length`` (itself where it is that long)."""
    short = length - x.shape[dim]
    return F.pad(x, [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, short]) if short > 0 else x


def assemble(parts_cat, dim, n, size, blocks=1):
    """Inverse of ``take_shard`` on the concatenation of all ranks' chunks: the full tensor."""
    if isinstance(blocks, tuple):
        per_rank = [p.split([b // size for b in blocks], dim) for p in parts_cat.chunk(size, dim)]
        return torch.cat([per_rank[r][k] for k in range(len(blocks)) for r in range(size)], dim)
    if blocks > 1:
        c = n // blocks // size
        x = parts_cat.unflatten(dim, (size, blocks, c)).transpose(dim, dim + 1)
        return x.flatten(dim, dim + 2)
    return parts_cat.narrow(dim, 0, n)


def gather_full(x, dim, n, comm, blocks, phase):
    """All-gather the chunks of a dim of global length ``n`` on ``comm``'s axis: the full tensor."""
    return assemble(comm.all_gather(x, dim, phase), dim, n, comm.size, blocks)


def blockwise(collective, x, dim, blocks):
    """``collective(x, dim)`` along a dim of ``blocks`` equal blocks, each sharded over the ranks
    (``take_shard``'s layout): run on ``x`` viewed ``(blocks, n / blocks)`` along it, on the dim inside the
    blocks, where a plain all-gather or reduce-scatter moves every block at once; its result viewed back."""
    if blocks == 1:
        return collective(x, dim)
    return collective(x.unflatten(dim, (blocks, -1)), dim + 1).flatten(dim, dim + 1)
