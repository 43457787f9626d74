"""The vocab-parallel embedding and cross-entropy: the two ops whose local program is not the same op
on local shards (Megatron's ``VocabParallelEmbedding`` and ``vocab_parallel_cross_entropy``).

Their traffic is stated once, in ``ir.redistribute.vocab_parallel_cross_entropy_steps``: the cost model
prices it, the dump prints it, and the tracer checks this code runs exactly that.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard.runtime.input_checks import check_range


def vocab_parallel_embedding(weight, idx, start: int, valid: int, padding_idx=None, rows: int | None = None,
                             module: str = "the embedding"):
    """Look up the ids this rank's rows hold (``[start, start + valid)``); zeros elsewhere -> Partial.

    ``padding_idx`` (local, or None when the padding row lives on another rank) keeps its row's
    gradient at zero, as ``nn.Embedding(padding_idx=...)`` does. An id outside ``[0, rows)`` (the whole
    table) is an error, as on one device, not a zero row (``input_checks.py``).
    """
    check_range(idx, rows, "index", name=f"the indices into '{module}'")
    outside = (idx < start) | (idx >= start + valid)
    local = (idx - start).masked_fill(outside, 0)
    return F.embedding(local, weight, padding_idx=padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy on logits sharded by vocab (Megatron's ``vocab_parallel_cross_entropy``).

    Forward: all-reduce(MAX) of the row max, then one all-reduce(SUM) of the stacked (sum of exps,
    target logit) and, with label smoothing, the row sum of the logits. Backward: ``softmax - (1 - eps)
    onehot - eps / V`` on the local shard, no communication. Padded vocab columns (``>= valid``) are
    masked to -inf so they take no probability mass, and count neither in the row sum nor in ``V``.

    Exactly torch's semantics: a row whose target is ``ignore_index`` has loss 0 and gradient 0; the mean
    divides by the number of rows not ignored (NaN when all are, as in torch, with a zero gradient).
    With label smoothing, ``loss_i = (1 - eps) (lse_i - x_{i,t}) + eps (lse_i - mean_j x_{i,j})`` over the
    ``vocab`` real classes. The statistics and the gradient are computed in fp32 whatever the logits'
    dtype; the loss and the gradient are returned in the logits' dtype.

    Memory: one logits-sized buffer (the shifted logits, exponentiated and normalised in place, saved
    for backward, and turned into the gradient in place), as in Megatron. Each extra ``[b*s, V/t]``
    temporary is ~100 MB at GPT-2's vocab; the first version made three and ran 1.28x Megatron. With
    ``inplace`` (the rewrite proves nothing else reads the logits) that buffer is the logits themselves.
    """
    @staticmethod
    def forward(ctx, logits, target, comm, start, valid, ignore_index, reduction, inplace=False,
                label_smoothing=0.0, vocab=None):
        if logits.is_meta:
            return logits.new_empty(() if reduction != 0 else target.shape)
        check_range(target, vocab, "label", ignore_index)
        x = logits.float()
        real = x[:, :valid]  # padded vocab columns take no part in the max (nor, below, in the sums)
        row_max = comm.all_reduce(real.max(dim=1).values, "fwd", op=dist.ReduceOp.MAX)
        x = x.sub_(row_max.unsqueeze(1)) if inplace else x - row_max.unsqueeze(1)  # the one buffer
        if valid < x.shape[1]:
            x[:, valid:] = float("-inf")
        in_shard = (target >= start) & (target < start + valid)
        local_t = (target - start).masked_fill(~in_shard, 0)
        # where, not a product: a -inf logit on a rank that does not hold the target must not make NaN
        target_logit = torch.where(in_shard, x.gather(1, local_t.unsqueeze(1)).squeeze(1), 0.0)
        stats = [target_logit]
        if label_smoothing:  # the row sum of the (shifted) real logits, before exp_ overwrites them
            stats.append(x[:, :valid].sum(dim=1))
        exp = x.exp_()
        stats = comm.all_reduce(torch.stack([exp.sum(dim=1)] + stats), "fwd")
        lse = stats[0].log()  # log-sum-exp of the shifted row; the row max cancels in both terms
        loss = lse - stats[1]
        if label_smoothing:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - stats[2] / vocab)
        keep = target != ignore_index
        loss = torch.where(keep, loss, 0.0)
        count = keep.sum()
        ctx.save_for_backward(exp.div_(stats[0].unsqueeze(1)), local_t, in_shard & keep, keep, count)
        ctx.reduction, ctx.dtype, ctx.valid = reduction, logits.dtype, valid
        ctx.label_smoothing, ctx.vocab = label_smoothing, vocab
        if reduction == 0:
            return loss.to(logits.dtype)
        total = loss.sum()
        return (total / count if reduction == 1 else total).to(logits.dtype)

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, hit, keep, count = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # saved for this alone: becomes the gradient in place
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= (1.0 - eps) * hit.to(grad.dtype)
        if eps:
            grad[:, :ctx.valid] -= eps / ctx.vocab  # the uniform target: real columns only
        g = g.float()
        # where, not a product: the mean over zero rows (all ignored) is NaN, its gradient 0 as in torch
        scale = torch.where(keep, g / count if ctx.reduction == 1 else g, 0.0)
        grad.mul_(scale.unsqueeze(1))
        return grad.to(ctx.dtype), None, None, None, None, None, None, None, None, None


class VocabParallelLogsumexp(torch.autograd.Function):
    """``logsumexp`` over ``dims`` of a tensor sharded on ``dim`` (one of ``dims``): the z-loss's
    ``logsumexp(logits, -1)`` on vocab-sharded logits, never gathering them.

    Forward: all-reduce(MAX) of the local maxima over the ``valid`` real entries (padding is left out),
    then all-reduce(SUM) of the local sums of ``exp(x - max)``; both in fp32. An infinite max is taken as
    0, as torch does, so an all ``-inf`` row gives ``-inf``. Backward (no communication): the output is
    replicated, so every rank holds its whole gradient ``g``; the local gradient is ``g * exp(x - out)``
    on the real entries and 0 on the padding.
    """
    @staticmethod
    def forward(ctx, x, comm, dims, keepdim, dim, valid):
        if x.is_meta:
            return torch.logsumexp(x, dims, keepdim)
        real = x.narrow(dim, 0, valid).float()
        m = comm.all_reduce(real.amax(dims, keepdim=True), "fwd", op=dist.ReduceOp.MAX)
        m = m.masked_fill(m.isinf(), 0.0)
        s = comm.all_reduce((real - m).exp_().sum(dims, keepdim=True), "fwd")
        out = s.log_().add_(m)  # keepdim: broadcasts against x in backward
        ctx.save_for_backward(x, out)
        ctx.dims, ctx.keepdim, ctx.dim, ctx.valid = dims, keepdim, dim, valid
        return (out if keepdim else out.squeeze(dims)).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, out = ctx.saved_tensors
        g = g.float() if ctx.keepdim else g.float().reshape(out.shape)
        grad = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        grad.narrow(ctx.dim, 0, ctx.valid).copy_((x.narrow(ctx.dim, 0, ctx.valid).float() - out).exp_().mul_(g))
        return grad.to(x.dtype), None, None, None, None, None
