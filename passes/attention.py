"""Attention layout: how many query and kv heads each attention has, and what tp does with the kv heads.

Found from the graph, not from module names. An attention is a ``scaled_dot_product_attention``, or
eager attention's ``matmul(q, k^T) -> ... -> softmax -> matmul(p, v)``. Its query heads are dim 1 of
q ``(B, nh, T, hd)``. Walking back from k and v (through repeat_kv's unsqueeze/expand/reshape, rotary's
pointwise ops and the head-splitting view) reaches the projection whose weight makes them; the kv
heads are that projection's width over ``hd``.

- tp divides the kv heads: the planner shards them like the query heads (each rank's query heads use
  kv heads on the same rank, since repeat_kv keeps kv head ``j // (nh / nkv)`` beside query head ``j``);
- tp does not divide them (2 kv heads at tp=4, multi-query with 1): the kv projections are replicated
  on every rank, as Megatron and vLLM do, and each rank slices the kv heads its query heads use. Their
  gradient arrives whole on every rank (the slice's backward all-gathers it), which is the gradient
  invariant of a replicated weight, not a special case. Without this the planner would shard the
  whole attention by hidden columns (row-parallel q, k, v and o: 7 reduce-scatters per layer);
- k and v from one fused weight (``kv = Linear(d, 2 * nkv * hd)``): its width counts each kv head twice;
- q, k and v from one fused weight: the planner decides (blocked shards); reported as such.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autoshard.ir import meta as M
from autoshard.ir import ops
from autoshard.passes.shapes import module_path, shape_of
from autoshard.passes.walk import upstream

aten = torch.ops.aten
_PROJECTIONS = {aten.linear, aten.mm, aten.addmm, aten.matmul}
_SOFTMAX = {aten._softmax, aten.softmax, aten._safe_softmax}   # the last: SDPA spelled out (sdpa_dropout)


@dataclass
class AttentionLayout:
    node: str                       # the attention node (sdpa or the QK^T matmul)
    module: str                     # its module path
    q_heads: int
    kv_heads: int | None            # None when no kv projection was found
    kv_weights: list = field(default_factory=list)   # parameter names of the k/v projections
    decision: str = ""

    def describe(self, t: int) -> str:
        kv = "?" if self.kv_heads is None else self.kv_heads
        return f"`{self.module}`: {self.q_heads} query heads, {kv} kv heads at tp={t}: {self.decision}"


def _weights_behind(node, limit=40):
    """Parameters of the projections that ``node`` is computed from (stopping at each projection)."""
    def follow(n):      # stop at each projection, and beyond the ops of the graph
        return n.all_input_nodes if n.op == "call_function" and not _projects(n) else ()

    found = []
    ops = (n for n in upstream([node], follow) if n.op == "call_function")
    for _, n in zip(range(limit), ops):
        if _projects(n):
            weights = [a for a in n.all_input_nodes if a.op == "placeholder" and M.KIND.get(a, None) == "parameter"]
            found += [w for w in weights if len(shape_of(w)) == 2]
    return found


def _projects(n) -> bool:
    return getattr(n.target, "overloadpacket", None) in _PROJECTIONS


# the products an eager attention's scores come from, by the rank of the scores: (B, heads, T, T) from
# ``matmul``, (B * heads, T, T) from ``bmm`` (XGLM's and other fairseq-style layers)
_SCORES = {aten.matmul: 4, aten.bmm: 3}
# the parallel ops a walk from the scores to their softmax passes (they move the scores, compute nothing)
_MOVES = (ops.Redistribute, ops.CopyToParallel)


def _cores(gm):
    """``(first, q, k, v, output)`` for every attention in the graph: an SDPA call (first and output
    are the call), or ``q @ k^T`` (first) whose softmax feeds a product with ``v`` (output)."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is aten.scaled_dot_product_attention.default:
            yield n, n.args[0], n.args[1], n.args[2], n
        elif _SCORES.get(getattr(n.target, "overloadpacket", None)) == len(shape_of(n) or ()):
            scores = _softmax_of(gm, n)
            if scores is None:
                continue
            pv = next((u for u in _descendants(scores) if getattr(u.target, "overloadpacket", None) in _SCORES), None)
            if pv is not None:
                yield n, n.args[0], n.args[1], pv.args[1], pv


def _attentions(gm):
    """``(node, q, k, v)`` for every attention in the graph."""
    for n, q, k, v, _ in _cores(gm):
        yield n, q, k, v


def attentions(gm) -> list:
    """``(first node, output node)`` of every attention core, in graph order: what selective recompute
    runs again in backward (``passes/selective_recompute.py``)."""
    return [(first, out) for first, _, _, _, out in _cores(gm)]


def _descendants(n, depth=4):
    out, frontier = [], [n]
    for _ in range(depth):
        frontier = [u for f in frontier for u in f.users]
        out += frontier
    return out


def _softmax_of(gm, matmul, depth=8):
    """The softmax the scores of ``matmul`` (``q @ k^T``) flow into, through the ops between them
    (scaling, soft-capping's tanh, the mask, GPT-OSS's sink logits concatenated and their max, a
    redistribution the plan put there) but no further matmul or projection: None if none is within
    ``depth`` ops."""
    frontier, seen = [matmul], {matmul}
    for _ in range(depth):
        frontier = [u for f in frontier for u in f.users if u not in seen and (
            u.op == "call_function" or (u.op == "call_module" and isinstance(gm.get_submodule(u.target), _MOVES)))]
        seen.update(frontier)
        found = next((u for u in frontier if getattr(u.target, "overloadpacket", None) in _SOFTMAX), None)
        if found is not None:
            return found
        frontier = [u for u in frontier if not _projects(u) and u.target is not aten.bmm.default]
    return None


def attention_layouts(gm, t: int) -> list:
    layouts = []
    for n, q, k, v in _attentions(gm):
        qs = shape_of(q)
        if qs is None or len(qs) != 4:
            continue
        heads, hd = qs[1], qs[-1]
        q_w = {w.name for w in _weights_behind(q)}
        k_w, v_w = ([w for w in _weights_behind(x) if w.name not in q_w] for x in (k, v))
        kv = k_w + v_w
        # one weight behind both k and v is a fused k|v projection: its width holds every kv head twice
        fused_kv = 2 if {w.name for w in k_w} & {w.name for w in v_w} else 1
        lay = AttentionLayout(n.name, module_path(n), heads, None, sorted({M.NAME.get(w) for w in kv}))
        widths = {shape_of(w)[0] if shape_of(w)[0] % hd == 0 else shape_of(w)[1] for w in kv}
        if not kv or len(widths) != 1:
            lay.decision = "q, k and v come from one fused projection: the planner shards it per block where exact"
        else:
            lay.kv_heads = widths.pop() // hd // fused_kv
            if lay.kv_heads % t == 0:
                lay.decision = f"kv heads sharded with the query heads ({lay.kv_heads // t} per rank)"
            else:
                lay.decision = (f"tp={t} does not divide {lay.kv_heads} kv heads: k/v projections replicated on "
                                "every rank (Megatron's and vLLM's kv replication); each rank slices the kv heads "
                                "its query heads use")
        layouts.append(lay)
    return layouts


def replicated_by_design(layouts, t: int) -> set:
    """Weights that stay replicated because tp does not divide their attention's kv heads."""
    return {w for lay in layouts if lay.kv_heads is not None and lay.kv_heads % t for w in lay.kv_weights}
