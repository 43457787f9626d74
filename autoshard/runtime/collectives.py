"""Every collective autoshard runs, as autograd functions with the right backward (Megatron's f and g).

Naming follows Megatron-LM's ``mappings.py`` and the paper (Shoeybi et al. 2019, Fig. 3):

- ``f`` = ``CopyToTP``: identity forward, all-reduce backward. Sits where a replicated tensor enters a
  column-parallel op (its gradient there is a partial sum).
- ``g`` = ``ReduceFromTP``: all-reduce forward, identity backward. Turns a row-parallel Partial into
  Replicate.
- ``GatherFromTP`` / ``ScatterToTP``: all-gather forward / slice backward and the converse;
  ``ReduceScatterToTP``: reduce-scatter forward / all-gather backward.

All of them take a ``TPComm`` (the rank's tensor-parallel group plus a tracer of what was sent). On
``meta`` tensors they only compute shapes, so a compile-only run checks every rank's local program
without starting a process.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard.passes.spec import Partial, Replicate, Shard, local_size


@dataclass
class TPComm:
    """One rank's tensor-parallel group, and a count of every collective it ran (by kind and phase)."""
    size: int
    rank: int
    group: object = None                  # a torch ProcessGroup; None in compile-only runs
    calls: Counter = field(default_factory=Counter)   # (phase, kind) -> number of calls
    bytes: Counter = field(default_factory=Counter)   # (phase, kind) -> bytes of the tensors reduced/gathered

    def _log(self, kind, t, phase):
        self.calls[phase, kind] += 1
        self.bytes[phase, kind] += t.numel() * t.element_size()

    def reset(self):
        self.calls.clear()
        self.bytes.clear()

    def all_reduce(self, x, phase, op=dist.ReduceOp.SUM):
        if x.is_meta or self.size == 1:
            return x
        x = x.contiguous()
        self._log("all_reduce", x, phase)
        dist.all_reduce(x, op=op, group=self.group)
        return x

    def all_reduce_async(self, x, phase):
        """Start an in-place all-reduce of ``x``; returns a handle to ``wait()`` on (or None)."""
        if x.is_meta or self.size == 1:
            return None
        self._log("all_reduce", x, phase)
        return dist.all_reduce(x, group=self.group, async_op=True)

    def all_gather(self, x, dim, phase):
        """Concatenate every rank's ``x`` along ``dim``."""
        if self.size == 1:
            return x
        if x.is_meta:
            shape = list(x.shape)
            shape[dim] *= self.size
            return x.new_empty(shape)
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:])) if dim == 0 else None
        self._log("all_gather", out if out is not None else x.new_empty(x.numel() * self.size), phase)
        if dim == 0:
            dist.all_gather_single(out, x, group=self.group)
            return out
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x, dim, phase):
        if self.size == 1:
            return x
        chunks = [c.contiguous() for c in x.chunk(self.size, dim=dim)]
        if x.is_meta:
            return chunks[0]
        self._log("reduce_scatter", x, phase)
        out = torch.empty_like(chunks[self.rank])
        dist.reduce_scatter(out, chunks, group=self.group)
        return out


# --- layout of a sharded dim (blocks and padding) -----------------------------------------------------
def take_shard(x, dim, n, comm: TPComm, blocks=1):
    """This rank's chunk of the full ``x`` along ``dim`` (length ``n``): per block, padded at the end."""
    t, r = comm.size, comm.rank
    if blocks > 1:
        b = x.unflatten(dim, (blocks, n // blocks))
        c = n // blocks // t
        return b.narrow(dim + 1, r * c, c).flatten(dim, dim + 1)
    c = local_size(n, t)
    if c * t != n:
        pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, c * t - n]
        x = F.pad(x, pad)
    return x.narrow(dim, r * c, c)


def assemble(parts_cat, dim, n, t, blocks=1):
    """Inverse of ``take_shard`` on the concatenation of all ranks' chunks: the full tensor."""
    if blocks > 1:
        c = n // blocks // t
        x = parts_cat.unflatten(dim, (t, blocks, c)).transpose(dim, dim + 1)
        return x.flatten(dim, dim + 2)
    return parts_cat.narrow(dim, 0, n)


def gather_full(x, dim, n, comm, blocks, phase):
    return assemble(comm.all_gather(x, dim, phase), dim, n, comm.size, blocks)


# --- Megatron's f and g, and the layout changes -------------------------------------------------------
class CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce the (partial) gradient backward."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_reduce(g.clone(), "bwd"), None


class ColumnParallelMatmul(torch.autograd.Function):
    """f fused into the column-parallel matmul it feeds: ``y = x W^T + b`` (``W`` stored ``(out, in)``,
    or ``(in, out)`` with ``transposed``, as HF's Conv1D does).

    Backward starts the all-reduce of the partial input gradient, computes the weight and bias
    gradients while it runs, then waits: Megatron's LinearWithGradAccumulationAndAsyncCommunication.
    """
    @staticmethod
    def forward(ctx, x, weight, bias, comm, transposed):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.transposed, ctx.has_bias = comm, transposed, bias is not None
        return F.linear(x, weight.t() if transposed else weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        w = weight.t() if ctx.transposed else weight          # (out, in)
        dx = g.matmul(w).contiguous()                         # partial sums over this rank's columns
        handle = ctx.comm.all_reduce_async(dx, "bwd") if ctx.needs_input_grad[0] else None
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        dw = db = None
        if ctx.needs_input_grad[1]:
            dw = x2.t().matmul(g2) if ctx.transposed else g2.t().matmul(x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.sum(0)
        if handle is not None:
            handle.wait()
        return dx, dw, db, None, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce the partial sums forward; identity backward (the gradient is replicated)."""
    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x.clone(), "fwd")

    @staticmethod
    def backward(ctx, g):
        return g, None


class GatherFromTP(torch.autograd.Function):
    """Shard -> Replicate: all-gather forward; take this rank's chunk of the replicated gradient backward."""
    @staticmethod
    def forward(ctx, x, comm, dim, n, blocks):
        ctx.args = (comm, dim, n, blocks)
        return gather_full(x, dim, n, comm, blocks, "fwd")

    @staticmethod
    def backward(ctx, g):
        comm, dim, n, blocks = ctx.args
        return take_shard(g, dim, n, comm, blocks).contiguous(), None, None, None, None


class ScatterToTP(torch.autograd.Function):
    """Replicate -> Shard: take this rank's chunk forward; all-gather the sharded gradient backward."""
    @staticmethod
    def forward(ctx, x, comm, dim, n, blocks):
        ctx.args = (comm, dim, n, blocks)
        return take_shard(x, dim, n, comm, blocks).contiguous()

    @staticmethod
    def backward(ctx, g):
        comm, dim, n, blocks = ctx.args
        return gather_full(g, dim, n, comm, blocks, "bwd"), None, None, None, None


class ReduceScatterToTP(torch.autograd.Function):
    """Partial -> Shard (even dims only): reduce-scatter forward; all-gather backward."""
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.args = (comm, dim)
        return comm.reduce_scatter(x, dim, "fwd")

    @staticmethod
    def backward(ctx, g):
        comm, dim = ctx.args
        return comm.all_gather(g, dim, "bwd"), None, None


class ToPartial(torch.autograd.Function):
    """Replicate -> Partial: rank 0 keeps the value, the others hold zeros; identity backward."""
    @staticmethod
    def forward(ctx, x, comm):
        return x.clone() if comm.rank == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


def redistribute(x, src, dst, comm: TPComm, shape):
    """Move ``x`` (local value of a tensor of global ``shape``) from placement ``src`` to ``dst``."""
    if src == dst:
        return x
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return ReduceFromTP.apply(x, comm)
        if isinstance(dst, Shard) and dst.blocks == 1 and shape[dst.dim] % comm.size == 0:
            return ReduceScatterToTP.apply(x, comm, dst.dim)
        return redistribute(ReduceFromTP.apply(x, comm), Replicate(), dst, comm, shape)
    if isinstance(src, Shard):
        full = GatherFromTP.apply(x, comm, src.dim, shape[src.dim], src.blocks)
        return redistribute(full, Replicate(), dst, comm, shape)
    if isinstance(dst, Shard):
        return ScatterToTP.apply(x, comm, dst.dim, shape[dst.dim], dst.blocks)
    return ToPartial.apply(x, comm)


# --- vocab-parallel embedding and cross-entropy -------------------------------------------------------
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
