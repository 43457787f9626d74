"""Communication and compute costs, as numbers for the planner and as sympy formulas for the dump.

A placement change is priced from its plan (``ir.redistribute.plan_redistribute``): the same steps the
runtime runs and the dump prints. Time is the alpha-beta model ``latency + volume / bandwidth`` with
the ring volumes of ``ir.redistribute.volume`` (docs/architecture.md, "Cost model"); the latency term is
what makes one all-reduce beat a reduce-scatter plus an all-gather of the same volume on small messages.

``symbolize`` writes a shape of ints as sympy expressions in the model's sizes (``b, s, h, V``), so the
dump can state each collective's bytes as a formula.
"""
from __future__ import annotations

import math

import sympy
import torch

from autoshard.ir import meta as M
from autoshard.ir.options import CostModel
from autoshard.ir.redistribute import FWD, plan_redistribute, volume


def numel(shape):
    return math.prod(shape) if shape else 1


def transition(src, dst, requires_grad: bool, shape, axis: str, size: int):
    """``[(phase, kind)]``: the collectives moving a tensor from ``src`` to ``dst`` (its planned steps)."""
    return [c for step in plan_redistribute(src, dst, shape, axis, size) for c in step.collectives(requires_grad)]


def collectives_time(steps, nbytes, t, cm: CostModel, stream_bytes: int = 0):
    """Seconds of the collectives ``steps``, plus the price of any full-size replica they materialise
    that is larger than the residual stream (``stream_bytes``, ``residual_stream_bytes``).

    A forward all-gather or all-reduce makes one (also on the way from one shard layout to another);
    a reduce-scatter does not. Megatron's layout replicates the residual stream after every sub-layer's
    all-reduce, and that replica is priced by its traffic alone: pricing it as memory too made a plan
    that never replicates anything (every linear row-parallel, the stream sharded along hidden, twice
    the traffic and 3.5x the collectives) look cheaper on RMSNorm models, whose norm can run sharded.
    What is wider than the stream (the logits, an MLP's intermediate) never needs replicating, and doing
    so is what the memory price forbids."""
    if t == 1 or not steps:
        return 0.0
    time = sum(cm.latency + volume(kind, nbytes, t) / cm.bandwidth for _, kind in steps)
    if any(phase == FWD and kind in ("all_gather", "all_reduce") for phase, kind in steps):
        time += replica_price(nbytes, stream_bytes, cm)
    return time


def replica_price(nbytes, stream_bytes, cm: CostModel) -> float:
    """The memory price of a full-size tensor on every rank (see ``collectives_time``): nothing up to the
    residual stream's size, the memory factor per byte beyond it."""
    return cm.replicate_memory_factor * max(0, nbytes - stream_bytes) / cm.bandwidth


def _stream_candidates(gm) -> tuple:
    """``(token embeddings, floating user inputs)``: the nodes the residual stream may start from. A token
    embedding is an ``aten.embedding`` indexed by an integer user input (``input_ids``, through views); a
    lookup indexed by a computed tensor (a position table's ``arange``, T5's bucketed relative positions)
    is not the stream: it has no batch dim, or a position-pair one."""
    aten = torch.ops.aten
    views = {aten.view, aten.reshape, aten._unsafe_view, aten.clone, aten.contiguous, aten.alias}

    def from_user_input(n) -> bool:
        while n.op == "call_function" and getattr(n.target, "overloadpacket", None) in views:
            n = n.args[0]
        return n.op == "placeholder" and M.KIND.get(n, None) == "input"

    embeddings, inputs = [], []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            continue
        if (n.op == "call_function" and getattr(n.target, "overloadpacket", None) is aten.embedding
                and from_user_input(n.args[1])):
            embeddings.append(n)
        elif n.op == "placeholder" and M.KIND.get(n, None) == "input":
            inputs.append(n)
    return embeddings, inputs


def _size(n) -> int:
    v = n.meta["val"]
    return v.numel() * v.element_size()


def residual_stream_bytes(gm) -> int:
    """Bytes of the residual stream: the largest token embedding, else the largest floating user input (a
    model called with ``inputs_embeds``); 0 when there is neither (every replica is then priced as
    memory)."""
    embeddings, inputs = _stream_candidates(gm)
    return max(map(_size, embeddings), default=0) or max(map(_size, inputs), default=0)


def residual_stream_shape(gm) -> tuple | None:
    """The global shape of the residual stream (``[b, s, h]``), from the same node; None without one."""
    embeddings, inputs = _stream_candidates(gm)
    pool = embeddings or inputs
    if not pool:
        return None
    n = max(pool, key=_size)
    return tuple(M.GLOBAL_SHAPE.get(n, None) or n.meta["val"].shape)


def flops(node, shape_of):
    """Forward flops of a node (matmuls exactly, everything else one flop per output element)."""
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
