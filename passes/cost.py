"""Communication and compute costs, as numbers for the planner and as sympy formulas for the dump.

Collective volumes are the ring-algorithm bytes each rank sends for a tensor of ``n`` bytes on ``t``
ranks: all-reduce ``2 n (t-1)/t``, all-gather and reduce-scatter ``n (t-1)/t`` (DESIGN.md §4 counts one
TP all-reduce of ``b s h`` elements per sub-layer and direction). Time is the alpha-beta model
``latency + volume / bandwidth``; the latency term is what makes one all-reduce beat a reduce-scatter
plus an all-gather of the same volume on small messages.

Every function takes a ``shape`` of ints *or* of sympy expressions, so the same code prices the plan
(ints) and writes its formulas (symbols ``b, s, h, V``) into ``plan.md``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy

from autoshard.passes.spec import Partial, Replicate, Shard


@dataclass(frozen=True)
class CostModel:
    """Machine constants the planner prices plans with. Defaults: one NVLink-class link, one GPU."""
    bandwidth: float = 100e9          # bytes/s a rank sends in a ring step
    latency: float = 10e-6            # s per collective launch
    flops: float = 100e12             # flop/s of one rank
    # Tensor parallelism exists to shard weights: a replicated weight matrix (ndim >= 2) also replicates
    # its gradient and optimizer state, for the whole run. Priced as if its bytes crossed the link this
    # many times per step -- in effect a hard constraint: a weight is replicated only when no exact
    # sharded strategy exists (and plan.md says so).
    replicated_weight_factor: float = 1e6
    # Making a tensor replicated by communication (all-gather of a shard, all-reduce of partial sums)
    # materialises a full-size copy on every rank that lives until backward. For the logits that is
    # b*s*V floats, the largest activation of a GPT. Priced per byte on top of the traffic: this is why
    # the loss stays vocab-parallel instead of gathering or all-reducing the logits. Every sub-layer's
    # residual needs one such replica in any plan, so the penalty does not distort the block layout.
    replicate_memory_factor: float = 1000.0


FWD, BWD = "fwd", "bwd"


def numel(shape):
    return math.prod(shape) if shape else 1


def volume(kind: str, nbytes, t: int):
    """Bytes one rank sends for collective ``kind`` on a tensor of ``nbytes`` (global)."""
    if t == 1:
        return 0
    factor = sympy.Rational(t - 1, t) if isinstance(nbytes, sympy.Basic) else (t - 1) / t
    return (2 if kind == "all_reduce" else 1) * nbytes * factor


def transition(src, dst, requires_grad: bool, shape=None, t: int = 1):
    """Collectives that move a tensor from placement ``src`` to ``dst``: ``[(phase, kind), ...]``.

    Mirrors ``runtime.collectives.redistribute`` step for step (the dump lists these as what runs). The
    backward entries follow from the gradient invariant in ``spec.py``: slicing a replicated tensor
    (R->S) all-gathers its gradient; P->R and R->P need nothing backward.
    """
    if src == dst:
        return []
    steps = []
    even = isinstance(dst, Shard) and dst.blocks == 1 and (shape is None or shape[dst.dim] % t == 0)
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        steps = [(FWD, "all_reduce")]
    elif isinstance(src, Partial) and isinstance(dst, Shard):
        steps = ([(FWD, "reduce_scatter"), (BWD, "all_gather")] if even   # padded/blocked: reduce, slice
                 else [(FWD, "all_reduce"), (BWD, "all_gather")])
    elif isinstance(src, Shard) and isinstance(dst, (Replicate, Partial)):
        steps = [(FWD, "all_gather")]
    elif isinstance(src, Replicate) and isinstance(dst, Shard):
        steps = [(BWD, "all_gather")]
    elif isinstance(src, Shard) and isinstance(dst, Shard):
        steps = [(FWD, "all_gather"), (BWD, "all_gather")]
    return [s for s in steps if s[0] == FWD or requires_grad]


def collectives_time(steps, nbytes, t, cm: CostModel):
    """Seconds of the collectives ``steps``, plus the price of any full-size replica they materialise.

    A forward all-gather or all-reduce makes one (also on the way from one shard layout to another);
    a reduce-scatter does not.
    """
    if t == 1 or not steps:
        return 0.0
    time = sum(cm.latency + volume(kind, nbytes, t) / cm.bandwidth for _, kind in steps)
    if any(phase == FWD and kind in ("all_gather", "all_reduce") for phase, kind in steps):
        time += cm.replicate_memory_factor * nbytes / cm.bandwidth
    return time


def flops(node, shape_of):
    """Forward flops of a node (matmuls exactly, everything else one flop per output element)."""
    import torch
    aten = torch.ops.aten
    packet = getattr(node.target, "overloadpacket", None)
    out = shape_of(node)
    if out is None:
        return 0
    if packet is aten.linear:
        return 2 * numel(out) * shape_of(node.args[1])[1]
    if packet is aten.mm:
        return 2 * numel(out) * shape_of(node.args[0])[1]
    if packet in (aten.bmm, aten.matmul):
        return 2 * numel(out) * shape_of(node.args[0])[-1]
    if packet is aten.scaled_dot_product_attention:
        q, k = shape_of(node.args[0]), shape_of(node.args[1])
        return 4 * numel(q) * k[-2]
    first = shape_of(node.args[0]) if node.args and hasattr(node.args[0], "op") else None
    return max(numel(out), numel(first) if first else 0)  # reductions (loss, softmax) read their input


def symbolize(shape, symbols: dict):
    """Write concrete sizes as sympy expressions in the model's named sizes (b, s, h, V, ...).

    ``symbols`` maps a sympy Symbol to its value. A size equal to a symbol, a small multiple of one, or a
    product of two becomes that expression; anything else stays an integer.
    """
    out = []
    items = list(symbols.items())
    for n in shape:
        expr = next((sym for sym, v in items if n == v), None)
        if expr is None:
            expr = next((s1 * s2 for i, (s1, v1) in enumerate(items) for s2, v2 in items[i + 1:]
                         if v1 * v2 == n), None)
        if expr is None:
            expr = next(((n // v) * sym for sym, v in items if v and n % v == 0 and n // v in (2, 3, 4, 8)),
                        sympy.Integer(n))
        out.append(expr)
    return tuple(out)
