"""Instantiate a compiled program: bind each parallel op of the graph to the communicator of its axis.

The compiler leaves ``autoshard.ir.ops`` records in the graph (data: axis, placements, shapes).
``bind`` builds a new ``GraphModule`` over the same graph in which each record is replaced by a
``BoundOp`` that runs the op's implementation from ``IMPLEMENTATIONS`` with this rank's ``AxisComm``.
This is the only place process groups meet the compiled graph.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from autoshard.ir import ops, weight_grad
from autoshard.ir.options import resolved_codegen
from autoshard.runtime import collectives as C
from autoshard.runtime import traceable
from autoshard.runtime import losses as L
from autoshard.runtime.chunked_loss import ChunkedLinearCrossEntropy
from autoshard.runtime.device import retarget
from autoshard.runtime.layout import blockwise
from autoshard.runtime.recompute import checkpoint_regions


def _redistribute(op, comm, x):
    return C.redistribute(x, op.transforms, comm)


def _copy_to_parallel(op, comm, x):
    return C.CopyToParallel.apply(x, comm)


def _sequence_gather(op, comm, x):
    return blockwise(lambda v, d: C.SequenceGather.apply(v, comm, d), x, op.dim, op.blocks)


def _gathered_replica(op, comm, x):
    return C.GradientShare.apply(x, op.size)


def _column_parallel_matmul(op, comm, x, weight, bias=None):
    held = None
    if getattr(op, "defer_weight", False) and weight_grad.is_splitting() and torch.is_grad_enabled() \
            and weight.requires_grad:
        # the weight goes in detached, its history held for W (as ir.weight_grad.deferred_linear does)
        weight, held = weight.detach(), [weight]
    if op.gather_dim is None:
        return C.ColumnParallelMatmul.apply(x, weight, bias, comm, op.transposed, held)
    return blockwise(lambda v, d: C.ColumnParallelMatmul.apply(v, weight, bias, comm, op.transposed, held, d,
                                                               op.regather), x, op.gather_dim, op.gather_blocks)


def _vocab_parallel_embedding(op, comm, weight, idx):
    return L.vocab_parallel_embedding(weight, idx, op.start, op.valid, op.padding_idx, op.rows, op.module)


def _vocab_parallel_cross_entropy(op, comm, logits, target):
    return L.VocabParallelCrossEntropy.apply(logits, target, comm, op.start, op.valid, op.ignore_index,
                                            op.reduction, op.inplace, op.label_smoothing, op.vocab)


def _vocab_parallel_linear_cross_entropy(op, comm, h, weight, target, bias=None):
    return ChunkedLinearCrossEntropy.apply(h, weight, target, comm if op.size > 1 else None, op.start, op.valid,
                                           op.ignore_index, op.reduction, op.chunk, torch.is_grad_enabled(),
                                           op.out_dtype, op.label_smoothing, op.vocab, op.reduce_input_grad, bias,
                                           op.epilogue, op.kernel)


def _vocab_parallel_logsumexp(op, comm, x):
    return L.VocabParallelLogsumexp.apply(x, comm, op.dims, op.keepdim, op.dim, op.valid)


IMPLEMENTATIONS = {
    ops.Redistribute: _redistribute,
    ops.CopyToParallel: _copy_to_parallel,
    ops.SequenceGather: _sequence_gather,
    ops.GatheredReplica: _gathered_replica,
    ops.ColumnParallelMatmul: _column_parallel_matmul,
    ops.VocabParallelEmbedding: _vocab_parallel_embedding,
    ops.VocabParallelCrossEntropy: _vocab_parallel_cross_entropy,
    ops.VocabParallelLogsumexp: _vocab_parallel_logsumexp,
    ops.VocabParallelLinearCrossEntropy: _vocab_parallel_linear_cross_entropy,
}


TRACEABLE = {**IMPLEMENTATIONS, **traceable.OVERRIDES}   # what a program Inductor compiles runs


class BoundOp(nn.Module):
    """A parallel op with its communicator: what a ``call_module`` node of an instantiated program runs
    (``table``: ``IMPLEMENTATIONS``, or ``TRACEABLE`` for a program Inductor compiles)."""

    def __init__(self, op: ops.ParallelOp, comm, table: dict = IMPLEMENTATIONS):
        super().__init__()
        self.op, self.comm, self.impl = op, comm, table[type(op)]

    def forward(self, *args):
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
            return self.op.meta_forward(*args)
        return self.impl(self.op, self.comm, *args)

    def extra_repr(self):
        return self.op.extra_repr()


def bind(gm: fx.GraphModule, comms: dict, device: torch.device | None = None, codegen: str = "autoshard",
         cuda_graphs: bool = False):
    """A runnable copy of ``gm``: every ``ir.ops`` record bound to ``comms[record.axis]``, its device literals
    on ``device`` (``runtime/device.py``; None: as traced). ``codegen`` is the program's option
    (``resolved_codegen``): with "inductor", the ops' traceable implementations, and the whole program
    handed to ``torch.compile`` (``runtime/traceable.py``); with ``cuda_graphs`` as well, in its
    "reduce-overhead" mode: every call after the first replays the program's forward and backward as CUDA
    graphs (torch's CUDA graph trees), collectives included where NCCL allows. The shapes are static (one
    program per shape is what the program cache keeps), which is what a CUDA graph needs."""
    codegen = resolved_codegen(codegen)
    table = TRACEABLE if codegen == "inductor" else IMPLEMENTATIONS
    root = nn.Module()
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        op = gm.get_submodule(node.target)
        if getattr(op, "runs_without_comm", False):   # a local kernel (kernels.launch.FusedGroup)
            root.add_module(node.target, op)
            continue
        if type(op) not in IMPLEMENTATIONS:
            raise TypeError(f"node {node.name} calls {type(op).__name__}, which the runtime cannot run")
        if op.axis not in comms:
            raise ValueError(f"node {node.name} communicates on axis '{op.axis}', which this rank has no "
                             f"communicator for (it has {sorted(comms)})")
        root.add_module(node.target, BoundOp(op, comms[op.axis], table))
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # the program keeps its own graph, untouched
    bound = checkpoint_regions(retarget(fx.GraphModule(root, graph), device))   # the recompute plan's regions, if any
    # fallback_random: dropout draws from torch's own generator, as eager does, so every rank seeded alike
    # draws the single device's masks (Inductor's Philox stream would draw others); "reduce-overhead" is
    # Inductor's triton.cudagraphs option, given as one so that both go in
    if codegen == "inductor" and cuda_graphs:
        return torch.compile(bound, dynamic=False, options={"triton.cudagraphs": True, "fallback_random": True})
    if codegen == "inductor":     # static shapes: one compiled graph per program, as the program cache is keyed
        return torch.compile(bound, dynamic=False, options={"reorder_for_compute_comm_overlap": True,
                                                             "fallback_random": True})
    return bound
