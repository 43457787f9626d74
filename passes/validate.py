"""Validation passes: checks that change nothing, placed where a wrong input or a wrong rewrite shows.

- ``check_heads_pass`` (before planning): attention heads that tp does not divide are a clear error;
  dropout is one warning a program (ranks must draw the same masks: seed them identically);
- ``check_local_shapes_pass`` (last): runs the local program on meta tensors and checks every value's
  shape against the plan, catching a wrong literal size or a wrong collective before any process starts.
"""
from __future__ import annotations


import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.passes.attention import attention_layouts
from autoshard.passes.shapes import module_path
from autoshard.ir.errors import warn_user

aten = torch.ops.aten


class ShapeCheckError(AssertionError):
    """The local program computes another shape than the plan says: a compiler bug, with the node."""


def check_heads_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Query heads must divide evenly over tp (sdpa and eager attention alike): say which module, how many
    heads, and which tp sizes work. Dropout in a replicated region warns."""
    t = ctx.mesh.tp
    if t == 1:
        return gm
    for lay in attention_layouts(gm, t):
        if lay.q_heads % t:
            ok = [d for d in range(1, lay.q_heads + 1) if lay.q_heads % d == 0]
            raise ValueError(f"attention in '{lay.module}' has {lay.q_heads} heads, which tp={t} does not divide: "
                             f"tensor parallelism splits attention by heads; use tp in {ok}")
    dropouts = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.dropout.default:
            p, train = (list(n.args[1:3]) + [0.5, True])[:2]
        elif n.op == "call_function" and n.target is aten.scaled_dot_product_attention.default:
            p, train = (n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p", 0.0)), True   # SDPA's own
        else:
            continue
        if p > 0 and train and module_path(n) not in dropouts:
            dropouts.append(module_path(n))
    if dropouts:   # one warning a program, naming the modules
        shown = ", ".join(f"'{m}'" for m in dropouts[:4]) + (f" and {len(dropouts) - 4} more" if len(dropouts) > 4 else "")
        warn_user(f"dropout in {shown}: the tp ranks draw their masks from their own torch RNG, so seed every "
                  "rank identically (torch.manual_seed(seed) on all ranks): replicated activations then draw "
                  "identical masks, and a sharded one draws the whole tensor's mask on every rank and keeps its "
                  "part (passes/sharded_dropout.py), as one device would")
    return gm


def check_local_shapes_pass(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    """Run the local program on meta tensors; every tensor's shape must equal its ``LOCAL_SHAPE``. Each
    node keeps its meta value (``LOCAL_VAL``: dtype and strides too) for the passes after this one."""
    inputs = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            shape = M.LOCAL_SHAPE.get(n)
            v = n.meta["val"]
            inputs.append(torch.empty(shape, dtype=v.dtype, device="meta") if shape is not None else v)

    class Checker(fx.Interpreter):
        def call_function(self, target, args, kwargs):
            # keep everything on meta: HF moves masks and tables with .to(device), by keyword or by position
            meta = torch.device("meta")
            args = tuple(meta if isinstance(a, torch.device) else a for a in args)
            kwargs = {k: (meta if isinstance(v, torch.device) else v) for k, v in kwargs.items()}
            return super().call_function(target, args, kwargs)

        def run_node(self, node):
            out = super().run_node(node)
            if isinstance(out, torch.Tensor) and not out.is_meta:  # creation ops (arange) default to cpu
                out = out.to("meta")
            if isinstance(out, torch.Tensor) and node.op != "output":
                want = M.LOCAL_SHAPE.get(node)
                if want is None or tuple(out.shape) != tuple(want):
                    raise ShapeCheckError(f"local shape of {node.name} ({node.format_node()}) is "
                                          f"{tuple(out.shape)}, the plan says {want}")
                M.LOCAL_VAL.set(node, out)
            return out

    Checker(gm).run(*inputs)
    return gm
