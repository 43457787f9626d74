"""Dropout on a tp-sharded activation draws the single-device model's mask, and keeps its own part.

A dropout whose input is sharded over tp (the residual stream's sequence shard under sequence
parallelism, or the attention probabilities' head shard) ran torch's ``dropout`` on the local part.
Every tp rank holds the same torch RNG state (they must, for the replicated dropouts to agree), so each
drew the *same* pattern over a different part, where one device draws one mask over the whole tensor.

Here such a dropout draws the whole tensor's mask, as the single device does (``new_empty`` of the
global shape, ``bernoulli(1 - p)``: the ops and the draw of torch's ``dropout`` on a CPU tensor), keeps
its own slice, and scales and multiplies as torch does (``noise / (1 - p)``, then ``x * noise``). Each
rank's RNG then advances as the single device's, so every later dropout, replicated or sharded, draws
the single device's mask too: the program trains exactly like the model with dropout on. The cost is
the random numbers of the whole tensor on every rank (t times its own part's), drawn and freed at once:
only the scaled slice is kept for backward. Megatron's model-parallel RNG tracker gives each rank its own
seed instead, which is cheaper but draws masks no single device would.

Any tp shard: one even block; several blocks (a sequence shard seen through a ``[b*s, h]`` reshape, as
OPT's MLP flattens the stream, holds one range of each of the ``b`` blocks: the ranges are sliced and
concatenated); or a padded dim (the padding's mask is zero). Had such a dropout stayed torch's, its
ranks would draw the same pattern over their parts, and draw fewer numbers than the single device, so
every later mask would differ too: a wrong result that no error announces.

SDPA's own ``dropout_p`` draws inside the attention op: the pass before this one (``sdpa_dropout``)
writes such a call out on CPU, with an explicit dropout that this pass then rewrites like any other. After ``tp_rewrite`` (the placements are local there), before the
recompute passes (which tag the new nodes with their region: a recompute restores the RNG state, so it
draws the same mask again) and before ``fuse``'s philox rewrite of the replicated dropouts.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir.placement import Replicate, Shard, local_size, shard_range, shardable
from autoshard.passes.dropout_rng import dropout_args

aten = torch.ops.aten


def like_node(node: fx.Node, template: fx.Node, spec, glob, loc, requires_grad: bool, dtype) -> fx.Node:
    """Give a node inserted after ``tp_rewrite`` what the later passes read: ``template``'s meta (module
    path, stage, region), a meta value of its local shape, its placement and both shapes."""
    node.meta.update({k: v for k, v in template.meta.items() if k != "val"})
    node.meta["val"] = torch.empty(tuple(loc), dtype=dtype, device="meta")
    M.SPEC.set(node, spec)
    M.GLOBAL_SHAPE.set(node, tuple(glob))
    M.LOCAL_SHAPE.set(node, tuple(loc))
    M.REQUIRES_GRAD.set(node, requires_grad)
    return node


def _even_shard(spec, shape, t: int):
    """The shard's dim where ``spec`` is one even block over tp, else None."""
    pl = spec.on("tp") if spec is not None else None
    if not isinstance(pl, Shard) or pl.unequal or pl.blocks != 1 or shape is None or shape[pl.dim] % t:
        return None
    return pl.dim


def _held(spec, shape, t: int, rank: int):
    """``(dim, [(start, stop), ...], local length)``: the global ranges of ``shape[dim]`` this rank holds
    under ``spec``'s tp shard (one range a block: a sequence shard seen through a ``[b*s, h]`` reshape
    is ``b`` blocks; the last rank of a padded dim holds fewer real rows than its local length), or
    None where the tensor is not sharded over tp."""
    pl = spec.on("tp") if spec is not None else None
    if not isinstance(pl, Shard) or shape is None or not shardable(shape[pl.dim], t, pl.blocks, allow_pad=True):
        return None
    n = shape[pl.dim]
    return pl.dim, shard_range(n, t, rank, pl.blocks), local_size(n, t, pl.blocks)


def _own_part(g: fx.Graph, mask: fx.Node, dim: int, ranges: list, length: int, ndim: int) -> tuple:
    """``(part, steps)``: this rank's part of the whole tensor's ``mask`` (its ranges along ``dim``,
    concatenated, padded with zeros up to the local ``length``: a padded shard's padding, zeros as
    ``take_shard`` writes it, stays zero), and the nodes between, each with its length along ``dim``."""
    steps = [(g.call_function(aten.slice.Tensor, (mask, dim, a, b)), b - a) for a, b in ranges]
    real = sum(b - a for a, b in ranges)
    if len(steps) > 1:
        steps.append((g.call_function(aten.cat.default, ([s for s, _ in steps], dim)), real))
    if real < length:
        pad = [0, 0] * (ndim - 1 - dim) + [0, length - real]
        steps.append((g.call_function(aten.constant_pad_nd.default, (steps[-1][0], pad, 0.0)), length))
    return steps[-1][0], steps[:-1]


def sharded_dropout_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    t, rank = ctx.mesh.tp, ctx.coords["tp"]
    if t == 1:
        return gm
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not aten.dropout.default:
            continue
        x, p, train = dropout_args(n)
        if not train or p == 0.0 or p >= 1.0:
            continue
        spec, shape = M.SPEC.get(x, None), M.GLOBAL_SHAPE.get(x, None)
        held = _held(spec, shape, t, rank)
        if held is None:
            continue
        dim, ranges, length = held
        whole = spec.with_axis("tp", Replicate())
        local = M.LOCAL_SHAPE.get(n)
        with g.inserting_before(n):
            full = g.call_function(aten.new_empty.default, (x, list(shape)))
            mask = g.call_function(aten.bernoulli.p, (full, 1.0 - p))
            part, steps = _own_part(g, mask, dim, ranges, length, len(shape))
            noise = g.call_function(aten.div.Tensor, (part, 1.0 - p))
            out = g.call_function(aten.mul.Tensor, (x, noise))
        like = x.meta.get("val")
        dtype = like.dtype if isinstance(like, torch.Tensor) else torch.float32
        for node, size in steps:            # pieces of the whole mask, replicated: shapes of their own
            piece = list(shape)
            piece[dim] = size
            like_node(node, n, whole, piece, piece, False, dtype)
        for node, node_spec, glob, loc, grad in ((full, whole, shape, shape, False), (mask, whole, shape, shape, False),
                                                (part, spec, shape, local, False), (noise, spec, shape, local, False),
                                                (out, M.SPEC.get(n), M.GLOBAL_SHAPE.get(n), local,
                                                 M.REQUIRES_GRAD.get(n, True))):
            like_node(node, n, node_spec, glob, loc, grad, dtype)
        n.replace_all_uses_with(out)
        g.erase_node(n)
    g.lint()
    gm.recompile()
    return gm
