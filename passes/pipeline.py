"""The compiler: one ordered list of passes, each ``GraphModule -> GraphModule``.

``compile_graph`` runs them in order, lints the graph after each, and (when dumping) writes a numbered
text file of the graph with every node's placement and local shape. A pass can be switched off by name
(``CompileConfig.disable``) to bisect a wrong result.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autoshard.passes import dump as D
from autoshard.passes.capture import decompose_bias_pass
from autoshard.passes.cost import CostModel
from autoshard.passes.overlap import overlap_grad_allreduce_pass
from autoshard.passes.plan import PlanInfo, plan_pass
from autoshard.passes.tp_rewrite import check_local_shapes_pass, fuse_bias_pass, tp_rewrite_pass


@dataclass
class CompileContext:
    comm: object                         # TPComm of the rank being compiled
    cost_model: CostModel = field(default_factory=CostModel)
    pins: dict = field(default_factory=dict)
    loss_only: bool = False
    disable: tuple = ()
    dump_dir: str | None = None
    info: PlanInfo | None = None
    timings: dict = field(default_factory=dict)


def loss_only_pass(gm, cc):
    """With ``loss_only``, return None for every non-scalar output so the logits are never gathered."""
    if not cc.loss_only:
        return gm
    out = next(n for n in gm.graph.nodes if n.op == "output")

    def keep(a):
        v = a.meta.get("val")
        return a if isinstance(v, torch.Tensor) and v.dim() == 0 else None

    out.args = (tuple(keep(a) if isinstance(a, fx.Node) else a for a in out.args[0]),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def plan(gm, cc):
    cc.info = PlanInfo(cc.comm.size)
    return plan_pass(gm, cc.comm.size, cc.cost_model, cc.pins, cc.info)


PASSES = [
    # (name, pass, why here)
    ("loss_only", loss_only_pass, "drop outputs before planning, so nothing is priced for gathering them"),
    ("decompose_bias", lambda gm, cc: decompose_bias_pass(gm), "a row-parallel bias must be added after the all-reduce"),
    ("plan", plan, "placements for every node, from the op rules and the ILP"),
    ("tp_rewrite", lambda gm, cc: tp_rewrite_pass(gm, cc.comm), "local shapes, collectives, lowerings"),
    ("fuse_bias", lambda gm, cc: fuse_bias_pass(gm), "fold bias adds that stayed local back into the matmul"),
    ("overlap_grad_allreduce", lambda gm, cc: overlap_grad_allreduce_pass(gm),
     "fuse f into its column-parallel matmul: the gradient all-reduce overlaps dW"),
    ("check_local_shapes", lambda gm, cc: check_local_shapes_pass(gm), "run on meta: every local shape as planned"),
]


def compile_graph(gm: fx.GraphModule, cc: CompileContext) -> fx.GraphModule:
    if cc.dump_dir:
        D.dump_graph(gm, cc.dump_dir, 0, "capture")
    for i, (name, fn, _why) in enumerate(PASSES, start=1):
        if name in cc.disable:
            continue
        start = time.perf_counter()
        gm = fn(gm, cc)
        gm.graph.lint()
        cc.timings[name] = time.perf_counter() - start
        if cc.dump_dir:
            D.dump_graph(gm, cc.dump_dir, i, name)
    return gm
