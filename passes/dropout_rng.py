"""Before fusing: dropout on a tp-replicated activation as a mask recomputable from a seed.

``dropout(x, p, train=True)`` becomes ``x * dropout_keep(seed, shape, p, stream)`` (``kernels/rng.py``):
one seed per forward, drawn in the graph from torch's generator on x's device, and one stream per
dropout site. A fusion group then draws the mask inside its kernel and its backward kernel draws it
again, so neither the mask nor a bool tensor is kept for backward. A dropout on a tp shard was
already rewritten by ``sharded_dropout`` (the single device's mask, its part kept); one still on a
shard here (none that the placements make today) stays torch's ``dropout``, which this rewrite does not
model; the fusion report says so.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir.placement import Replicate
from autoshard.kernels.rng import draw_seed

aten = torch.ops.aten


def dropout_args(n: fx.Node) -> tuple:
    """``(input, p, train)`` of an ``aten.dropout`` node, defaults filled in."""
    args = list(n.args) + [None] * (3 - len(n.args))
    p = n.kwargs.get("p", args[1])
    train = n.kwargs.get("train", args[2])
    return args[0], (0.5 if p is None else float(p)), (True if train is None else bool(train))


def rewrite_dropout(gm: fx.GraphModule, tp: int) -> list:
    """Rewrite in place; returns ``(node name, reason)`` for each dropout left to torch."""
    seed, stream, kept = None, 0, []
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.dropout.default:
            continue
        x, p, train = dropout_args(n)
        if not train or p == 0.0:
            continue
        spec = M.SPEC.get(x, None)
        if tp > 1 and spec is not None and not isinstance(spec.on("tp"), Replicate):
            kept.append((n.name, f"dropout on a tp-sharded activation ({spec.on('tp')!r}) keeps torch's RNG: "
                                 "its shards need masks of their own"))
            continue
        val = M.LOCAL_VAL.get(x)
        with gm.graph.inserting_before(n):
            if seed is None:
                # drawn beside a parameter, not the activation: a value of parameters alone is recomputed by
                # each pipeline chunk that needs it, where one computed from an activation could not cross a cut
                like = next((a for a in gm.graph.nodes if a.op == "placeholder" and M.KIND.get(a, None) == "parameter"),
                            x)
                seed = gm.graph.call_function(draw_seed, (like,))
                M.LOCAL_VAL.set(seed, torch.empty((), dtype=torch.int64, device="meta"))
                M.REQUIRES_GRAD.set(seed, False)
            # x * keep in fp32, then cast: the scale 1/(1-p) is not rounded to x's dtype (the kernel
            # computes in fp32 too, so fused and unfused agree in bf16)
            keep = gm.graph.call_function(torch.ops.autoshard.dropout_keep.default, (seed, list(val.shape), p, stream))
            prod = gm.graph.call_function(aten.mul.Tensor, (x, keep))
            out = gm.graph.call_function(aten._to_copy.default, (prod,), {"dtype": val.dtype})
        for node, v in ((keep, torch.empty(val.shape, device="meta")),
                        (prod, torch.empty(val.shape, dtype=torch.promote_types(val.dtype, torch.float32),
                                           device="meta")),
                        (out, torch.empty(val.shape, dtype=val.dtype, device="meta"))):
            M.LOCAL_VAL.set(node, v)
            M.REQUIRES_GRAD.set(node, node is out and M.REQUIRES_GRAD.get(n, True))
            if M.RECOMPUTE.has(n):        # still inside its layer's recompute region
                M.RECOMPUTE.set(node, M.RECOMPUTE.get(n))
        for key in (M.SPEC, M.LOCAL_SHAPE):
            if key.has(n):
                key.set(out, key.get(n))
        n.replace_all_uses_with(out)
        gm.graph.erase_node(n)
        stream += 1
    return kept
