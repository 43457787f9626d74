"""Overlap the column-parallel input-gradient all-reduce with the weight-gradient matmul.

After the rewrite, ``f`` (identity forward, all-reduce backward) and the column-parallel matmul it feeds
are two autograd nodes. The matmul's backward computes dX and dW together, so the all-reduce of dX
cannot start before dW is done. Where ``f`` has a single matmul consumer (a fused ``c_attn``, fc1, the LM
head; HF's ``reshape -> addmm`` too), this pass replaces the pair with one ``ir.ops.ColumnParallelMatmul``,
whose backward runs the all-reduce during dW. Measured on the benchmark's profile: f's backward was 326 ms
of synchronous all-reduce over 18 calls at V=50304, TP=2. An ``f`` shared by separate q, k, v
projections stays as it is: their partial gradients must be summed before one all-reduce.

Under sequence parallelism the same pair is a ``SequenceGather`` (all-gather forward, reduce-scatter of
the gradient backward) and the matmul: fused alike (``gather_dim``), its reduce-scatter overlaps dW.
Only where the matmul reads the gathered value directly (a reshape between would need the gathered
sizes), and not for the LM head, whose chunked loss (``chunk_loss``) takes a gathered input. Nor where
the gather has other readers (GQA's replicated k and v through ``GatheredReplica``): one gather
forward is kept over the overlap of its reduce-scatter with q's dW.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir import ops

aten = torch.ops.aten


def _matmul_use(node):
    """(matmul node, x arg, weight, bias, transposed, via) if ``node``'s only use is as a matmul's input."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    if user.op != "call_function":
        return None
    if user.target is aten.linear.default and user.args[0] is node:
        bias = user.args[2] if len(user.args) > 2 else None
        return user, user.args[1], bias, False
    if user.target is aten.addmm.default and user.args[1] is node and not user.kwargs:
        return user, user.args[2], user.args[0], True
    if user.target is aten.mm.default and user.args[0] is node:
        return user, user.args[1], None, True
    return None


def _feeds_loss(gm, node, hops: int = 8) -> bool:
    """Whether ``node``'s value reaches a vocab-parallel loss through a few local ops (the LM head's)."""
    for u in node.users:
        if u.op == "call_module" and isinstance(gm.get_submodule(u.target),
                                                (ops.VocabParallelCrossEntropy, ops.VocabParallelLogsumexp)):
            return True
        if u.op == "call_function" and hops and _feeds_loss(gm, u, hops - 1):
            return True
    return False


def overlap_grad_allreduce_pass(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    g = gm.graph
    for f in list(g.nodes):
        if f.op != "call_module" or not isinstance(gm.get_submodule(f.target), (ops.CopyToParallel, ops.SequenceGather)):
            continue
        fmod = gm.get_submodule(f.target)
        gather = fmod.dim if isinstance(fmod, ops.SequenceGather) else None
        blocks = fmod.blocks if isinstance(fmod, ops.SequenceGather) else 1
        chain, node = [], f
        while len(node.users) == 1 and next(iter(node.users)).target in (aten.reshape.default, aten.view.default):
            node = next(iter(node.users))
            chain.append(node)
        use = _matmul_use(node)
        if use is None or (gather is not None and (chain or _feeds_loss(gm, use[0]))):
            continue
        if blocks != 1 and gather % len(fmod.shape) == len(fmod.shape) - 1:
            continue    # the runtime splits a blocked dim in two around the matmul: not the one it contracts
        mm, weight, bias, transposed = use
        name = f.target.replace("f_", "column_matmul_") if gather is None else f"column_{f.target}"
        regather = ctx is not None and ctx.options.sequence_parallel == "regather"
        gm.add_submodule(name, ops.ColumnParallelMatmul(fmod.axis, fmod.size, fmod.shape, transposed, gather, regather,
                                                         blocks))
        f.replace_all_uses_with(f.args[0])  # the reshape chain now reads the un-f'd value
        with g.inserting_before(mm):
            fused = g.call_module(name, (node if chain else f.args[0], weight) + ((bias,) if bias is not None else ()))
        fused.meta = dict(mm.meta)
        M.SOURCE.set(fused, M.SOURCE.get(f, None))
        mm.replace_all_uses_with(fused)
        g.erase_node(mm)
        g.erase_node(f)
        gm.delete_submodule(f.target)
        fused.name = mm.name     # the value keeps its name (a pipeline cut may send it by that name)
    g.lint()
    gm.recompile()
    return gm
