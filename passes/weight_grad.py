"""Split each stage's backward into B and W, for the zero-bubble schedules (``schedule="zb-h1"``, or
``"auto"`` when it chooses one: the pass reads the schedule ``pipeline_split`` planned).

Qi et al. (ICLR 2024) split a pipeline stage's backward in two: B, the gradient of the stage's input,
which the previous stage is waiting for, and W, the weights' gradients, which nobody waits for, so a
schedule can run W in the time 1F1B's ranks sit idle. Runtimes that work on a module find the split at
run time with autograd tricks; autoshard holds the graph, so the split is a rewrite made here, once.

Almost all of a transformer's weight-gradient work is its matmuls' ``dW = dy^T x``. Each matmul whose
weight is a parameter (``linear``, ``addmm``, ``mm`` or ``matmul`` reading the parameter through views
and casts, and the tensor-parallel ``ColumnParallelMatmul``) becomes ``ir.weight_grad.deferred_linear``
(the node keeps its name, so recompute regions and dumps still name it), whose backward leaves
``(x, dy)`` for W instead of computing ``dW``. The rest stays in B: the norms' and biases' gradients
(sums over tokens), the embedding's (a scatter) and the chunked LM head's (it computes its gradient
with the loss). The split so changes when gradients are computed, not what they are.

The report (``WeightGradPlan`` in ``gm.meta``) lists the matmuls moved to W, per parameter, and the
parameters whose gradients stay in B; ``pipeline.md`` prints it per stage.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir import ops
from autoshard.ir.pipeline import STAGE_PLAN
from autoshard.ir.weight_grad import WEIGHT_GRAD_PLAN, DeferredMatmul, WeightGradPlan, deferred_linear

aten = torch.ops.aten

# ops that pass a parameter on unchanged but for layout or dtype: the weight a matmul reads through them
# is still the parameter, and autograd carries W's gradient back along them
_THROUGH = {aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default, aten.reshape.default,
            aten._unsafe_view.default, aten._to_copy.default, aten.to.dtype, aten.alias.default,
            aten.contiguous.default, aten.clone.default}


def parameter_of(node) -> fx.Node | None:
    """The parameter placeholder ``node`` is, or reads through layout and dtype changes only."""
    while isinstance(node, fx.Node):
        if node.op == "placeholder":
            return node if M.KIND.get(node, None) == "parameter" else None
        if node.op != "call_function" or node.target not in _THROUGH:
            return None
        node = node.args[0]
    return None


def _matmul_operands(node: fx.Node):
    """``(x, weight, bias, transposed)`` of a matmul by a parameter, or None."""
    if node.op != "call_function":
        return None
    args, kwargs = node.args, node.kwargs
    if node.target is aten.linear.default:
        x, w, b = (list(args) + [None])[:3]
        return (x, w, kwargs.get("bias", b), False)
    if node.target is aten.addmm.default and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1:
        b, x, w = args[:3]
        return (x, w, b, True)
    if node.target in (aten.mm.default, aten.matmul.default) and len(args) == 2:
        w = args[1]
        if isinstance(w, fx.Node) and len(getattr(w.meta.get("val"), "shape", ())) == 2:
            return (args[0], w, None, True)
    return None


def split_weight_grad_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    plan = gm.meta.get(STAGE_PLAN)
    if ctx.options.pipeline is None or plan is None or plan.schedule is None or not plan.schedule.split:
        return gm
    deferred = []
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), ops.ColumnParallelMatmul):
            param = parameter_of(node.args[1])
            if param is not None:
                gm.get_submodule(node.target).defer_weight = True
                deferred.append(_record(node, param))
            continue
        operands = _matmul_operands(node)
        if operands is None or parameter_of(operands[1]) is None:
            continue
        x, w, b, transposed = operands
        node.target, node.args, node.kwargs = deferred_linear, (x, w, b, transposed), {}
        deferred.append(_record(node, parameter_of(w)))
    used = {d.parameter for d in deferred}
    in_b = tuple(M.NAME.get(n) for n in gm.graph.nodes
                 if n.op == "placeholder" and M.KIND.get(n, None) == "parameter" and M.NAME.get(n) not in used)
    gm.meta[WEIGHT_GRAD_PLAN] = WeightGradPlan(tuple(deferred), in_b)
    gm.recompile()
    return gm


def _record(node: fx.Node, param: fx.Node) -> DeferredMatmul:
    val = param.meta.get("val")
    return DeferredMatmul(node.name, M.NAME.get(param), tuple(getattr(val, "shape", ())))
