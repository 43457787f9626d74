"""The parallel ops as Inductor can compile them: functional collectives and composite torch ops.

With ``parallelize(..., codegen="inductor")`` each rank's bound program goes through ``torch.compile``:
dynamo traces forward and backward into ATen graphs and Inductor generates the kernels (Triton on a GPU,
C++ on a CPU), fusing every pointwise and reduction chain. The eager implementations
(``collectives.py``, ``losses.py``, ``chunked_loss.py``) are written for eager speed: in-place
collectives (``dist.all_reduce``), in-place buffers saved for backward, a gradient computed inside
forward. Dynamo cannot trace those. Here every op is written again, for the compiler:

- collectives are ``torch.ops._c10d_functional`` calls (out of place, then ``wait_tensor``), the form
  Inductor schedules, reorders and buckets (torch's functional collectives);
- Megatron's f, g and the gather/scatter pairs are the eager path's own autograd functions
  (``collectives.py``) over a ``FunctionalComm``, since the functional collectives have no derivative of
  their own (an all-reduce's gradient depends on what the caller means by it: ``g`` is an all-reduce
  forward and the identity backward);
- the vocab-parallel losses and the logsumexp are composites of differentiable ops around ``g``: every
  rank holds the same loss, so the identity backward of ``g`` gives each rank exactly its local
  gradient (``softmax - onehot`` on its shard), and autograd derives it; nothing is hand-written.

Semantics are the eager ops' (``ignore_index``, padded vocab columns, label smoothing, fp32 statistics),
and the tests hold both paths to the single-device model. What is not kept: the per-call collective
counts (``pm.comm_counts()``): a compiled program's collectives are its plan's (``pm.program.collectives``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard.ir import ops
from autoshard.runtime import collectives as C
from autoshard.runtime.input_checks import check_range
from autoshard.runtime.layout import blockwise

C10D = torch.ops._c10d_functional


# --- functional collectives on one axis -------------------------------------------------------------------
@dataclass(frozen=True)
class FunctionalComm:
    """``AxisComm``'s collectives as functional collectives (out of place, then ``wait_tensor``), for the
    same autograd functions (``collectives.py``: Megatron's f, g and the gather/scatter pairs) to run
    inside a compiled graph. Plain values only, so dynamo traces it as a constant."""
    name: str           # the process group's name ("" for one rank)
    size: int
    rank: int

    @staticmethod
    def of(comm) -> "FunctionalComm":
        return FunctionalComm(comm.group.group_name if comm.group is not None else "", comm.size, comm.rank)

    def all_reduce(self, x, phase=None, op=dist.ReduceOp.SUM):
        if self.size == 1:
            return x
        how = "max" if op == dist.ReduceOp.MAX else "sum"
        return C10D.wait_tensor(C10D.all_reduce(x.contiguous(), how, self.name))

    def all_gather(self, x, dim, phase=None):
        """Every rank's ``x`` concatenated along ``dim``."""
        if self.size == 1:
            return x
        front = x.movedim(dim, 0).contiguous()
        return C10D.wait_tensor(C10D.all_gather_into_tensor(front, self.size, self.name)).movedim(0, dim)

    def reduce_scatter(self, x, dim, phase=None):
        """The sum over ranks of ``x``, this rank's equal chunk of ``dim``."""
        if self.size == 1:
            return x
        front = x.movedim(dim, 0).contiguous()
        return C10D.wait_tensor(C10D.reduce_scatter_tensor(front, "sum", self.size, self.name)).movedim(0, dim)


ONE_RANK = FunctionalComm("", 1, 0)


# --- the losses as composites -----------------------------------------------------------------------------
def cross_entropy(logits, target, comm: FunctionalComm, start: int, valid: int, ignore_index: int, reduction: int,
                  label_smoothing: float = 0.0, vocab: int | None = None):
    """The vocab-parallel cross-entropy (``losses.VocabParallelCrossEntropy``'s semantics) of logits
    ``[rows, V/t]``, differentiable by autograd: the row max is a constant (it cancels), the sums over
    vocab shards go through ``g``."""
    check_range(target, vocab, "label", ignore_index)
    x = logits.float()
    local = x.shape[1]
    row_max = comm.all_reduce(x[:, :valid].detach().amax(dim=1), op=dist.ReduceOp.MAX)
    z = x - row_max.unsqueeze(1)
    if valid < local:    # padded vocab columns take no probability mass
        z = z.masked_fill(torch.arange(local, device=z.device) >= valid, float("-inf"))
    in_shard = (target >= start) & (target < start + valid)
    local_t = (target - start).masked_fill(~in_shard, 0)
    stats = [z.exp().sum(dim=1), torch.where(in_shard, z.gather(1, local_t.unsqueeze(1)).squeeze(1), 0.0)]
    if label_smoothing:
        stats.append(z[:, :valid].sum(dim=1))
    stats = C.ReduceFromParallel.apply(torch.stack(stats), comm)
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
    return C.redistribute(x, op.transforms, FunctionalComm.of(comm))


def _copy_to_parallel(op, comm, x):
    return C.CopyToParallel.apply(x, FunctionalComm.of(comm))


def _gathered(comm, x, dim, blocks):
    fc = FunctionalComm.of(comm)
    return blockwise(lambda v, d: C.SequenceGather.apply(v, fc, d), x, dim, blocks)


def _sequence_gather(op, comm, x):
    return _gathered(comm, x, op.dim, op.blocks)


def _column_parallel_matmul(op, comm, x, weight, bias=None):
    """f (or the sequence gather), then the matmul: Inductor schedules the gradient's collective against
    dW itself."""
    if op.gather_dim is None:
        x = C.CopyToParallel.apply(x, FunctionalComm.of(comm))
    else:
        x = _gathered(comm, x, op.gather_dim, op.gather_blocks)
    return F.linear(x, weight.t() if op.transposed else weight, bias)


def _vocab_parallel_cross_entropy(op, comm, logits, target):
    loss = cross_entropy(logits, target, FunctionalComm.of(comm), op.start, op.valid, op.ignore_index,
                         op.reduction, op.label_smoothing, op.vocab)
    return loss.to(logits.dtype)


def _vocab_parallel_linear_cross_entropy(op, comm, h, weight, target, bias=None):
    """The LM head and its loss, unchunked: Inductor plans the logits' memory itself."""
    fc = FunctionalComm.of(comm) if op.size > 1 else ONE_RANK
    if op.reduce_input_grad:
        h = C.CopyToParallel.apply(h, fc)
    logits = _epilogue(F.linear(h, weight, bias).float(), op.epilogue)
    loss = cross_entropy(logits, target, fc, op.start, op.valid, op.ignore_index, op.reduction,
                         op.label_smoothing, op.vocab)
    return loss.to(op.out_dtype or h.dtype)


def _vocab_parallel_logsumexp(op, comm, x):
    fc = FunctionalComm.of(comm)
    real = x.narrow(op.dim, 0, op.valid).float()
    m = fc.all_reduce(real.detach().amax(op.dims, keepdim=True), op=dist.ReduceOp.MAX)
    m = m.masked_fill(m.isinf(), 0.0)
    out = C.ReduceFromParallel.apply((real - m).exp().sum(op.dims, keepdim=True), fc).log() + m
    return (out if op.keepdim else out.squeeze(op.dims)).to(x.dtype)


# the ops whose eager implementation dynamo cannot trace (``bind.TRACEABLE`` takes the rest, the
# vocab-parallel embedding, from the eager table: it is plain torch ops)
OVERRIDES = {
    ops.Redistribute: _redistribute,
    ops.CopyToParallel: _copy_to_parallel,
    ops.SequenceGather: _sequence_gather,
    ops.ColumnParallelMatmul: _column_parallel_matmul,
    ops.VocabParallelCrossEntropy: _vocab_parallel_cross_entropy,
    ops.VocabParallelLogsumexp: _vocab_parallel_logsumexp,
    ops.VocabParallelLinearCrossEntropy: _vocab_parallel_linear_cross_entropy,
}
