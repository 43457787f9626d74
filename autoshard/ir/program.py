"""The records a compile produces and the runtime consumes: what was captured, and one rank's program."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autoshard.ir.mesh import MeshSpec
from autoshard.ir.options import CompileOptions
from autoshard.ir.placement import DistSpec


@dataclass
class Captured:
    """The model as ``torch.export`` saw it: the ATen graph and how to call it and read its result."""
    gm: fx.GraphModule
    in_spec: object          # pytree spec of (args, kwargs)
    out_spec: object         # pytree spec of the forward's output
    param_names: list        # placeholder order: parameter FQNs (one per distinct tensor)
    buffer_names: list
    aliases: dict            # FQN of a tied parameter -> FQN of the one the graph uses
    user_input_names: list
    constants: dict          # lifted constant tensors (export's ep.constants), by name
    example_leaves: list     # the flattened example inputs: non-tensors are compiled in, tensors give shapes
    input_leaves: list = field(default_factory=list)   # indices of the leaves the graph reads, in order
    example_requires_grad: list = field(default_factory=list)  # per leaf: a tensor that requires grad
    regions: list = field(default_factory=list)        # higher-order regions inlined at capture
    functionalized: list = field(default_factory=list) # modules whose writes into views became scatters
    index_ranges: list = field(default_factory=list)   # [IndexRange]: user inputs used as indices


@dataclass(frozen=True)
class IndexRange:
    """A user input whose values index something of ``size`` entries (token ids into an embedding, labels
    into a loss's classes): the runtime checks it on every rank at a call's start
    (``runtime/input_checks.py``), since the sharded op masks what its shard does not hold."""
    input: str               # the user input's name (``input_ids``, ``labels``)
    size: int                # valid values are [0, size)
    what: str                # "token id" or "label"
    ignore_index: int | None = None   # also valid (a loss's skipped positions)
    module: str = ""         # where the model uses it, for the message


@dataclass(frozen=True)
class ParamRecord:
    """One parameter of the program, in placeholder order."""
    name: str                # its name in the original model
    spec: DistSpec
    global_shape: tuple
    local_shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.local_shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective the program runs per step (a ``CommStep`` placed at a graph node)."""
    node: str                # the graph node that runs it
    source: str | None       # the node whose value it moves
    axis: str
    phase: str               # fwd | bwd
    kind: str                # all_reduce | all_gather | reduce_scatter
    shape: tuple             # the full tensor communicated
    itemsize: int
    what: str
    stacked: int = 1         # tensors of ``shape`` sent stacked in this one call

    @property
    def numel(self) -> int:
        return self.stacked * math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass
class PlanReport:
    """What the planner decided beyond placements: the ILP's size and anything left replicated."""
    axis: str
    size: int
    solve_seconds: float = 0.0
    objective: float = 0.0
    variables: int = 0
    unruled: list = field(default_factory=list)             # nodes (op, module) replicated for want of a rule
    replicated_weights: list = field(default_factory=list)  # weight names left replicated
    attention: list = field(default_factory=list)           # per attention: heads, kv heads, what tp does


@dataclass
class Program:
    """One rank's compiled program: the local graph (with unbound parallel ops) and its records."""
    gm: fx.GraphModule
    captured: Captured
    mesh: MeshSpec
    rank: int
    options: CompileOptions
    params: list             # [ParamRecord], in placeholder order
    collectives: list        # [CollectiveRecord]
    symbols: dict            # sympy Symbol -> size, for formulas (b, s, h, V)
    report: PlanReport | None = None
    timings: dict = field(default_factory=dict)   # pass name -> seconds
    compile_seconds: float = 0.0

    @property
    def coords(self) -> dict:
        return self.mesh.coords(self.rank)


def comm_summary(collectives) -> tuple:
    """Calls and bytes per (axis, phase, kind): the keys the runtime's tracers count under."""
    calls, nbytes = Counter(), Counter()
    for c in collectives:
        calls[c.axis, c.phase, c.kind] += 1
        nbytes[c.axis, c.phase, c.kind] += c.nbytes
    return calls, nbytes
