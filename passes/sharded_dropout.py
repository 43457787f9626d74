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

Only even shards (one block, a dimension tp divides); a blocked or uneven shard stays torch's dropout
and the fusion report says so. SDPA's own ``dropout_p`` draws inside the attention op: the pass before
this one (``sdpa_dropout``) writes such a call out on CPU, with an explicit dropout that this pass then
rewrites like any other. After ``tp_rewrite`` (the placements are local there), before the
recompute passes (which tag the new nodes with their region: a recompute restores the RNG state, so it
draws the same mask again) and before ``fuse``'s philox rewrite of the replicated dropouts.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir.placement import Replicate, Shard
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
        dim = _even_shard(spec, shape, t)
        if dim is None:
            continue
        length = shape[dim] // t
        whole = spec.with_axis("tp", Replicate())
        with g.inserting_before(n):
            full = g.call_function(aten.new_empty.default, (x, list(shape)))
            mask = g.call_function(aten.bernoulli.p, (full, 1.0 - p))
            part = g.call_function(aten.slice.Tensor, (mask, dim, rank * length, (rank + 1) * length))
            noise = g.call_function(aten.div.Tensor, (part, 1.0 - p))
            out = g.call_function(aten.mul.Tensor, (x, noise))
        local = M.LOCAL_SHAPE.get(n)
        like = x.meta.get("val")
        dtype = like.dtype if isinstance(like, torch.Tensor) else torch.float32
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
