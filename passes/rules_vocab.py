"""Rules for the vocab-parallel ops: the embedding lookup, the cross-entropy and ``logsumexp`` (z-loss).

Their local program is not the same op on local shards, so each strategy names a lowering that
``tp_rewrite`` turns into an ``ir.ops`` record (Megatron's ``VocabParallelEmbedding`` and
``vocab_parallel_cross_entropy``, and ``VocabParallelLogsumexp``). The losses' traffic is
``ir.redistribute.vocab_parallel_cross_entropy_steps`` and ``vocab_parallel_logsumexp_steps``.

A loss these lowerings do not cover (class weights, probability targets, logits that are not 2-D) keeps
only the replicated strategy: its logits are gathered, exactly, and ``plan.md``'s "Loss" section says so
and why (``cross_entropy_blockers``).
"""
from __future__ import annotations

import torch

from autoshard.ir.placement import P, R, Shard, shardable
from autoshard.ir.redistribute import vocab_parallel_cross_entropy_steps, vocab_parallel_logsumexp_steps
from autoshard.passes.shapes import shape_of, val
from autoshard.passes.strategy import Strategy, _ins, _replicated, shard_options


def embedding(node, ctx):
    """Megatron's vocab-parallel embedding: each rank looks up its vocab rows, zeros elsewhere -> Partial.

    The hidden-sharded alternative (weight ``Shard(1)``) is deliberately not offered: with a tied LM head
    the weight must be vocab-sharded anyway, and keeping one layout for tied and untied models keeps
    checkpoints and the loss path identical (noted as a possible future candidate in the docs).
    """
    w, idx = node.args[0], node.args[1]
    strategies = _replicated(node)
    by_freq = len(node.args) > 3 and node.args[3]
    sparse = len(node.args) > 4 and node.args[4]
    if shardable(shape_of(w)[0], ctx.t, allow_pad=True) and not by_freq and not sparse:
        strategies.append(Strategy(P, _ins(node, {w: Shard(0)}), lowering="vocab_parallel_embedding",
                                   sharded=True))
    for d, n in enumerate(shape_of(idx)):
        if n % ctx.t == 0 and n > 1:
            strategies.append(Strategy(Shard(d), _ins(node, {idx: Shard(d)}), sharded=True))
    return strategies


def cross_entropy_args(node) -> dict:
    """``aten.cross_entropy_loss(logits, target, weight, reduction, ignore_index, label_smoothing)``'s
    arguments by name, with torch's defaults."""
    names = ("logits", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    defaults = dict(weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0)
    out = dict(zip(names, node.args))
    return {k: out[k] if k in out else node.kwargs.get(k, defaults.get(k)) for k in names}


def cross_entropy_blockers(node, t: int) -> list:
    """Why the vocab-parallel cross-entropy cannot run this node at tp size ``t`` (empty: it can)."""
    a = cross_entropy_args(node)
    logits, target = shape_of(a["logits"]), val(a["target"])
    why = []
    if a["weight"] is not None:
        why.append("class weights")
    if len(logits) != 2:
        why.append(f"logits of rank {len(logits)} (the lowering takes (rows, vocab))")
    elif not isinstance(target, torch.Tensor) or target.is_floating_point() or tuple(target.shape) != logits[:1]:
        why.append("targets are not class indices, one per row")
    elif not shardable(logits[1], t, allow_pad=True):
        why.append(f"a vocab of {logits[1]} cannot be sharded {t} ways with a real class on every rank")
    return why


def cross_entropy(node, ctx):
    """Vocab-parallel cross-entropy on logits sharded by vocab: all-reduce the row max, then one all-reduce
    of the stacked (sum of exps, target logit[, row sum of logits with label smoothing]), N floats each:
    2 collectives, the logits never gathered. ``ignore_index`` and every reduction are exact."""
    a = cross_entropy_args(node)
    strategies = _replicated(node)
    if not cross_entropy_blockers(node, ctx.t):
        n = shape_of(a["logits"])[0]
        stacked = 3 if a["label_smoothing"] else 2
        strategies.append(Strategy(R, _ins(node, {a["logits"]: Shard(1)}), sharded=True,
                                   lowering="vocab_parallel_cross_entropy",
                                   comm=tuple(vocab_parallel_cross_entropy_steps(ctx.axis, n, stacked))))
    return strategies


def logsumexp_dims(node) -> tuple:
    """``aten.logsumexp(x, dim, keepdim)``: the reduced dims (normalised, sorted) and keepdim."""
    nd = len(shape_of(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", ())
    dims = [dims] if isinstance(dims, int) else list(dims)
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return tuple(sorted({d % nd for d in dims} if dims else range(nd))), bool(keep)


def logsumexp(node, ctx):
    """``logsumexp`` (the z-loss's ``logsumexp(logits, -1)``). Sharded on a reduced dim (the vocab, padded
    or not): all-reduce the max, then the sum of exps; the output is replicated and the input never moves.
    Sharded on a kept dim: the op itself on the local shard."""
    src = node.args[0]
    ishape = shape_of(src)
    dims, keep = logsumexp_dims(node)
    strategies = _replicated(node)
    v = val(src)
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        return strategies
    for s in shard_options(src, ishape, ctx, allow_pad=True):
        if s.dim in dims and s.blocks == 1:
            strategies.append(Strategy(R, _ins(node, {src: s}), sharded=True, lowering="vocab_parallel_logsumexp",
                                       comm=tuple(vocab_parallel_logsumexp_steps(ctx.axis, shape_of(node)))))
        elif s.dim not in dims and shardable(ishape[s.dim], ctx.t, s.blocks):
            od = s.dim if keep else s.dim - sum(1 for d in dims if d < s.dim)
            strategies.append(Strategy(Shard(od, s.blocks), _ins(node, {src: s}), sharded=True))
    return strategies
