"""Lower: the records of one rank's program, read off its final graph.

Parameters come from the placeholders (in order); collectives from the graph's ``ir.ops`` records, each
of which lists its own steps. ``Program.collectives`` is therefore the same list the dump prints and the
runtime's tracer is checked against.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir import ops
from autoshard.ir.partial_grads import TP_PARTIAL_GRADS
from autoshard.ir.program import CollectiveRecord, ParamRecord


def param_records(gm: fx.GraphModule) -> list:
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder" and M.KIND.get(n) == "parameter":
            out.append(ParamRecord(M.NAME.get(n), M.SPEC.get(n), tuple(M.GLOBAL_SHAPE.get(n)),
                                   tuple(M.LOCAL_SHAPE.get(n)), n.meta["val"].dtype))
    return out


def collective_records(gm: fx.GraphModule) -> list:
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_module":
            continue
        op = gm.get_submodule(n.target)
        if not isinstance(op, ops.ParallelOp):
            continue
        src = n.args[0].meta.get("val") if n.args and isinstance(n.args[0], fx.Node) else None
        isz = src.element_size() if isinstance(src, torch.Tensor) else 4
        for s in op.steps():
            out.append(CollectiveRecord(n.name, M.SOURCE.get(n, None), s.axis, s.phase, s.kind, s.shape,
                                        s.itemsize or isz, s.what, s.stacked))
    if TP_PARTIAL_GRADS in gm.meta:
        out.append(gm.meta[TP_PARTIAL_GRADS].record())
    return out
