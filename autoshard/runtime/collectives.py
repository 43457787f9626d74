"""Every collective as an autograd function with the right backward (Megatron's f and g), and the one
function that executes a planned redistribution (``ir.redistribute.Transform`` steps).

Naming follows Megatron-LM's ``mappings.py`` and the paper (Shoeybi et al. 2019, Fig. 3):

- ``f`` = ``CopyToParallel``: identity forward, all-reduce backward. Sits where a replicated tensor
  enters a column-parallel op (its gradient there is a partial sum);
- ``g`` = ``ReduceFromParallel``: all-reduce forward, identity backward (``Partial -> Replicate``);
- ``GatherFromParallel`` / ``ScatterToParallel``: all-gather forward / take the chunk backward, and the
  converse; ``ReduceScatterToParallel``: reduce-scatter forward / all-gather backward;
- ``ColumnParallelMatmul``: f fused into the matmul it feeds, its all-reduce overlapping dW.

Each takes the ``AxisComm`` of the axis the op names. On ``meta`` tensors they only compute shapes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard.ir import weight_grad
from autoshard.runtime.layout import assemble, blockwise, gather_full, take_shard


def _fresh(t):
    """A custom Function's output that is a view (a padded gather's ``narrow``, a row slice) cannot be
    written in place by the model's code later (autograd refuses); return a tensor of its own instead."""
    return t.clone() if t._base is not None else t


class CopyToParallel(torch.autograd.Function):
    """f: identity forward; all-reduce the (partial) gradient backward."""
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_reduce(g.clone(), "bwd"), None


class GradientShare(torch.autograd.Function):
    """Identity forward; backward, this rank's share of a gradient every rank holds whole (``g / size``),
    for a reduce-scatter that sums the shares (``ir.ops.GatheredReplica``)."""
    @staticmethod
    def forward(ctx, x, size):
        ctx.size = size
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.size, None


class ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce the partial sums forward; identity backward (the gradient is replicated)."""
    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x.clone(), "fwd")

    @staticmethod
    def backward(ctx, g):
        return g, None


class GatherFromParallel(torch.autograd.Function):
    """Shard -> Replicate: all-gather forward; take this rank's chunk of the replicated gradient backward."""
    @staticmethod
    def forward(ctx, x, comm, dim, n, blocks):
        ctx.args = (comm, dim, n, blocks)
        return _fresh(gather_full(x, dim, n, comm, blocks, "fwd"))

    @staticmethod
    def backward(ctx, g):
        comm, dim, n, blocks = ctx.args
        return take_shard(g, dim, n, comm.size, comm.rank, blocks).contiguous(), None, None, None, None


class ScatterToParallel(torch.autograd.Function):
    """Replicate -> Shard: take this rank's chunk forward; all-gather the sharded gradient backward."""
    @staticmethod
    def forward(ctx, x, comm, dim, n, blocks):
        ctx.args = (comm, dim, n, blocks)
        return _fresh(take_shard(x, dim, n, comm.size, comm.rank, blocks).contiguous())

    @staticmethod
    def backward(ctx, g):
        comm, dim, n, blocks = ctx.args
        return gather_full(g, dim, n, comm, blocks, "bwd"), None, None, None, None


class ReduceScatterToParallel(torch.autograd.Function):
    """Partial -> Shard (even dims only): reduce-scatter forward; all-gather backward."""
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.args = (comm, dim)
        return comm.reduce_scatter(x, dim, "fwd")

    @staticmethod
    def backward(ctx, g):
        comm, dim = ctx.args
        return comm.all_gather(g, dim, "bwd"), None, None


class SequenceGather(torch.autograd.Function):
    """Shard -> Replicate into ops that make the gradient partial: all-gather forward; reduce-scatter of
    the partial gradient backward (what an all-gather, then f's all-reduce, then the chunk would give)."""
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.args = (comm, dim)
        return comm.all_gather(x.contiguous(), dim, "fwd")

    @staticmethod
    def backward(ctx, g):
        comm, dim = ctx.args
        return comm.reduce_scatter(g.contiguous(), dim, "bwd"), None, None


class ToPartial(torch.autograd.Function):
    """Replicate -> Partial: rank 0 keeps the value, the others hold zeros; identity backward."""
    @staticmethod
    def forward(ctx, x, comm):
        return x.clone() if comm.rank == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class ShardToPartial(torch.autograd.Function):
    """Shard -> Partial: this rank's chunk in its place of a zero tensor of the full size, so the ranks'
    tensors sum to the whole (a residual on the sequence shard added to row-parallel partial sums before
    their one reduce-scatter, as a parallel attention + MLP block does); backward, this rank's chunk of
    the (replicated) gradient. No communication either way, where a gather would cost one."""
    @staticmethod
    def forward(ctx, x, comm, dim, n, blocks):
        ctx.args = (comm, dim, n, blocks)
        zeros = torch.zeros_like(x)
        return _fresh(assemble(torch.cat([x if j == comm.rank else zeros for j in range(comm.size)], dim), dim, n,
                               comm.size, blocks))

    @staticmethod
    def backward(ctx, g):
        comm, dim, n, blocks = ctx.args
        return take_shard(g, dim, n, comm.size, comm.rank, blocks).contiguous(), None, None, None, None


def _apply(x, step, comm):
    if step.kind == "all_reduce":
        return ReduceFromParallel.apply(x, comm)
    if step.kind == "reduce_scatter":
        return blockwise(lambda v, d: ReduceScatterToParallel.apply(v, comm, d), x, step.dim, step.blocks)
    if step.kind == "all_gather":
        return GatherFromParallel.apply(x, comm, step.dim, step.length, step.blocks)
    if step.kind == "shard":
        return ScatterToParallel.apply(x, comm, step.dim, step.length, step.blocks)
    if step.kind == "to_partial":
        return ToPartial.apply(x, comm)
    if step.kind == "shard_to_partial":
        return ShardToPartial.apply(x, comm, step.dim, step.length, step.blocks)
    raise ValueError(f"unknown redistribution step {step!r}")


def redistribute(x, transforms, comm):
    """Run a planned redistribution (``ir.redistribute.plan_redistribute``) step by step."""
    for step in transforms:
        x = _apply(x, step, comm)
    return x


class ColumnParallelMatmul(torch.autograd.Function):
    """f fused into the column-parallel matmul it feeds: ``y = x W^T + b`` (``W`` stored ``(out, in)``,
    or ``(in, out)`` with ``transposed``, as HF's Conv1D does).

    Backward starts the all-reduce of the partial input gradient, computes the weight and bias
    gradients while it runs, then waits: Megatron's LinearWithGradAccumulationAndAsyncCommunication.
    Under sequence parallelism with ``regather`` the forward keeps the sequence shard, not the gathered
    input, and backward gathers it again while it computes the input gradient, as Megatron does: t times
    less memory for this input, for one more all-gather a backward.
    """
    @staticmethod
    def forward(ctx, x, weight, bias, comm, transposed, held=None, gather_dim=None, regather=False):
        shard = x
        if gather_dim is not None:     # a sequence shard: gathered here, its gradient reduce-scattered
            x = comm.all_gather(x.contiguous(), gather_dim, "fwd")
        ctx.regather = regather and gather_dim is not None
        ctx.save_for_backward(shard if ctx.regather else x, weight)
        ctx.comm, ctx.transposed, ctx.has_bias, ctx.held = comm, transposed, bias is not None, held
        ctx.gather_dim = gather_dim
        return F.linear(x, weight.t() if transposed else weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gathering = ctx.comm.all_gather_async(x, ctx.gather_dim, "bwd") if ctx.regather else None
        w = weight.t() if ctx.transposed else weight          # (out, in)
        dx = g.matmul(w).contiguous()                         # partial sums over this rank's columns
        handle = None
        if ctx.needs_input_grad[0]:
            handle = (ctx.comm.all_reduce_async(dx, "bwd") if ctx.gather_dim is None
                      else ctx.comm.reduce_scatter_async(dx, ctx.gather_dim, "bwd"))
        if gathering is not None:
            x = gathering.wait()
        dw = db = None
        if ctx.held is not None:       # split_weight_grad: dW for the schedule's W (ir/weight_grad.py)
            real, ctx.held = ctx.held[0], None
            weight_grad.defer(x, g, real, ctx.transposed)
        elif ctx.needs_input_grad[1]:
            dw = weight_grad.Deferred(x, g, weight, ctx.transposed).grad()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.reshape(-1, g.shape[-1]).sum(0)
        if handle is not None:
            shard = handle.wait()
            if ctx.gather_dim is not None:
                dx = shard
        return dx, dw, db, None, None, None, None, None
