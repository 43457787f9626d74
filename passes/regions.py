"""Inline the higher-order regions ``torch.export`` emits, so every later pass sees one flat ATen graph.

Pre-dispatch export wraps a region that runs under another grad mode or autocast state in a
higher-order op with its own subgraph: ``wrap_with_set_grad_enabled(False, submod, *operands)`` for
the ``@torch.no_grad()`` rotary-embedding tables of Llama, Qwen2, Mistral, Gemma, Phi, GPT-NeoX and
Falcon; ``wrap_with_autocast(...)`` only when the model was traced under an ambient autocast. Left in
place, the planner never sees the region's ops (the cause of the "KeyError: 'tp_strategy'" those
families used to hit: the subgraph's ``get_attr`` node had no strategy).

A grad-disabled region is inlined with ``aten.detach`` on each tensor it returns: no gradient flows out
of a no_grad region, so forward values and every gradient are unchanged. An autocast region is
inlined only when it *disables* autocast (a no-op for a program that runs without autocast); any
other higher-order op is a ``CaptureError`` that names it and its module.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autoshard.passes.shapes import module_path

aten = torch.ops.aten


class RegionError(RuntimeError):
    """A higher-order op autoshard cannot inline (the message names it, its module and the fix)."""


def _hop_name(node):
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return None


def _subgraph_index(node, name):
    """(index of the subgraph's get_attr argument, whether its outputs leave a no-grad region)."""
    if name == "wrap_with_set_grad_enabled":
        return 1, node.args[0] is False
    if name == "wrap_with_autocast":
        enabled = node.args[2]
        if enabled:
            raise RegionError(f"the forward of '{module_path(node)}' was captured under torch.autocast: autoshard "
                              "compiles the model as written; call parallelize outside autocast (mixed precision "
                              "is an option of parallelize, not an ambient autocast)")
        return 4, False
    raise RegionError(f"'{module_path(node)}' uses the higher-order op '{name}' ({node.format_node()}), which autoshard "
                      "cannot plan: rewrite that part of the forward without it (torch.cond, flex_attention and "
                      "checkpoint regions are not supported yet)")


def inline_regions(gm: fx.GraphModule) -> list:
    """Inline every higher-order region of ``gm`` in place; returns the names of the regions inlined."""
    g, inlined = gm.graph, []
    for n in list(g.nodes):
        name = _hop_name(n)
        if name is None:
            continue
        k, no_grad = _subgraph_index(n, name)
        get_attr = n.args[k]
        sub = getattr(gm, get_attr.target)
        inlined += inline_regions(sub)  # nested regions first
        placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
        with g.inserting_before(n):
            outs = g.graph_copy(sub.graph, dict(zip(placeholders, n.args[k + 1:])))
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            if no_grad:
                outs = [_detach(g, o) for o in outs]
        for user in list(n.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise RegionError(f"region '{name}' in '{module_path(n)}' is read by {user.format_node()}, not by "
                                  "getitem: an export layout autoshard does not know")
            user.replace_all_uses_with(outs[user.args[1]])
            g.erase_node(user)
        g.erase_node(n)
        if not get_attr.users:
            g.erase_node(get_attr)
        inlined.append(f"{name} in {module_path(n)}")
    gm.delete_all_unused_submodules()
    g.lint()
    gm.recompile()
    return inlined


def _detach(g, node):
    if not isinstance(node, fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
        return node
    d = g.call_function(aten.detach.default, (node,))
    d.meta = dict(node.meta)
    return d
