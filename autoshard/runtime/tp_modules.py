"""The modules a rewritten graph calls: each inserted collective is a ``call_module`` node.

Why modules and not functions: a module carries its ``TPComm`` and its static arguments (placements,
global shape), prints readably in the pass dumps (``redistribute_3: P -> R``), and needs no globals.
"""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from autoshard.runtime import collectives as C


class Redistribute(nn.Module):
    def __init__(self, comm, src, dst, shape):
        super().__init__()
        self.comm, self.src, self.dst, self.shape = comm, src, dst, tuple(shape)

    def forward(self, x):
        return C.redistribute(x, self.src, self.dst, self.comm, self.shape)

    def extra_repr(self):
        return f"{self.src!r} -> {self.dst!r}, global shape {self.shape}"


class CopyToTP(nn.Module):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""
    def __init__(self, comm, shape):
        super().__init__()
        self.comm, self.shape = comm, tuple(shape)

    def forward(self, x):
        return x if x.is_meta else C.CopyToTP.apply(x, self.comm)

    def extra_repr(self):
        return f"f: all-reduce of the gradient, global shape {self.shape}"


class ColumnParallelMatmul(nn.Module):
    """f and the column-parallel matmul it feeds, fused so the gradient all-reduce overlaps dW."""
    def __init__(self, comm, shape, transposed):
        super().__init__()
        self.comm, self.shape, self.transposed = comm, tuple(shape), transposed

    def forward(self, x, weight, bias=None):
        if x.is_meta:
            return F.linear(x, weight.t() if self.transposed else weight, bias)
        return C.ColumnParallelMatmul.apply(x, weight, bias, self.comm, self.transposed)

    def extra_repr(self):
        return f"f fused: async all-reduce of the input gradient (global shape {self.shape}) overlaps dW"


class VocabParallelEmbedding(nn.Module):
    def __init__(self, start, valid, padding_idx=None):
        super().__init__()
        self.start, self.valid, self.padding_idx = start, valid, padding_idx

    def forward(self, weight, idx):
        return C.vocab_parallel_embedding(weight, idx, self.start, self.valid, self.padding_idx)

    def extra_repr(self):
        return f"rows [{self.start}, {self.start + self.valid})"


class VocabParallelCrossEntropy(nn.Module):
    def __init__(self, comm, start, valid, ignore_index=-100, reduction=1, inplace=False):
        super().__init__()
        self.comm, self.start, self.valid = comm, start, valid
        self.ignore_index, self.reduction, self.inplace = ignore_index, reduction, inplace

    def forward(self, logits, target):
        return C.VocabParallelCrossEntropy.apply(logits, target, self.comm, self.start, self.valid,
                                                 self.ignore_index, self.reduction, self.inplace)

    def extra_repr(self):
        return (f"vocab [{self.start}, {self.start + self.valid}), reduction={self.reduction}"
                + (", in place on the logits" if self.inplace else ""))
