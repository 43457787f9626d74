"""What the fusion pass decided, as data: the dump prints it and the tests read it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelRecord:
    """One generated kernel: its file in the kernel cache and its template."""
    name: str
    template: str          # "pointwise" or "row"
    path: str
    source: str


@dataclass(frozen=True)
class FusionGroup:
    """A group of the per-rank graph that runs as one forward kernel and one backward kernel.

    Bytes are counted from the local shapes: ``eager`` is what the unfused ops read and write (each
    op its inputs and output; in backward, the ops autograd runs for them), ``fused`` what the kernels
    read and write (the group's inputs and outputs; in backward, the inputs it recomputes from, the
    output gradients, and the input gradients).
    """
    name: str
    nodes: tuple           # names of the graph nodes fused
    ops: tuple             # their ATen ops, in order
    anchor: tuple          # the [.., cols] iteration space
    inputs: tuple          # names of the values read
    outputs: tuple         # names of the values produced
    saved: tuple           # inputs kept for backward (the backward recomputes the rest)
    eager_bytes: int
    fused_bytes: int
    eager_backward_bytes: int
    fused_backward_bytes: int
    kernels: tuple         # KernelRecords, forward first


@dataclass(frozen=True)
class Unfused:
    """A candidate group left to eager ops, and why."""
    nodes: tuple
    reason: str


@dataclass
class FusionReport:
    enabled: bool
    why: str                                   # why fusion is on or off ("fuse='auto' on CPU", ...)
    groups: list = field(default_factory=list)
    unfused: list = field(default_factory=list)

    @property
    def kernel_count(self) -> int:
        return sum(len(g.kernels) for g in self.groups)
