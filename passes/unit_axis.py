"""On a mesh axis of size 1 every collective is the identity: take its records out of the graph.

A pipeline without tensor parallelism (tp = 1) still goes through the tp planner, which places values
as it would for any size; the rewrite then inserts ``Redistribute`` and ``CopyToParallel`` records that
move nothing. Each is a Python call (and ``f`` an autograd node) per use per microbatch, about 300 of
them in an 8-layer GPT. This pass removes them, and turns a ``ColumnParallelMatmul`` (``f`` fused into a
matmul) back into the plain ``linear``, so a tp=1 program is the model's own ATen graph.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir import ops

aten = torch.ops.aten


def drop_unit_axis_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_module":
            continue
        op = gm.get_submodule(n.target)
        if not isinstance(op, ops.ParallelOp) or op.size != 1:
            continue
        if isinstance(op, (ops.Redistribute, ops.CopyToParallel, ops.SequenceGather, ops.GatheredReplica)):
            n.replace_all_uses_with(n.args[0])
        elif isinstance(op, ops.ColumnParallelMatmul):
            x, weight, *bias = n.args
            with gm.graph.inserting_before(n):
                if op.transposed:
                    w = gm.graph.call_function(aten.t.default, (weight,))
                    w.meta.update({k: v for k, v in weight.meta.items() if k != "val"})
                    w.meta["val"] = weight.meta["val"].t()
                    for key in (M.LOCAL_SHAPE, M.GLOBAL_SHAPE):
                        if key.has(weight):
                            key.set(w, tuple(reversed(key.get(weight))))
                    weight = w
                new = gm.graph.call_function(aten.linear.default, (x, weight, *bias))
            new.meta.update(n.meta)
            n.replace_all_uses_with(new)
        else:
            continue
        gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.delete_all_unused_submodules()
        gm.recompile()
    return gm
