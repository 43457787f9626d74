"""The parallel ops a compiled graph calls: data, not runtime objects.

The tensor-parallel rewrite inserts each collective (and the three vocab-parallel lowerings) as a
``call_module`` node whose module is one of these records. A record names the mesh axis it communicates
on and holds its static arguments; its ``forward`` only computes shapes on ``meta`` tensors (what the
``validate`` pass runs). The runtime binds each record to the communicator of its axis when a program is
instantiated (``autoshard.runtime.bind``), so no process group exists while compiling.

``steps()`` lists the collectives the op runs per step: the one list the dump prints, the program
records, and the runtime's tracer is checked against.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.ir.placement import Placement, local_shape
from autoshard.ir.redistribute import (copy_to_parallel_steps, plan_redistribute, redistribute_steps,
                                       sequence_gather_steps, vocab_parallel_cross_entropy_steps,
                                       vocab_parallel_logsumexp_steps)


def _in_blocks(blocks: int) -> str:
    return f" (in {blocks} blocks)" if blocks != 1 else ""


class NotBoundError(RuntimeError):
    """A compiled program ran on real tensors before the runtime bound its collectives."""


class ParallelOp(nn.Module):
    """Base of the graph's parallel ops: ``axis`` and ``size`` of the mesh axis it works on."""

    def __init__(self, axis: str, size: int):
        super().__init__()
        self.axis, self.size = axis, size

    def forward(self, *args):
        if not all(a.is_meta for a in args if isinstance(a, torch.Tensor)):
            raise NotBoundError(f"{type(self).__name__} ran on real tensors in an unbound program: instantiate it "
                                "with autoshard.runtime.ParallelModule (which binds the process groups)")
        return self.meta_forward(*args)

    def meta_forward(self, *args):
        raise NotImplementedError

    def steps(self) -> list:
        return []


class Redistribute(ParallelOp):
    """Move a tensor of global ``shape`` from ``src`` to ``dst`` on ``axis``: the planned ``transforms``."""

    def __init__(self, axis, size, src: Placement, dst: Placement, shape, requires_grad: bool):
        super().__init__(axis, size)
        self.src, self.dst, self.shape, self.requires_grad = src, dst, tuple(shape), requires_grad
        self.transforms = plan_redistribute(src, dst, self.shape, axis, size)

    def meta_forward(self, x):
        return x.new_empty(local_shape(self.shape, self.dst, self.size))

    def steps(self):
        return redistribute_steps(self.transforms, self.requires_grad, self.shape, f"{self.src!r} -> {self.dst!r}",
                                  self.size)

    def extra_repr(self):
        return f"{self.src!r} -> {self.dst!r} on {self.axis}, global shape {self.shape}: {list(self.transforms)}"


class CopyToParallel(ParallelOp):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    def __init__(self, axis, size, shape):
        super().__init__(axis, size)
        self.shape = tuple(shape)

    def meta_forward(self, x):
        return x

    def steps(self):
        return copy_to_parallel_steps(self.axis, self.shape)

    def extra_repr(self):
        return f"f on {self.axis}: all-reduce of the gradient, global shape {self.shape}"


class SequenceGather(ParallelOp):
    """Sequence parallelism's gather into a tensor-parallel region (Megatron's
    ``gather_from_sequence_parallel_region`` with a partial output gradient): all-gather along ``dim``
    forward; backward, reduce-scatter of the partial gradient. It takes the place of an all-gather
    followed by f, whose backward would all-reduce the gradient and then keep a chunk of it: twice the
    bytes for the same result."""

    def __init__(self, axis, size, shape, dim: int, blocks: int = 1):
        super().__init__(axis, size)
        self.shape, self.dim = tuple(shape), dim
        self.blocks = blocks          # a dim of equal blocks, each sharded (a (b, s, h) stream viewed (b * s, h))

    def meta_forward(self, x):
        return x.new_empty(self.shape)

    def steps(self):
        return sequence_gather_steps(self.axis, self.shape)

    def extra_repr(self):
        return (f"sequence gather on {self.axis} along dim {self.dim}{_in_blocks(self.blocks)} (reduce-scatter "
                f"backward), global shape {self.shape}")


class GatheredReplica(ParallelOp):
    """A ``SequenceGather``'s output read by ops whose gradient is whole on every rank (GQA's k and v
    projections, replicated where there are fewer kv heads than tp ranks), beside the column-parallel
    ones it feeds: identity forward; backward, the gradient over ``size``. The gather's reduce-scatter
    sums every rank's share, so the replicated part counts once, and one all-gather serves both kinds
    of reader where a plain all-gather for the replicated ones would move the stream a second time."""

    def __init__(self, axis, size, shape):
        super().__init__(axis, size)
        self.shape = tuple(shape)

    def meta_forward(self, x):
        return x

    def extra_repr(self):
        return f"the sequence gather's output, read with a whole gradient (/ {self.size} backward), global shape {self.shape}"


class ColumnParallelMatmul(ParallelOp):
    """f fused into the column-parallel matmul it feeds, so the gradient all-reduce overlaps dW.
    ``y = x W^T + b``, with ``W`` stored ``(out, in)``, or ``(in, out)`` when ``transposed`` (HF Conv1D).

    With ``gather_dim`` it is sequence parallelism's ``SequenceGather`` fused instead: ``x`` arrives as a
    sequence shard and is all-gathered along ``gather_dim`` forward, and the input gradient's
    reduce-scatter overlaps dW (Megatron's linear with async communication under sequence parallelism)."""

    def __init__(self, axis, size, shape, transposed: bool, gather_dim: int | None = None, regather: bool = False,
                 gather_blocks: int = 1):
        super().__init__(axis, size)
        self.shape, self.transposed, self.gather_dim = tuple(shape), transposed, gather_dim
        self.gather_blocks = gather_blocks    # as SequenceGather.blocks
        # sequence_parallel="regather": keep the shard, gather it again in backward (Megatron's memory)
        self.regather = regather and gather_dim is not None
        self.defer_weight = False     # split_weight_grad: dW waits for the schedule's W (ir/weight_grad.py)

    def meta_forward(self, x, weight, bias=None):
        if self.gather_dim is not None:
            x = x.new_empty(self.shape)
        return F.linear(x, weight.t() if self.transposed else weight, bias)

    def steps(self):
        base = (copy_to_parallel_steps(self.axis, self.shape) if self.gather_dim is None
                else sequence_gather_steps(self.axis, self.shape))
        out = [replace(s, what=s.what + ", overlapped with dW") if s.phase == "bwd" else s for s in base]
        if self.regather:       # the forward's gather again, in backward, under the input gradient's matmul
            out += [replace(s, phase="bwd", what=s.what + " again in backward (the shard kept, not the gathered input)")
                    for s in base if s.phase == "fwd"]
        return out

    def extra_repr(self):
        if self.gather_dim is not None:
            where = f"along dim {self.gather_dim}{_in_blocks(self.gather_blocks)}"
            return (f"sequence gather fused on {self.axis} {where}: async reduce-scatter of the input gradient "
                    f"(global shape {self.shape}) overlaps dW"
                    + ("; the shard is kept and gathered again in backward" if self.regather else ""))
        return f"f fused on {self.axis}: async all-reduce of the input gradient (global shape {self.shape}) overlaps dW"


class VocabParallelEmbedding(ParallelOp):
    """Look up the rows ``[start, start + valid)`` this rank holds; zeros elsewhere (a Partial sum)."""

    def __init__(self, axis, size, start: int, valid: int, padding_idx=None, rows: int | None = None,
                 module: str = ""):
        super().__init__(axis, size)
        self.start, self.valid, self.padding_idx = start, valid, padding_idx
        self.rows = rows         # the whole embedding's rows: ids outside [0, rows) are an error
        self.module = module     # the model's module that looks them up (for that error)

    def meta_forward(self, weight, idx):
        return weight.new_empty(tuple(idx.shape) + (weight.shape[1],))

    def extra_repr(self):
        return f"rows [{self.start}, {self.start + self.valid}) on {self.axis}"


class VocabParallelCrossEntropy(ParallelOp):
    """Cross-entropy of ``rows`` logits sharded by vocab on ``axis``; never gathers the logits.

    ``label_smoothing`` (torch's ``eps``) mixes in the uniform distribution over the ``vocab`` real
    classes; it adds one row statistic (the row sum of the logits) to the stacked all-reduce."""

    def __init__(self, axis, size, rows: int, start: int, valid: int, ignore_index=-100, reduction=1,
                 inplace=False, label_smoothing: float = 0.0, vocab: int | None = None):
        super().__init__(axis, size)
        self.rows, self.start, self.valid = rows, start, valid
        self.ignore_index, self.reduction, self.inplace = ignore_index, reduction, inplace
        self.label_smoothing, self.vocab = float(label_smoothing), vocab
        if self.label_smoothing and vocab is None:
            raise ValueError("a label-smoothed vocab-parallel cross-entropy needs the global vocab size")

    @property
    def stats(self) -> int:
        """Row statistics in the stacked all-reduce: sum of exps, target logit (, row sum of logits)."""
        return 3 if self.label_smoothing else 2

    def meta_forward(self, logits, target):
        return logits.new_empty(() if self.reduction != 0 else target.shape)

    def steps(self):
        return vocab_parallel_cross_entropy_steps(self.axis, self.rows, self.stats)

    def extra_repr(self):
        return (f"vocab [{self.start}, {self.start + self.valid}) on {self.axis}, reduction={self.reduction}, "
                f"ignore_index={self.ignore_index}"
                + (f", label_smoothing={self.label_smoothing} over {self.vocab} classes" if self.label_smoothing else "")
                + (", in place on the logits" if self.inplace else ""))


class VocabParallelLinearCrossEntropy(ParallelOp):
    """The LM head and the vocab-parallel cross-entropy as one op, chunked over ``rows`` so the
    ``[rows, V/t]`` logits never exist whole (``runtime/chunked_loss.py``; ``passes/chunk_loss.py`` makes
    it where only the loss reads the logits). Inputs: the hidden states ``[rows, H]`` (replicated on tp),
    this rank's head rows ``[V/t, H]``, the targets ``[rows]``, and the head's bias ``[V/t]`` when it has
    one. It carries what
    ``VocabParallelCrossEntropy`` carries, plus ``chunk`` (rows per chunk) and ``reduce_input_grad``: the
    hidden states' gradient is a partial sum over the vocab shards, all-reduced here in backward when the
    head was a ``ColumnParallelMatmul`` (its ``f`` fused in), and left to the ``f`` still in the graph
    otherwise. Traffic, per chunk: the cross-entropy's row max and stacked statistics, for the chunk's rows;
    then that one gradient all-reduce. At tp = 1 every collective is the identity and none is listed."""

    def __init__(self, axis, size, rows: int, hidden: int, start: int, valid: int, ignore_index: int,
                 reduction: int, chunk: int, label_smoothing: float = 0.0, vocab: int | None = None,
                 reduce_input_grad: bool = True, out_dtype: torch.dtype | None = None, epilogue: tuple = (),
                 kernel: bool = False):
        super().__init__(axis, size)
        if chunk < 1:
            raise ValueError(f"a chunked cross-entropy needs at least one row per chunk, got {chunk}")
        if label_smoothing and vocab is None:
            raise ValueError("a label-smoothed chunked cross-entropy needs the global vocab size")
        self.rows, self.hidden, self.start, self.valid = rows, hidden, start, valid
        self.ignore_index, self.reduction, self.chunk = ignore_index, reduction, chunk
        self.label_smoothing, self.vocab = float(label_smoothing), vocab
        self.reduce_input_grad, self.out_dtype = reduce_input_grad, out_dtype
        self.kernel = kernel     # each chunk's loss and gradient by kernels/cross_entropy.py (fuse on)
        self.epilogue = tuple(epilogue)   # (("div", 30.0), ("tanh", None), ("mul", 30.0)): Gemma 2's soft cap

    @property
    def chunks(self) -> int:
        return -(-self.rows // self.chunk)

    @property
    def epilogue_text(self) -> str:
        """``div 30 -> tanh -> mul 30``: the epilogue as the dump and ``repr`` print it."""
        return " -> ".join(k if c is None else f"{k} {c:g}" for k, c in self.epilogue)

    @property
    def stats(self) -> int:
        """Row statistics in each chunk's stacked all-reduce (as ``VocabParallelCrossEntropy.stats``)."""
        return 3 if self.label_smoothing else 2

    def meta_forward(self, h, weight, target, bias=None):
        return h.new_empty((), dtype=self.out_dtype or h.dtype)

    def steps(self):
        if self.size == 1:
            return []
        out = []
        for s in range(0, self.rows, self.chunk):
            out += vocab_parallel_cross_entropy_steps(self.axis, min(self.chunk, self.rows - s), self.stats)
        if self.reduce_input_grad:
            out += [replace(c, what="chunked loss: gradient of the LM head's input (the head's f)")
                    for c in copy_to_parallel_steps(self.axis, (self.rows, self.hidden))]
        return out

    def extra_repr(self):
        return (f"vocab [{self.start}, {self.start + self.valid}) on {self.axis}, {self.rows} rows in {self.chunks} "
                f"chunks of {self.chunk}, reduction={self.reduction}, ignore_index={self.ignore_index}"
                + (f", label_smoothing={self.label_smoothing} over {self.vocab} classes" if self.label_smoothing else "")
                + ("" if self.reduce_input_grad else ", input gradient reduced by the f before it")
                + (f", logits through {self.epilogue_text}" if self.epilogue else ""))


class VocabParallelLogsumexp(ParallelOp):
    """``logsumexp`` over ``dims`` of a tensor sharded on ``dim`` (one of them) on ``axis``; the rank holds
    ``valid`` real entries of that dim (the rest of its shard is padding). Output of global ``shape``,
    replicated; backward is local (softmax times the output gradient on this rank's shard)."""

    def __init__(self, axis, size, shape, dims, keepdim: bool, dim: int, valid: int):
        super().__init__(axis, size)
        self.shape, self.dims, self.keepdim = tuple(shape), tuple(dims), bool(keepdim)
        self.dim, self.valid = dim, valid

    def meta_forward(self, x):
        return torch.logsumexp(x, self.dims, self.keepdim)

    def steps(self):
        return vocab_parallel_logsumexp_steps(self.axis, self.shape)

    def extra_repr(self):
        return (f"logsumexp over dims {list(self.dims)} sharded on dim {self.dim} ({self.valid} real) on "
                f"{self.axis}, output {self.shape}")
