"""Bias placement: split biased matmuls before planning, fold them back after the rewrite.

A row-parallel matmul yields a Partial sum, and its bias must be added once, after the all-reduce
(Megatron's RowParallelLinear). ``decompose_bias_pass`` makes every bias a separate ``add`` so the
planner can place it there; ``fuse_bias_pass`` folds each add that stayed local back into its matmul.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.ir import meta as M

aten = torch.ops.aten


def decompose_bias_pass(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    """Split ``linear(x, W, b)`` into ``linear(x, W) + b`` and ``addmm(b, x, W)`` into ``mm(x, W) + b``."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target is aten.linear.default and len(n.args) > 2 and n.args[2] is not None:
            (x, w, b), matmul = n.args[:3], aten.linear.default
        elif n.target is aten.addmm.default and not n.kwargs:
            (b, x, w), matmul = n.args[:3], aten.mm.default
        else:
            continue
        with g.inserting_after(n):
            mm = g.call_function(matmul, (x, w))
            mm.meta = {**n.meta, "val": _meta_like(n.meta["val"])}
            with g.inserting_after(mm):
                add = g.call_function(aten.add.Tensor, (mm, b))
        n.replace_all_uses_with(add)
        add.meta = dict(n.meta)
        g.erase_node(n)
        add.name = n.name        # the value keeps its name: a pipeline cut may send it by that name
    g.lint()
    gm.recompile()
    return gm


def _meta_like(v):
    return torch.empty(v.shape, dtype=v.dtype, device="meta")


def fuse_bias_pass(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    """Fold ``add(linear(x, W), b)`` back into ``linear(x, W, b)`` (and ``mm`` + bias into ``addmm``).

    Undoes ``decompose_bias_pass`` wherever the bias add stayed local to the matmul, i.e. everywhere but
    after a row-parallel all-reduce: one fused kernel instead of a matmul plus an elementwise pass.
    """
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not aten.add.Tensor or len(n.args) != 2 or n.kwargs:
            continue  # (add with alpha scales the bias: not foldable)
        mm, b = n.args
        if not isinstance(mm, fx.Node) or not isinstance(b, fx.Node) or len(mm.users) != 1:
            continue
        if b.op != "placeholder" or len(M.LOCAL_SHAPE.get(b, None) or ()) != 1:
            continue
        if mm.target is aten.linear.default and len(mm.args) == 2:
            with g.inserting_before(n):
                fused = g.call_function(aten.linear.default, (mm.args[0], mm.args[1], b))
        elif mm.target is aten.mm.default:
            with g.inserting_before(n):
                fused = g.call_function(aten.addmm.default, (b, mm.args[0], mm.args[1]))
        else:
            continue
        fused.meta = dict(n.meta)
        n.replace_all_uses_with(fused)
        g.erase_node(n)
        g.erase_node(mm)
        fused.name = n.name      # as decompose_bias_pass: the value keeps its name
    g.lint()
    gm.recompile()
    return gm
