"""Block hints: where the planner's blocked-shard options come from.

A rule enumerates the shards of a tensor from ``shard_options``: every dim t divides, plus the blocked
shards in the node's hints. Hints arrive two ways:

- backward, before planning (``block_hints``): a tensor split into pieces, or a reshape that unpacks 2 or
  3 pieces, marks the fused projection that made it (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``,
  ``nn.MultiheadAttention``'s ``in_proj``, an MoE's fused gate|up experts), carried up through views,
  transposes and pointwise ops to the weight;
- forward, while planning in graph order (``offer_blocked_outputs``, ``inherit_hints``): a blocked shard
  a node can produce (BLOOM's batch*heads dim, ``Shard(0, blocks=B)``) becomes an option its consumers
  may keep.
"""
from __future__ import annotations

import torch

from autoshard.ir.placement import Shard
from autoshard.passes.rules import POINTWISE, permutation, split_sizes
from autoshard.passes.rules_experts import expert_weight, is_grouped_mm
from autoshard.passes.shapes import map_shard_through_view, shape_of, view_groups
from autoshard.passes.strategy import RuleContext

aten = torch.ops.aten


def _packed_pieces(in_shape, out_shape):
    """``(dim, k)`` when a reshape unpacks one dim into k = 2 or 3 pieces and the rest
    (``nn.MultiheadAttention``'s ``(..., 3E) -> (..., 3, E)``), else None."""
    groups = view_groups(in_shape, out_shape) if in_shape and out_shape else None
    for gi, gj in groups or ():
        real_i = [d for d in gi if in_shape[d] != 1]
        real_j = [d for d in gj if out_shape[d] != 1]
        if len(real_i) == 1 and len(real_j) == 2 and out_shape[real_j[0]] in (2, 3):
            return real_i[0], out_shape[real_j[0]]
    return None


def block_hints(gm, t: int):
    """Find fused projections: a tensor split into k equal pieces along a dim wants ``Shard(dim, blocks=k)``,
    into pieces of unequal sizes ``Shard(dim, blocks=sizes)``.

    The hint is carried upstream through views and pointwise ops to the projection that made the tensor
    and from there to its weight and bias, so the planner can offer the strided shard everywhere along
    the way (``linear -> add(bias) -> view -> split`` in HF GPT-2).
    """
    hints = {}

    def add(node, dim, k):
        if (dim, k) in hints.setdefault(node, set()):
            return
        hints[node].add((dim, k))
        if node.op != "call_function":
            return
        packet = getattr(node.target, "overloadpacket", None)
        out = shape_of(node)
        if packet in (aten.view, aten.reshape, aten._unsafe_view, aten.alias):
            src = node.args[0]
            mapped = map_shard_through_view(out, shape_of(src), dim, 1, t)
            if mapped and shape_of(src)[mapped[0]] == out[dim]:
                add(src, mapped[0], k)
        elif packet in (aten.transpose, aten.permute, aten.t):     # an expert weight stored (out, in)
            add(node.args[0], permutation(node)[dim], k)
        elif packet in POINTWISE:
            for inp in node.all_input_nodes:
                s = shape_of(inp) or ()
                d = dim - (len(out) - len(s))
                if d >= 0 and s[d] == out[dim]:
                    add(inp, d, k)
        elif packet is aten.linear and dim == len(out) - 1:
            add(node.args[1], 0, k)
            if len(node.args) > 2 and node.args[2] is not None:
                add(node.args[2], 0, k)
        elif packet is aten.mm and dim == 1:
            add(node.args[1], 1, k)
        elif is_grouped_mm(node) and dim == len(out) - 1 and expert_weight(node) is not None:
            add(expert_weight(node), 2, k)                         # an MoE's fused gate|up experts

    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "overloadpacket", None) in (aten.split, aten.split_with_sizes):
            sizes, dim = split_sizes(node)
            if len(sizes) > 1:   # k equal pieces, or unequal ones (a grouped-query q|k|v)
                add(node.args[0], dim, len(sizes) if len(set(sizes)) == 1 else tuple(sizes))
        elif node.op == "call_function" and getattr(node.target, "overloadpacket", None) in (aten.view, aten.reshape):
            k = _packed_pieces(shape_of(node.args[0]), shape_of(node))
            if k:
                add(node.args[0], *k)
    return hints


def offer_blocked_outputs(n, strategies, ctx: RuleContext) -> None:
    """A blocked shard a node can produce (a view merging batch and heads gives ``Shard(0, blocks=B)``) is
    an option its consumers may keep: it joins the node's hints, which their rules read. Nodes are
    planned in graph order, so every producer is seen before its consumers. (At tp=1 nothing is
    sharded: no options are added, and the plan stays the model's own graph.)"""
    if ctx.t < 2:
        return
    for s in strategies:
        if isinstance(s.out, Shard) and s.out.blocks != 1:
            ctx.hints.setdefault(n, set()).add((s.out.dim, s.out.blocks))


def inherit_hints(n, ctx: RuleContext) -> None:
    """A pointwise op offers its inputs' blocked shards on the same (broadcast-aligned) dims: its rule
    enumerates the shards of its own output."""
    if ctx.t < 2 or getattr(n.target, "overloadpacket", None) not in POINTWISE:
        return
    out = shape_of(n) or ()
    for inp in n.all_input_nodes:
        ishape = shape_of(inp) or ()
        for d, k in ctx.hints.get(inp, ()):
            od = d + len(out) - len(ishape)
            if 0 <= od < len(out) and out[od] == ishape[d]:
                ctx.hints.setdefault(n, set()).add((od, k))
