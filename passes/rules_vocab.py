"""Rules for the two vocab-parallel ops: the embedding lookup and the cross-entropy.

Their local program is not the same op on local shards, so each strategy names a lowering that
``tp_rewrite`` turns into an ``ir.ops`` record (Megatron's ``VocabParallelEmbedding`` and
``vocab_parallel_cross_entropy``). The loss's traffic is ``ir.redistribute.vocab_parallel_cross_entropy_steps``.
"""
from __future__ import annotations

from autoshard.ir.placement import P, R, Shard, shardable
from autoshard.ir.redistribute import vocab_parallel_cross_entropy_steps
from autoshard.passes.shapes import shape_of
from autoshard.passes.strategy import Strategy, _ins, _replicated


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


def cross_entropy(node, ctx):
    """Vocab-parallel cross-entropy on logits sharded by vocab: all-reduce the row max, then one all-reduce
    of the stacked (sum of exps, target logit), N floats each: 2 collectives, the logits never gathered."""
    logits = node.args[0]
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    strategies = _replicated(node)
    if len(shape_of(logits)) == 2 and weight is None and smoothing == 0.0:
        if shardable(shape_of(logits)[1], ctx.t, allow_pad=True):
            n = shape_of(logits)[0]
            strategies.append(Strategy(R, _ins(node, {logits: Shard(1)}), sharded=True,
                                       lowering="vocab_parallel_cross_entropy",
                                       comm=tuple(vocab_parallel_cross_entropy_steps(ctx.axis, n))))
    return strategies
