"""The parallel ops as Inductor can compile them: functional collectives and composite torch ops.

With ``parallelize(..., codegen="inductor")`` each rank's bound program goes through ``torch.compile``:
dynamo traces forward and backward into ATen graphs and Inductor generates the kernels (Triton on a GPU,
C++ on a CPU), fusing every pointwise and reduction chain. The eager implementations
(``collectives.py``, ``losses.py``, ``chunked_loss.py``) are written for eager speed: in-place
collectives (``dist.all_reduce``), in-place buffers saved for backward, a gradient computed inside
forward. Dynamo cannot trace those. Here every op is written again, for the compiler:

- collectives are ``torch.ops._c10d_functional`` calls (out of place, then ``wait_tensor``), the form
  Inductor schedules, reorders and buckets (torch's functional collectives);
- Megatron's f, g and the gather/scatter pairs are small autograd functions over them, since the
  functional collectives have no derivative of their own (an all-reduce's gradient depends on what the
  caller means by it: ``g`` is an all-reduce forward and the identity backward);
- the vocab-parallel losses and the logsumexp are composites of differentiable ops around ``g``: every
  rank holds the same loss, so the identity backward of ``g`` gives each rank exactly its local
  gradient (``softmax - onehot`` on its shard), and autograd derives it; nothing is hand-written.

Semantics are the eager ops' (``ignore_index``, padded vocab columns, label smoothing, fp32 statistics),
and the tests hold both paths to the single-device model. What is not kept: the per-call collective
counts (``pm.comm_counts()``): a compiled program's collectives are its plan's (``pm.program.collectives``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard.ir import ops
from autoshard.runtime.layout import assemble, take_shard
from autoshard.runtime.losses import vocab_parallel_embedding

C10D = torch.ops._c10d_functional


# --- functional collectives on one axis -------------------------------------------------------------------
def _group(comm) -> tuple:
    """(group name, size, rank): plain values the autograd functions keep (dynamo traces them as constants)."""
    return (comm.group.group_name if comm.group is not None else "", comm.size, comm.rank)


def all_reduce(x, group: tuple, op: str = "sum"):
    name, size, _ = group
    if size == 1:
        return x
    return C10D.wait_tensor(C10D.all_reduce(x.contiguous(), op, name))


def all_gather(x, dim: int, group: tuple):
    """Every rank's ``x`` concatenated along ``dim``."""
    name, size, _ = group
    if size == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    return C10D.wait_tensor(C10D.all_gather_into_tensor(front, size, name)).movedim(0, dim)


def reduce_scatter(x, dim: int, group: tuple):
    """The sum over ranks of ``x``, this rank's equal chunk of ``dim``."""
    name, size, _ = group
    if size == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    return C10D.wait_tensor(C10D.reduce_scatter_tensor(front, "sum", size, name)).movedim(0, dim)


# --- Megatron's mappings ----------------------------------------------------------------------------------
class CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce of the partial gradient backward."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group), None


class ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class GatherFromParallel(torch.autograd.Function):
    """Shard -> Replicate: all-gather (and reassemble blocks, drop padding) forward; this rank's chunk backward."""
    @staticmethod
    def forward(ctx, x, group, dim, n, blocks):
        ctx.args = (group, dim, n, blocks)
        return assemble(all_gather(x, dim, group), dim, n, group[1], blocks).clone()

    @staticmethod
    def backward(ctx, g):
        group, dim, n, blocks = ctx.args
        return take_shard(g, dim, n, group[1], group[2], blocks).contiguous(), None, None, None, None


class ScatterToParallel(torch.autograd.Function):
    """Replicate -> Shard: this rank's chunk forward; all-gather backward."""
    @staticmethod
    def forward(ctx, x, group, dim, n, blocks):
        ctx.args = (group, dim, n, blocks)
        return take_shard(x, dim, n, group[1], group[2], blocks).contiguous()

    @staticmethod
    def backward(ctx, g):
        group, dim, n, blocks = ctx.args
        return assemble(all_gather(g, dim, group), dim, n, group[1], blocks), None, None, None, None


class ReduceScatterToParallel(torch.autograd.Function):
    """Partial -> Shard: reduce-scatter forward, all-gather backward."""
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.args = (group, dim)
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        group, dim = ctx.args
        return all_gather(g, dim, group), None, None


def _to_partial(x, group):
    """Replicate -> Partial: rank 0 keeps the value, the others hold zeros (a constant per rank)."""
    return x * 1.0 if group[2] == 0 else x * 0.0


def _step(x, step, group):
    if step.kind == "all_reduce":
        return ReduceFromParallel.apply(x, group)
    if step.kind == "reduce_scatter":
        return ReduceScatterToParallel.apply(x, group, step.dim)
    if step.kind == "all_gather":
        return GatherFromParallel.apply(x, group, step.dim, step.length, step.blocks)
    if step.kind == "shard":
        return ScatterToParallel.apply(x, group, step.dim, step.length, step.blocks)
    if step.kind == "to_partial":
        return _to_partial(x, group)
    raise ValueError(f"unknown redistribution step {step!r}")


# --- the losses as composites -----------------------------------------------------------------------------
def cross_entropy(logits, target, group, start: int, valid: int, ignore_index: int, reduction: int,
                  label_smoothing: float = 0.0, vocab: int | None = None):
    """The vocab-parallel cross-entropy (``losses.VocabParallelCrossEntropy``'s semantics) of logits
    ``[rows, V/t]``, differentiable by autograd: the row max is a constant (it cancels), the sums over
    vocab shards go through ``g``."""
    x = logits.float()
    local = x.shape[1]
    row_max = all_reduce(x[:, :valid].detach().amax(dim=1), group, "max")
    z = x - row_max.unsqueeze(1)
    if valid < local:    # padded vocab columns take no probability mass
        z = z.masked_fill(torch.arange(local, device=z.device) >= valid, float("-inf"))
    in_shard = (target >= start) & (target < start + valid)
    local_t = (target - start).masked_fill(~in_shard, 0)
    stats = [z.exp().sum(dim=1), torch.where(in_shard, z.gather(1, local_t.unsqueeze(1)).squeeze(1), 0.0)]
    if label_smoothing:
        stats.append(z[:, :valid].sum(dim=1))
    stats = ReduceFromParallel.apply(torch.stack(stats), group)
    lse = stats[0].log()
    loss = lse - stats[1]
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - stats[2] / vocab)
    keep = target != ignore_index
    loss = torch.where(keep, loss, 0.0)
    if reduction == 0:
        return loss
    total = loss.sum()
    return total / keep.sum() if reduction == 1 else total


def _epilogue(x, epilogue: tuple):
    for kind, c in epilogue:
        x = x * c if kind == "mul" else x / c if kind == "div" else torch.tanh(x)
    return x


# --- the table bind reads -----------------------------------------------------------------------------------
def _redistribute(op, comm, x):
    group = _group(comm)
    for step in op.transforms:
        x = _step(x, step, group)
    return x


def _copy_to_parallel(op, comm, x):
    return CopyToParallel.apply(x, _group(comm))


def _column_parallel_matmul(op, comm, x, weight, bias=None):
    return F.linear(CopyToParallel.apply(x, _group(comm)), weight.t() if op.transposed else weight, bias)


def _vocab_parallel_embedding(op, comm, weight, idx):
    return vocab_parallel_embedding(weight, idx, op.start, op.valid, op.padding_idx)


def _vocab_parallel_cross_entropy(op, comm, logits, target):
    loss = cross_entropy(logits, target, _group(comm), op.start, op.valid, op.ignore_index, op.reduction,
                         op.label_smoothing, op.vocab)
    return loss.to(logits.dtype)


def _vocab_parallel_linear_cross_entropy(op, comm, h, weight, target, bias=None):
    """The LM head and its loss, unchunked: Inductor plans the logits' memory itself."""
    group = _group(comm) if op.size > 1 else ("", 1, 0)
    if op.reduce_input_grad:
        h = CopyToParallel.apply(h, group)
    logits = _epilogue(F.linear(h, weight, bias).float(), op.epilogue)
    loss = cross_entropy(logits, target, group, op.start, op.valid, op.ignore_index, op.reduction,
                         op.label_smoothing, op.vocab)
    return loss.to(op.out_dtype or h.dtype)


def _vocab_parallel_logsumexp(op, comm, x):
    group = _group(comm)
    real = x.narrow(op.dim, 0, op.valid).float()
    m = all_reduce(real.detach().amax(op.dims, keepdim=True), group, "max")
    m = m.masked_fill(m.isinf(), 0.0)
    out = ReduceFromParallel.apply((real - m).exp().sum(op.dims, keepdim=True), group).log() + m
    return (out if op.keepdim else out.squeeze(op.dims)).to(x.dtype)


TRACEABLE = {
    ops.Redistribute: _redistribute,
    ops.CopyToParallel: _copy_to_parallel,
    ops.ColumnParallelMatmul: _column_parallel_matmul,
    ops.VocabParallelEmbedding: _vocab_parallel_embedding,
    ops.VocabParallelCrossEntropy: _vocab_parallel_cross_entropy,
    ops.VocabParallelLogsumexp: _vocab_parallel_logsumexp,
    ops.VocabParallelLinearCrossEntropy: _vocab_parallel_linear_cross_entropy,
}
