"""The parts of a decoder layer the planner prices beyond its widths: weight matrices as tensor
parallelism splits them (``Gemm``), and a token mixer other than softmax attention (``Mixer``: a Mamba
scan, gated-delta linear attention, a short convolution, an RG-LRU), read off a model's layers
(``planner/layer_reading.py``) and held by ``ModelShape``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gemm:
    """One weight matrix of a layer, ``inner`` features in and ``outer`` out, and the dimension tensor
    parallelism splits: "outer" (column-parallel), "inner" (row-parallel) or "" (replicated)."""
    inner: int
    outer: int
    split: str

    def local(self, t: int) -> tuple:
        """``(outer, inner)`` on one of ``t`` tensor-parallel ranks."""
        return (self.outer / t if self.split == "outer" else self.outer,
                self.inner / t if self.split == "inner" else self.inner)


@dataclass(frozen=True)
class Mixer:
    """A token mixer other than softmax attention, as the planner prices it: its weight matrices, each a
    GEMM over the tokens with its inner work split over tp (Megatron splits a Mamba mixer by heads: its
    input projection column-parallel, its output projection back to the stream row-parallel, which
    costs the block one all-reduce forward and one backward, as attention's does); and its recurrence or
    convolution, a memory-bound pass over ``state_width`` elements a token (its input projection's
    output). The second is an estimate from the sizes, not a scan kernel's measured time."""
    name: str                 # its class, for the report
    gemms: tuple              # Gemm
    other_params: int         # parameters that multiply no token matrix: convolution taps, decays, norms
    state_width: int

    def params(self) -> int:
        return sum(g.inner * g.outer for g in self.gemms) + self.other_params
