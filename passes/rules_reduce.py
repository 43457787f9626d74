"""Rules for ops that work along some dims and leave the others alone: reductions other than a sum
(``amax``, ``max.dim``, ``var``, ``argmax``, ...), ops along one dim (``cumsum``, ``topk``, ``sort``, and
the softmaxes ``rules.py`` sends here), and the triangle masks (``tril``, ``triu``: the last two dims).
``rms_norm`` shares ``rules.layer_norm``.

Each runs locally on a shard of any dim it does not work along, and that is exact: the result of every
slice of the other dims is computed from that slice alone. A shard of a dim it works along would need
a collective (a max across ranks is not a sum, so no ``Partial`` either), so it is not offered and the
planner gathers first. Without these rules a model's op was replicated whatever its input: GPT-OSS
all-gathered every layer's score matrix (its sinks' ``max(dim=-1)``), a head-sharded chunked scan
(Qwen3.5's ``tril``) every chunk's.

Which dims an op works along is read off its schema's ``dim`` and ``keepdim`` arguments, so one rule
covers every overload; ``max.other`` and ``min.other`` (two tensors, no dim) are pointwise, and
``rules.strategies_for`` sends them there (``elementwise``).
"""
from __future__ import annotations

import torch

from autoshard.ir.placement import Shard
from autoshard.passes.shapes import shape_of
from autoshard.passes.strategy import Strategy, _ins, _replicated, has_argument, op_argument, shard_options

aten = torch.ops.aten


def _dims(node, rank: int, default) -> set:
    """The dims ``node`` works along: its ``dim`` argument (an int or a list; None or an empty list is
    every dim), or ``default`` when the op has none."""
    if not has_argument(node, "dim"):
        return set(default)
    dim = op_argument(node, "dim")
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return set(range(rank))
    return {d % rank for d in ([dim] if isinstance(dim, int) else dim)}


def _along(node, ctx, worked: set, drops: bool):
    """Replicated, and a shard of every dim not in ``worked`` carried to the output (one dim less for
    each worked dim before it, where the op ``drops`` them)."""
    src = node.args[0]
    strategies = _replicated(node)
    if not isinstance(src, torch.fx.Node) or not shape_of(src):      # unknown, or a scalar
        return strategies
    for s in shard_options(src, shape_of(src), ctx):
        if s.dim not in worked:
            od = s.dim - sum(1 for d in worked if d < s.dim) if drops else s.dim
            strategies.append(Strategy(Shard(od, s.blocks), _ins(node, {src: s}), sharded=True))
    return strategies


def elementwise(node) -> bool:
    """``max.other`` / ``min.other``: two tensors compared element by element (a pointwise op)."""
    return has_argument(node, "other")


def reduction(node, ctx):
    """amax, amin, max/min (over a dim or all), argmax, argmin, var, std, prod, any, all: sharded on the
    dims they do not reduce."""
    rank = len(shape_of(node.args[0]) or ())
    if rank == 0:
        return _replicated(node)
    keep = bool(op_argument(node, "keepdim", False))
    return _along(node, ctx, _dims(node, rank, range(rank)), drops=not keep)


def along_dim(node, ctx):
    """cumsum, cumprod, cummax, cummin, logcumsumexp, topk, sort, softmax: each slice along ``dim`` on its own;
    the output keeps the input's rank. (Among exactly equal values, a GPU ``topk`` or ``sort`` may order
    the indices differently for fewer slices: the values agree, tied indices may not.)"""
    rank = len(shape_of(node.args[0]) or ())
    if rank == 0:
        return _replicated(node)
    return _along(node, ctx, _dims(node, rank, {rank - 1}), drops=False)


def triangle(node, ctx):
    """tril, triu: a mask of the last two dims."""
    rank = len(shape_of(node.args[0]) or ())
    return _along(node, ctx, {rank - 2, rank - 1}, drops=False)


REDUCE_RULES = {
    **{op: reduction for op in (aten.amax, aten.amin, aten.max, aten.min, aten.argmax, aten.argmin, aten.var,
                                aten.std, aten.prod, aten.any, aten.all)},
    **{op: along_dim for op in (aten.cumsum, aten.cumprod, aten.cummax, aten.cummin, aten.logcumsumexp,
                                aten.topk, aten.sort)},
    aten.tril: triangle, aten.triu: triangle,
}
