"""Every switch autoshard reads, in one place (docs/architecture.md and the README have the same table).

| variable / option     | meaning                                                             |
|-----------------------|---------------------------------------------------------------------|
| ``AUTOSHARD_DUMP``    | directory for pass dumps and ``plan.md`` (same as ``dump=``)        |
| ``AUTOSHARD_TIMEOUT`` | seconds before a collective gives up (process-group timeout), 300   |
| ``AUTOSHARD_CHECK_REPLICAS`` | every N ``pm.step`` calls (or training forwards), compare replicated parameters across ranks |
| ``AUTOSHARD_CHECK_FINITE`` | ``1``: raise, naming the step, on a NaN/inf loss or gradient norm (``check_finite=``) |
| ``AUTOSHARD_BACKEND`` | ``gloo`` or ``nccl`` for the process groups autoshard starts; default NCCL when CUDA is there |
| ``CompileOptions``    | the one typed options object ``parallelize`` builds and passes see  |
| ``CostModel``         | machine constants the planner prices plans with                     |
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field, fields

from autoshard.ir.schedule import SPLIT_SCHEDULES


def dump_dir(explicit: str | None) -> str | None:
    return explicit or os.environ.get("AUTOSHARD_DUMP") or None


def pg_timeout_seconds() -> float:
    return float(os.environ.get("AUTOSHARD_TIMEOUT", "300"))


def default_backend() -> str:
    """``AUTOSHARD_BACKEND``, else NCCL where CUDA is available and gloo elsewhere (``gloo`` on a GPU machine
    runs everything on the CPU: the test suite does, as its models and references are on the CPU)."""
    import torch
    chosen = os.environ.get("AUTOSHARD_BACKEND", "").strip().lower()
    if chosen and chosen not in ("gloo", "nccl"):
        raise ValueError(f"AUTOSHARD_BACKEND={chosen!r}: use 'gloo' (CPU) or 'nccl' (CUDA), or unset it")
    return chosen or ("nccl" if torch.cuda.is_available() else "gloo")


def uses_nccl() -> bool:
    """Whether the processes talk NCCL: the initialised process group's backend, else the one autoshard
    would start (``default_backend``)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return "nccl" in str(dist.get_backend())
    return default_backend() == "nccl"


def check_finite_enabled(option: bool | None) -> bool:
    """``check_finite=`` when given, else ``AUTOSHARD_CHECK_FINITE=1`` (off by default: it reads the loss
    back to the host each step, a synchronisation on a GPU)."""
    if option is not None:
        return bool(option)
    return os.environ.get("AUTOSHARD_CHECK_FINITE", "0").strip().lower() not in ("", "0", "false", "no")


def check_replicas_every() -> int:
    """``AUTOSHARD_CHECK_REPLICAS=N``: compare replicated parameters across ranks every N training steps."""
    return int(os.environ.get("AUTOSHARD_CHECK_REPLICAS", "0") or 0)


@dataclass(frozen=True)
class CostModel:
    """Machine constants the planner prices plans with. Defaults: one NVLink-class link, one GPU."""
    bandwidth: float = 100e9          # bytes/s a rank sends in a ring step
    latency: float = 10e-6            # s per collective launch
    flops: float = 100e12             # flop/s of one rank
    # Tensor parallelism exists to shard weights: a replicated weight matrix (ndim >= 2) also replicates
    # its gradient and optimizer state, for the whole run. Priced as if its bytes crossed the link this
    # many times per step -- in effect a hard constraint: a weight is replicated only when no exact
    # sharded strategy exists (and plan.md says so).
    replicated_weight_factor: float = 1e6
    # Making a tensor replicated by communication (all-gather of a shard, all-reduce of partial sums)
    # materialises a full-size copy on every rank that lives until backward. For the logits that is
    # b*s*V floats, the largest activation of a GPT. Priced per byte on top of the traffic: this is why
    # the loss stays vocab-parallel instead of gathering or all-reducing the logits. Every sub-layer's
    # residual needs one such replica in any plan, so the penalty does not distort the block layout.
    replicate_memory_factor: float = 1000.0
    # Pipeline stage balancing only: a pointwise op is priced by the bytes it moves, a matmul by its flops.
    memory_bandwidth: float = 2e12    # bytes/s of one rank's memory
    p2p_bandwidth: float = 25e9       # bytes/s of one boundary send between pipeline ranks
    p2p_latency: float = 20e-6        # s per boundary send
    op_overhead: float = 5e-6         # s per op on top of its flops or bytes (a kernel launch; Python on CPU)
    transcendental_rate: float = 1e12  # elements/s of exp/log/tanh-class ops (softmax, GeLU, the loss)
    # what splitting a backward into B and W (zero-bubble) adds to it beyond W's own action: W reads each
    # matmul's input and output gradient again, after other work evicted them from cache. Unmeasured on
    # GPUs (0); on a CPU core ZB-H1's B + W measured 6.14 + 1.87 ms against 1F1B's whole 7.63 on the same
    # 4-layer stages (benchmarks/results/zero_bubble.md), 0.38 ms more: one more action (action_overhead,
    # below) and 2.5% (an earlier runtime's 6.5 ms against 4.4 + 3.9 had read 25%)
    weight_split_overhead: float = 0.0
    # the pipeline runtime's own time: per compute action (F, B or W: a stage program's call, its autograd
    # and the executor's bookkeeping) and per boundary send that holds its rank. Unmeasured on GPUs (0: NCCL
    # sends run on their own stream). On the CI host ZB-V (24 more actions and 8 more sends a step than
    # ZB-H1 at pp=2, m=8) kept each rank busy 6 ms longer on the same layers, and a 64 KiB gloo send held
    # its rank 170-200 us inside a step (benchmarks/results/zero_bubble.md): (6 - 8 x 0.18) / 24 = 0.19 ms
    action_overhead: float = 0.0
    send_blocking: float = 0.0

    @staticmethod
    def cpu() -> "CostModel":
        """One CPU core per rank over gloo on one host (measured on the CI machine: a single-thread fp32
        matmul runs at about 180 GFLOP/s, a pointwise op at about 6 GB/s, and an op of a small model costs
        about 8 us of dispatch and autograd whatever its size; a log-softmax or a GeLU runs at about
        3e8 elements/s, far below the memory bandwidth). What the pipeline balancer
        prices with when no GPU is present and no cost model was given; the tp planner keeps the GPU
        constants (its plan does not depend on the machine, only on ratios that are the same)."""
        return CostModel(flops=100e9, memory_bandwidth=6e9, p2p_bandwidth=2e9, p2p_latency=100e-6,
                         op_overhead=8e-6, transcendental_rate=3e8, weight_split_overhead=0.025,
                         action_overhead=190e-6, send_blocking=180e-6)


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "auto")
CODEGENS = ("auto", "autoshard", "inductor")


def resolved_codegen(codegen: str) -> str:
    """What ``codegen="auto"`` runs: the path ``benchmarks.step`` and ``benchmarks.tp`` measured fastest
    (README, "Code generation"). Until a GPU has measured both, "autoshard" everywhere."""
    return "autoshard" if codegen == "auto" else codegen


def scatter_gather_pays(backend: str) -> bool:
    """Whether ``scatter_gather="auto"`` sends a tp-replicated pipeline boundary as t slices (Narayanan et
    al., SC'21, section 4.1; Megatron's default): on NCCL, by the backend alone. Where pp's transfers cross
    the slow links between nodes (one NIC a GPU) and tp stays on NVLink, a transfer then costs 1/t of the
    bytes on the slow link; inside one NVLink node it trades 1 - 1/t of a transfer for an all-gather on
    the same fabric, about even. Not on gloo: one host's ranks share one link, so the slices save nothing
    and the all-gather adds a collective. The planner prices a cluster's sends by the same rule
    (``Cluster.backend``)."""
    return backend == "nccl"


def scatter_gather_on(setting) -> bool:
    """Whether ``PipelineOptions.scatter_gather`` (True, False or "auto") slices the boundaries on this
    process's backend (``uses_nccl``): what the runtime runs and the stage balancer prices."""
    return setting is True or (setting == "auto" and scatter_gather_pays("nccl" if uses_nccl() else "gloo"))


@dataclass(frozen=True)
class BoundaryTransfer:
    """One tp rank's share of a pipeline boundary transfer, linear in the boundary's bytes."""
    seconds_a_byte: float
    latency: float

    def seconds(self, nbytes: float) -> float:
        return nbytes * self.seconds_a_byte + self.latency


def boundary_transfer(tp: int, sequence_parallel, sliced: bool, p2p_bandwidth: float, p2p_latency: float,
                      tp_bandwidth: float, tp_latency: float) -> BoundaryTransfer:
    """How one tp rank meets a pipeline boundary transfer, as the runtime makes it: whole on the p2p link
    by default; 1/t of it under SP (the boundary is a sequence shard); 1/t under Megatron's scatter/gather
    (``sliced``: ``runtime/scatter_gather.py``), which the receivers then all-gather over tp: (t - 1)/t of
    the bytes on the tp link and t - 1 ring steps. The one rule the stage balancer
    (``stage_prices.boundary_link``) and the planner (``planner.cost``) price sends by."""
    if tp == 1 or not (sequence_parallel or sliced):
        return BoundaryTransfer(1 / p2p_bandwidth, p2p_latency)
    seconds_a_byte, latency = 1 / (tp * p2p_bandwidth), p2p_latency
    if not sequence_parallel:
        seconds_a_byte += (tp - 1) / (tp * tp_bandwidth)
        latency += (tp - 1) * tp_latency
    return BoundaryTransfer(seconds_a_byte, latency)


@dataclass(frozen=True)
class PipelineOptions:
    """How ``pm.step`` runs a batch: ``microbatches`` (m), the schedule, ``virtual_stages`` (v, model
    chunks per pipeline rank: only the interleaved schedule takes v > 1, and runs 2 unless told more),
    optional ``cuts`` (the layer index each stage after the first starts at: ``pipeline_cuts``), and an
    optional ``memory_limit`` in bytes per rank that the stage balancer must respect."""
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    cuts: tuple | None = None
    memory_limit: float | None = None
    zero: int = 0                      # 1: pm.optimizer shards the optimizer state over dp (ZeRO-1)
    scatter_gather: bool | str = "auto"   # a tp-replicated boundary sent as 1/t a tp rank, gathered over tp
                                          # on receipt (Megatron's); "auto": where scatter_gather_pays
    # internal: the cut stretches of another program of this model (an eval program takes its training
    # program's, so both hold the same parameters on the same ranks); see StagePlan.stretches
    stretches: tuple | None = None

    def __post_init__(self):
        if not (type(self.scatter_gather) is bool or self.scatter_gather == "auto"):
            raise ValueError(f"scatter_gather={self.scatter_gather!r}: True (each tp rank sends 1/t of a boundary "
                             "every tp rank holds whole, and the receivers all-gather it over tp), False (each "
                             "sends all of it), or 'auto' (on NCCL)")
        if self.zero not in (0, 1):
            raise ValueError(f"zero={self.zero!r}: autoshard implements ZeRO stage 1 (zero=1) or none (zero=0)")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be an int >= 1, got {self.microbatches!r}")
        if self.memory_limit is not None and (isinstance(self.memory_limit, bool)
                                              or not isinstance(self.memory_limit, numbers.Real)
                                              or not 0 < self.memory_limit < math.inf):
            raise ValueError(f"memory_limit={self.memory_limit!r}: give the bytes a rank may hold, a positive "
                             "number (8 GiB: 8 * 2**30)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: choose one of {SCHEDULES}")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be an int >= 1, got {self.virtual_stages!r}")
        if self.schedule == "zb-v":      # two stages a rank, in a V: virtual_stages is 2 whether said or not
            if self.virtual_stages not in (1, 2):
                raise ValueError(f"schedule='zb-v' places two stages on each rank (a V), but virtual_stages="
                                 f"{self.virtual_stages}: leave it out or give 2")
            object.__setattr__(self, "virtual_stages", 2)
        elif self.schedule == "interleaved" and self.virtual_stages == 1:
            # one chunk a rank would be 1F1B: "interleaved" alone means Megatron's smallest interleaving
            object.__setattr__(self, "virtual_stages", 2)
        elif self.virtual_stages > 1 and self.schedule != "interleaved":
            what = ("chooses v itself (one stage a rank, or ZB-V's two)" if self.schedule == "auto"
                    else "runs one stage per rank")
            raise ValueError(f"virtual_stages={self.virtual_stages} needs schedule='interleaved' (Megatron's "
                             f"interleaved 1F1B); '{self.schedule}' {what}")
        if self.cuts is not None:
            object.__setattr__(self, "cuts", tuple(int(c) for c in self.cuts))


@dataclass
class CompileOptions:
    """What ``parallelize`` was asked for; the passes read this object, nothing copies it."""
    pins: dict = field(default_factory=dict)          # parameter name -> Placement on tp
    loss_only: bool = False                           # return None for non-scalar outputs
    cost_model: CostModel = field(default_factory=CostModel)
    disable: tuple = ()                               # pass names to skip (bisecting)
    dump: str | None = None                           # directory for pass dumps (or AUTOSHARD_DUMP)
    mixed_precision: str | None = None                # "bf16": fp32 parameters, bf16 compute
    pipeline: PipelineOptions | None = None           # set for pm.step programs (microbatches, stages)
    fuse: bool | str = "auto"                         # generated Triton kernels: True, False, "auto" (on CUDA)
    loss_chunk_rows: int | str | None = "auto"        # LM head + loss chunked over tokens: rows per chunk, or None
    recompute: bool | str = "auto"                    # each layer recomputed in backward; "auto": the model's flag
    recompute_stages: tuple | None = None             # the pipeline ranks whose layers recompute (None: all)
    loss_fn: object = None                            # loss_fn(model output, target): compiled in (torch pipelining's)
    codegen: str = "auto"                             # "autoshard" (eager ops + fuse's kernels), "inductor", "auto"
    cuda_graphs: bool = False                         # replay each program as CUDA graphs (codegen="inductor", CUDA)
    sequence_parallel: bool | str = False             # the replicated residual stream sharded along the sequence;
                                                      # "regather": column-parallel inputs kept as shards (Megatron's)
    check_finite: bool | None = None                  # raise on a NaN/inf loss or gradient norm (None: AUTOSHARD_CHECK_FINITE)

    def __post_init__(self):
        self.pins = dict(self.pins or {})
        self.disable = tuple(self.disable or ())
        if self.mixed_precision not in (None, "bf16"):
            raise ValueError(f"mixed_precision={self.mixed_precision!r}: the supported value is 'bf16' (fp32 "
                             "parameters and gradients, bf16 compute, fp32 loss reductions), or None")
        # the planner's names for them (Plan.recompute, plan.md): "full" is True, "none" False
        self.recompute = {"full": True, "none": False}.get(self.recompute, self.recompute) \
            if isinstance(self.recompute, str) else self.recompute
        # 1 == True: an int flag (argparse, YAML) would pass the check below and then fail every ``is True``
        if type(self.recompute) not in (bool, str) or self.recompute not in (True, False, "auto", "selective"):
            raise ValueError(f"recompute={self.recompute!r}: True or 'full' (every layer keeps only its input and "
                             "runs again in backward), 'selective' (each attention's core runs again), False or "
                             "'none', or 'auto' (as the model's is_gradient_checkpointing)")
        if self.recompute_stages is not None:
            stages = self.recompute_stages
            if isinstance(stages, int) or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0
                                                  for k in stages):
                raise ValueError(f"recompute_stages={stages!r}: give the pipeline ranks (0 first) whose layers "
                                 "recompute, as a tuple of ints, or None for every rank")
            if self.recompute is False:
                raise ValueError(f"recompute_stages={tuple(stages)} with recompute=False: say how those stages "
                                 "recompute (recompute=True or 'selective')")
            self.recompute_stages = tuple(sorted(set(stages)))
        if type(self.sequence_parallel) not in (bool, str) or self.sequence_parallel not in (True, False, "regather"):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r}: True (the residual stream sharded along "
                             "the sequence between tp regions, each column-parallel input kept gathered for its "
                             "weight gradient), 'regather' (kept as the sequence shard and gathered again in "
                             "backward, Megatron's: less memory, one more all-gather a matmul), or False")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ValueError(f"loss_fn={self.loss_fn!r} is not callable: give loss_fn(output, target) -> scalar, "
                             "as torch.distributed.pipelining's schedules take")
        if self.codegen not in CODEGENS:
            raise ValueError(f"codegen={self.codegen!r}: choose one of {CODEGENS} ('inductor' compiles each rank's "
                             "program with torch.compile; 'autoshard' runs it eagerly with autoshard's own kernels)")
        if (self.pipeline is not None and self.pipeline.schedule in SPLIT_SCHEDULES
                and resolved_codegen(self.codegen) == "inductor"):
            raise ValueError(f"schedule={self.pipeline.schedule!r} with codegen='inductor': a zero-bubble schedule "
                             "runs each stage's backward as two actions (B, then W), which a program torch.compile "
                             "made whole cannot do; use codegen='autoshard' or schedule='1f1b'")
        if self.cuda_graphs and resolved_codegen(self.codegen) != "inductor":
            raise ValueError(f"cuda_graphs=True with codegen={self.codegen!r}: CUDA graphs are captured by "
                             "torch.compile's 'reduce-overhead' mode, so pass codegen='inductor' with it")
        rows = self.loss_chunk_rows
        if not (rows is None or rows == "auto" or (isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0)):
            raise ValueError(f"loss_chunk_rows={rows!r}: rows per chunk of the LM head + loss are 'auto' (Liger's "
                             "rule with a floor), a positive int, or None / 0 (never chunk)")


# parallelize's keywords for the pipeline, and the PipelineOptions field each sets
PIPELINE_KEYWORDS = {"microbatches": "microbatches", "schedule": "schedule", "virtual_stages": "virtual_stages",
                     "pipeline_cuts": "cuts", "memory_limit": "memory_limit", "zero": "zero",
                     "scatter_gather": "scatter_gather"}


def option_keywords() -> list:
    """Every keyword ``parallelize`` (and ``compile_rank``, ``compile_pipeline``) takes for its options: the
    fields of ``CompileOptions`` but its internal ``pipeline``, and ``PIPELINE_KEYWORDS``."""
    return sorted({f.name for f in fields(CompileOptions)} - {"pipeline"} | set(PIPELINE_KEYWORDS))


def options_from_keywords(**keywords) -> CompileOptions:
    """The one ``CompileOptions`` the keywords describe (documented at ``parallelize``). The options are
    spelled once, here as dataclass fields: a keyword that is not one is a TypeError naming them all.
    ``None`` for ``cost_model``, ``pins`` or ``microbatches`` means the default."""
    unknown = sorted(set(keywords) - set(option_keywords()))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}: autoshard's options are "
                        f"{', '.join(option_keywords())}")
    pipeline = {PIPELINE_KEYWORDS[k]: keywords.pop(k) for k in list(keywords) if k in PIPELINE_KEYWORDS}
    if pipeline.get("microbatches") is None:
        pipeline["microbatches"] = 1
    return CompileOptions(**{k: v for k, v in keywords.items() if not (v is None and k in ("cost_model", "pins"))},
                          pipeline=PipelineOptions(**pipeline))      # checked together (a split schedule's codegen)

