"""The records of a pipelined program: where the model is cut, what each stage costs, how the loss is
combined over microbatches, and the per-stage graphs a rank runs.

Written by the passes (``passes/pipeline_split.py``, ``passes/microbatch_loss.py``, ``passes/stages.py``),
read by the runtime (``runtime/step_runner.py``) and the dump. Plain data: nothing here runs a collective.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autoshard.ir.mesh import MeshSpec
from autoshard.ir.options import CompileOptions
from autoshard.ir.schedule import Schedule

STAGE_PLAN = "autoshard_stage_plan"      # GraphModule.meta key: the StagePlan (pipeline_split)
LOSS_REWRITE = "autoshard_loss_rewrite"  # GraphModule.meta key: the LossRewrite (microbatch_loss)


@dataclass(frozen=True)
class StageCost:
    """One stage (model chunk) for one microbatch, as the balancer priced it."""
    forward_seconds: float
    flops: float
    param_bytes: int          # parameters, gradients and AdamW state this stage holds (fp32)
    activation_bytes: float   # what one microbatch's forward keeps for its backward, on one rank (a tp share)
    layers: tuple = ()        # the layer indices (of the model's repeated block) it holds
    recompute_seconds: float = 0.0   # the forward its backward runs again (activation recompute)
    weight_seconds: float = 0.0      # of the backward, the weight gradients of its matmuls by a parameter:
                                     # a split schedule's W, B the rest (0 with none; where no stage has
                                     # any, the simulator takes half the backward)

    @property
    def backward_seconds(self) -> float:
        """Twice the forward (the gradients of the inputs and of the weights), and any recompute."""
        return 2 * self.forward_seconds + self.recompute_seconds


@dataclass
class StagePlan:
    """Where the captured graph is cut. ``boundaries[k]`` names the node whose value chunk k sends to
    chunk k+1 (the residual stream), ``carried[k]`` the small activations sent beside it (an MoE router's
    logits kept for the auxiliary loss; usually none); ``costs[k]`` is chunk k's predicted cost."""
    num_stages: int
    boundaries: list
    costs: list
    how: str                                     # "balanced" | "pipeline_cuts"
    candidates: int                              # cut points the graph offers
    layer_count: int = 0
    predicted_step: float = 0.0                  # seconds, simulated with the chosen schedule
    predicted_peak_bytes: dict = field(default_factory=dict)   # pp rank -> params + activations
    uniform: dict | None = None                  # uniform layer cuts for comparison: cuts, step, peak
    recomputed: dict = field(default_factory=dict)   # chunk -> input-only nodes it recomputes (not sent)
    stretches: list = field(default_factory=list)    # candidate-stretch index where each chunk after the first starts
    carried: list = field(default_factory=list)      # per boundary: names of the values sent beside it
    schedule: object = None                      # the compute-only Schedule these stages run (priced with them)
    schedule_choice: str = ""                    # schedule="auto": what it chose and why
    simulation: object = None                    # the ir.simulator.Costs predicted_step was simulated with

    def sent(self, k: int) -> tuple:
        """The names of everything chunk k sends to chunk k+1, the residual stream first."""
        return (self.boundaries[k],) + (tuple(self.carried[k]) if k < len(self.carried) else ())


@dataclass
class LossRewrite:
    """How the loss of a whole batch is made from microbatches. ``exact``: the graph returns the summed
    cross-entropy of a microbatch and ``count`` counts its non-ignored targets; the runtime divides by the
    global count (a summed loss, exact with no ``count``, is divided by nothing). Otherwise the graph
    returns the model's loss and the runtime divides by the number of microbatches (the mean of
    microbatch means). ``scale_input``: a loss of several terms (a mean cross-entropy plus an MoE router's
    auxiliary loss); the graph's cross-entropy is its microbatch sum times this input, which the runtime
    sets to (microbatches x dp) / the global count, and the whole loss is then divided by microbatches x
    dp: the cross-entropy term is exact, the other terms are the mean of their microbatch values. A summed
    cross-entropy divided by one number for the whole batch plus other terms (HF's ``num_items_in_batch``
    given to an MoE) has no ``count``: its scale input is microbatches x dp."""
    exact: bool
    reason: str
    count: fx.GraphModule | None = None
    count_inputs: list = field(default_factory=list)   # user input names the count graph reads
    scale_input: str | None = None


@dataclass(frozen=True)
class ChunkInput:
    """One placeholder of a chunk graph: ``kind`` is boundary, parameter, buffer or input."""
    kind: str
    name: str


@dataclass
class Chunk:
    """One stage's local graph. It reads the previous stage's boundary value (all but the first), the
    parameters, buffers and user inputs it uses, and returns its boundary value, or the loss (last)."""
    index: int
    gm: fx.GraphModule
    inputs: list                 # [ChunkInput], placeholder order
    params: list                 # [ParamRecord]
    in_shape: tuple | None       # local shape and dtype of the boundary it receives (1-D: several values packed)
    in_dtype: torch.dtype | None
    out_shape: tuple             # local shape and dtype of what it returns
    out_dtype: torch.dtype
    last: bool
    in_replicated: bool = False  # the boundary received is placed Replicate on tp (no sequence shard; at
    out_replicated: bool = False # tp = 1 trivially), and so what it sends: scatter/gather may slice it

    @property
    def param_names(self) -> list:
        return [r.name for r in self.params]


@dataclass
class PipelineProgram:
    """One rank's pipelined program: every chunk's graph (all ranks compile the same plan; each keeps
    the chunks of its own pp coordinate), the schedule with its transfers, and the records above."""
    captured: object             # Captured (microbatch shapes)
    mesh: MeshSpec
    rank: int
    options: CompileOptions
    chunks: list                 # [Chunk], every stage
    schedule: Schedule           # lowered (add_communication)
    plan: StagePlan
    loss: LossRewrite
    collectives: list            # [CollectiveRecord] of the whole local graph
    symbols: dict
    compile_seconds: float = 0.0
    report: object = None
    timings: dict = field(default_factory=dict)
    gm: fx.GraphModule | None = None     # the whole local graph before the cut (for plan.md)
    # [ParamRecord] of the model's parameters no stage reads (a value head the loss does not use): held
    # whole by pp rank 0, so the module, its checkpoints and full_state_dict keep them, and untouched by
    # training (no gradient, as on one device)
    unread: list = field(default_factory=list)

    @property
    def coords(self) -> dict:
        return self.mesh.coords(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.mesh.coords(self.rank)["pp"]

    @property
    def own(self) -> list:
        """The chunks this rank runs, in stage order."""
        return [self.chunks[s] for s in self.schedule.stages_of(self.pp_rank)]

    @property
    def params(self) -> list:
        """This rank's ParamRecords, each once (a tied weight on two of its chunks is one tensor)."""
        seen, out = set(), []
        for c in self.own:
            for r in c.params:
                if r.name not in seen:
                    seen.add(r.name)
                    out.append(r)
        return out + (list(self.unread) if self.pp_rank == 0 else [])

    def ties(self) -> dict:
        """Parameters held by more than one pp rank: ``{name: sorted pp ranks}`` (Megatron's embedding
        group). Their gradients are summed over those ranks before the optimizer step."""
        where: dict = {}
        for c in self.chunks:
            for name in c.param_names:
                where.setdefault(name, set()).add(self.schedule.rank_of(c.index))
        return {n: sorted(r) for n, r in where.items() if len(r) > 1}
