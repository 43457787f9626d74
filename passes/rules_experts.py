"""The rule for a mixture of experts' grouped matmul: every expert's tokens times its own weight in one op.

HF's MoE layers (transformers 5's ``grouped_mm`` experts: OLMoE, Qwen3-MoE, GPT-OSS, GraniteMoE, ...)
sort the routed tokens by expert and run ``out[offs[i-1]:offs[i]] = x[offs[i-1]:offs[i]] @ W[i]``
for all experts at once: ``aten._grouped_mm`` on a GPU in bf16, transformers' own
``grouped_mm_fallback`` op elsewhere. ``x`` is ``(tokens, in)``, ``W`` is ``(experts, in, out)``.

Megatron's expert tensor parallelism splits each expert as it splits a dense MLP, and so does this rule:

- column-parallel: ``W`` sharded on its output dim (each expert's columns), ``x`` whole, the output
  sharded on its last dim; a fused gate|up weight is cut in blocks (``hints.py`` carries the chunk of
  its output back to the weight), so each rank holds matching gate and up columns;
- row-parallel: ``W`` sharded on its input dim, ``x`` on its last dim, the output a partial sum.

Both are exact: each rank computes whole products of its columns, or partial sums over its rows. Without
the rule the op ran replicated and the planner all-gathered every expert's weights each forward.
Other forms (a 3-D ``x``, a bias, no ``offs``) stay replicated.
"""
from __future__ import annotations

from autoshard.ir.placement import P, Shard
from autoshard.passes.shapes import shape_of
from autoshard.passes.strategy import Strategy, _ins, _replicated, op_argument, shard_options

GROUPED_MM = ("aten._grouped_mm", "transformers.grouped_mm_fallback")


def is_grouped_mm(node) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    return packet is not None and str(packet) in GROUPED_MM


def expert_weight(node):
    """The ``(experts, in, out)`` weight of a grouped matmul of the form the rule splits (a 2-D ``x``
    sorted by expert, ``offs``, no bias), else None."""
    x, w = node.args[0], node.args[1]
    xs, ws = shape_of(x), shape_of(w)
    if (xs is None or ws is None or len(xs) != 2 or len(ws) != 3 or op_argument(node, "offs") is None
            or op_argument(node, "bias") is not None):
        return None
    return w


def grouped_mm(node, ctx):
    x, w = node.args[0], expert_weight(node)
    strategies = _replicated(node)
    if w is None:
        return strategies
    ws = shape_of(w)
    for s in shard_options(w, ws, ctx):
        if s.dim == 2:                       # each expert's output columns
            strategies.append(Strategy(Shard(1, s.blocks), _ins(node, {w: s}), sharded=True))
        elif s.dim == 1 and s.blocks == 1:   # each expert's input rows: partial sums
            strategies.append(Strategy(P, _ins(node, {w: s, x: Shard(1)}), sharded=True))
    return strategies
