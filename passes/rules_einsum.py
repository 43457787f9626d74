"""The rule for ``einsum``: shard one index letter wherever it appears.

An index that every operand holding it and the output hold is a batch-like or free index: each rank
computes its slice of it from its slices alone, so the operands are sharded on it and the output too.
An index the output does not hold is summed: each rank sums over its slice, and the output is a
partial sum. Both are exact. Mamba-2's reference scan (Bamba, Falcon-H1, Nemotron-H, Zamba2) is a
chain of ``einsum("bclhn,bcshn->bclsh", ...)`` whose heads ``h`` every term holds: they stay sharded.

Left replicated: an ellipsis, an index repeated within a term (a diagonal), one tensor in two roles, and
an index whose sizes differ between operands (broadcast).
"""
from __future__ import annotations

import torch.fx as fx

from autoshard.ir.placement import P, Shard, shardable
from autoshard.passes.shapes import shape_of
from autoshard.passes.strategy import Strategy, _ins, _replicated


def einsum(node, ctx):
    equation, tensors = node.args[0], list(node.args[1])
    strategies = _replicated(node)
    if (not isinstance(equation, str) or "..." in equation or "->" not in equation
            or not all(isinstance(t, fx.Node) for t in tensors) or len(set(tensors)) != len(tensors)):
        return strategies
    lhs, out = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    shapes = [shape_of(t) for t in tensors]
    if (len(terms) != len(tensors) or any(len(set(term)) != len(term) for term in terms + [out])
            or any(s is None or len(s) != len(term) for s, term in zip(shapes, terms))):
        return strategies
    for letter in sorted(set(lhs) - {","}):
        sizes = {s[term.index(letter)] for s, term in zip(shapes, terms) if letter in term}
        if len(sizes) != 1 or next(iter(sizes)) <= 1 or not shardable(next(iter(sizes)), ctx.t):
            continue
        ins = {t: Shard(term.index(letter)) for t, term in zip(tensors, terms) if letter in term}
        strategies.append(Strategy(Shard(out.index(letter)) if letter in out else P, _ins(node, ins), sharded=True))
    return strategies
