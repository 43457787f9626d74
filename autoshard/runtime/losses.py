"""The vocab-parallel embedding and cross-entropy: the two ops whose local program is not the same op
on local shards (Megatron's ``VocabParallelEmbedding`` and ``vocab_parallel_cross_entropy``).

Their traffic is stated once, in ``ir.redistribute.vocab_parallel_cross_entropy_steps``: the cost model
prices it, the dump prints it, and the tracer checks this code runs exactly that.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def vocab_parallel_embedding(weight, idx, start: int, valid: int, padding_idx=None):
    """Look up the ids this rank's rows hold (``[start, start + valid)``); zeros elsewhere -> Partial.

    ``padding_idx`` (local, or None when the padding row lives on another rank) keeps its row's
    gradient at zero, as ``nn.Embedding(padding_idx=...)`` does.
    """
    outside = (idx < start) | (idx >= start + valid)
    local = (idx - start).masked_fill(outside, 0)
    return F.embedding(local, weight, padding_idx=padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy on logits sharded by vocab (Megatron's ``vocab_parallel_cross_entropy``).

    Forward: all-reduce(MAX) of the row max, then one all-reduce(SUM) of the stacked (sum of exps,
    target logit). Backward: ``softmax - onehot`` on the local shard, no communication. Padded vocab
    columns (``>= valid``) are masked to -inf so they take no probability mass.

    Memory: one logits-sized buffer (the shifted logits, exponentiated and normalised in place, saved
    for backward, and turned into the gradient in place), as in Megatron. Each extra ``[b*s, V/t]``
    temporary is ~100 MB at GPT-2's vocab; the first version made three and ran 1.28x Megatron. With
    ``inplace`` (the rewrite proves nothing else reads the logits) that buffer is the logits themselves.
    """
    @staticmethod
    def forward(ctx, logits, target, comm, start, valid, ignore_index, reduction, inplace=False):
        if logits.is_meta:
            return logits.new_empty(() if reduction != 0 else target.shape)
        x = logits.float()
        real = x[:, :valid]  # padded vocab columns take no part in the max (nor, below, in the sum)
        row_max = comm.all_reduce(real.max(dim=1).values, "fwd", op=dist.ReduceOp.MAX)
        x = x.sub_(row_max.unsqueeze(1)) if inplace else x - row_max.unsqueeze(1)  # the one buffer
        if valid < x.shape[1]:
            x[:, valid:] = float("-inf")
        in_shard = (target >= start) & (target < start + valid)
        local_t = (target - start).masked_fill(~in_shard, 0)
        # where, not a product: a -inf logit on a rank that does not hold the target must not make NaN
        target_logit = torch.where(in_shard, x.gather(1, local_t.unsqueeze(1)).squeeze(1), 0.0)
        exp = x.exp_()
        stats = comm.all_reduce(torch.stack([exp.sum(dim=1), target_logit]), "fwd")
        sum_exp, target_logit = stats[0], stats[1]
        keep = target != ignore_index
        loss = (sum_exp.log() - target_logit) * keep
        count = keep.sum()
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(1)), local_t, in_shard & keep, keep, count)
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        if reduction == 0:
            return loss.to(logits.dtype)
        total = loss.sum()
        return (total / count if reduction == 1 else total).to(logits.dtype)

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, hit, keep, count = ctx.saved_tensors
        grad = softmax  # saved for this alone: becomes the gradient in place
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= hit.to(grad.dtype)
        scale = keep.to(grad.dtype) * (g / count if ctx.reduction == 1 else g)
        grad.mul_(scale.unsqueeze(1) if scale.dim() else scale)
        return grad.to(ctx.dtype), None, None, None, None, None, None, None
