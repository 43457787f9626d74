"""``memory_limit`` as a hard constraint: which memory-saving techniques a given mesh and batch need.

For a model, a mesh (dp, pp, tp) and a batch, the ways to hold less, in the order of the time they add
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022):

1. TP alone;
2. TP + sequence parallelism: the replicated LayerNorm, dropout and residual activations sharded over
   tp (``10 sbh`` becomes ``10 sbh / t``, less the two column-parallel inputs autoshard keeps gathered
   for dW: ``4 sbh (1 - 1/t)``), for the same bytes communicated;
2b. SP with those inputs kept as shards and gathered again in backward (``sequence_parallel="regather"``,
   Megatron's): the paper's ``(sbh/t)(34 + 5as/h)``, for one more all-gather a column-parallel matmul;
3. TP + SP + selective recompute: the attention cores run again in backward, so no ``5 a s / (h t)``
   term (nothing to drop where attention is flash: it keeps no s x s matrix anyway);
4. full recompute (with SP where tp > 1): each layer keeps only its input and runs again.

``choose`` prices every rung with the planner's cost model (``cost.predict``): the bytes come from its
``Memory`` (18 bytes a parameter; activations of the compute dtype, 4 bytes unless
``mixed_precision="bf16"``; as many in flight as the schedule holds), the time from a
cluster (a preset or ``Cluster.measure()``), which only ranks the rungs. The fastest rung that fits is
chosen; when none does, ``MemoryLimitError`` says how many bytes each rank misses and what to try. The
order is the prices', not the list's: with a pipeline, SP's boundary sends are 1/t of the bytes, so TP +
SP is faster than TP alone as well as smaller, and TP alone is never chosen there.

The most loaded stage decides the rung (1F1B's first stage holds p microbatches in flight, the last one
and the logits). SP shards the stage boundaries, so every stage runs it where chosen; recompute runs only
on the stages that would not fit without it (``recompute_stages``, which the recompute passes read), so
the stages that hold fewer microbatches do not pay its time. One recompute kind for the model: a stage
that needs full recompute makes the chosen kind full.

``memory_options`` is what ``parallelize(..., memory_limit=...)`` runs: it reads the model's sizes and
the batch, chooses, and sets ``recompute`` and ``sequence_parallel`` (or, where the user set them,
checks that they fit).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from autoshard.planner.cluster import DGX_A100, DGX_H100, Cluster, cluster_named
from autoshard.planner.config_reading import model_shape
from autoshard.planner.cost import Candidate, Memory, predict, stage_memory
from autoshard.planner.search import size
from autoshard.planner.shape import ModelShape

log = logging.getLogger("autoshard")
RECOMPUTE_OPTION = {"none": False, "selective": "selective", "full": True}   # parallelize's recompute= values


@dataclass(frozen=True)
class Rung:
    """One way to train on the mesh, priced: its recompute and SP, the most loaded rank's ``Memory``, the
    total bytes of each pipeline stage, and the predicted step (to rank the rungs, not to promise)."""
    recompute: str            # "none", "selective" or "full"
    sp: bool | str            # "regather": the column-parallel inputs kept as shards
    tp: int
    memory: Memory
    stage_bytes: tuple        # total bytes per pipeline rank, rank 0 first
    step_seconds: float

    @property
    def bytes(self) -> float:
        return self.memory.total

    @property
    def name(self) -> str:
        sp = "TP + SP (regathered)" if self.sp == "regather" else "TP + SP"
        if self.recompute == "none":
            return sp if self.sp else ("TP alone" if self.tp > 1 else "no recompute")
        return f"{sp + ' + ' if self.sp else ''}{self.recompute} recompute"

    def options(self) -> dict:
        """The keywords of ``parallelize`` this rung sets."""
        return {"recompute": RECOMPUTE_OPTION[self.recompute], "sequence_parallel": self.sp}


@dataclass(frozen=True)
class Rejection:
    """A faster rung that was not chosen: the bytes it needs per rank against the limit."""
    rung: Rung
    limit: float

    @property
    def missing(self) -> float:
        return self.rung.bytes - self.limit

    def reason(self) -> str:
        return (f"{self.rung.name} needs {size(self.rung.bytes)} per rank, {size(self.missing)} "
                f"({self.missing:.0f} bytes) more than memory_limit={size(self.limit)}")


@dataclass(frozen=True)
class MemoryChoice:
    """What ``memory_limit`` chose for one model, mesh and batch, and why."""
    model: str
    dp: int
    pp: int
    tp: int
    b: int                    # rows a microbatch
    m: int                    # microbatches a step
    v: int
    zero: int
    limit: float              # bytes per rank
    cluster: str              # whose times ranked the rungs
    rungs: tuple              # every rung priced, fastest first
    chosen: Rung
    fixed: tuple = ()         # the settings the user gave ("recompute", "sequence_parallel"): only checked
    recompute_stages: tuple | None = None   # the stages that recompute (None: every stage, or no recompute)

    @property
    def rejected(self) -> tuple:
        """The rungs faster than the chosen one, each with the bytes that ruled it out."""
        faster = self.rungs[:self.rungs.index(self.chosen)]
        return tuple(Rejection(r, self.limit) for r in faster)

    def options(self) -> dict:
        out = self.chosen.options()
        if self.recompute_stages is not None:
            out["recompute_stages"] = self.recompute_stages
        return out

    def per_stage(self) -> tuple:
        """For each pipeline stage, the fastest rung that stage alone would fit with (None: none), the
        stage's own microbatches in flight counted. Advisory: one recompute kind and one SP setting run
        on every stage that recomputes (``recompute_stages``)."""
        return tuple(next((r for r in self.rungs if r.stage_bytes[k] <= self.limit), None) for k in range(self.pp))

    def summary(self) -> str:
        """One line for the log: the choice, its bytes, and what the next faster rung would need."""
        head = (f"memory_limit={size(self.limit)} per rank: {self.chosen.name} "
                f"({size(self.chosen.bytes)} on the most loaded rank; recompute={self.options()['recompute']!r}, "
                f"sequence_parallel={self.chosen.sp})")
        if self.recompute_stages is not None:
            head += (f", only on stage(s) {', '.join(map(str, self.recompute_stages))}: the others fit without "
                     "recomputing")
        if self.fixed:
            return head + f": as given ({', '.join(self.fixed)}), it fits"
        if self.rejected:
            return head + f"; {self.rejected[-1].reason()}"
        return head + "; nothing more is needed"

    def lines(self) -> list:
        """``plan.md``'s "Memory limit" section."""
        out = ["## Memory limit", "",
               f"`memory_limit` = {self.limit:.0f} bytes ({size(self.limit)}) per rank for {self.model} on "
               f"dp={self.dp} pp={self.pp} tp={self.tp}, microbatches of {self.b} rows, m={self.m}, v={self.v}"
               f"{', ZeRO-1' if self.zero else ''}. Bytes are the planner's cost model's (bf16 activations, "
               f"18 bytes a parameter); the times ({self.cluster}) only rank the rungs. The most loaded stage "
               "decides the rung; its recompute runs only on the stages that need it.", "",
               "| rung | recompute | SP | bytes (most loaded rank) | bytes per stage | predicted step s | verdict |",
               "|---|---|---|---|---|---|---|"]
        for r in self.rungs:
            if r is self.chosen:
                verdict = "**chosen**" + (" (as given)" if self.fixed else "")
            elif r.bytes > self.limit:
                verdict = f"{size(r.bytes - self.limit)} over"
            else:
                verdict = "fits, slower"
            stages = ", ".join(size(b) for b in r.stage_bytes)
            out.append(f"| {r.name} | {r.recompute} | {'yes' if r.sp else 'no'} | {r.bytes:.0f} ({size(r.bytes)}) | "
                       f"{stages} | {r.step_seconds:.3g} | {verdict} |")
        if self.pp > 1:
            alone = "; ".join(f"stage {k}: {r.name if r else 'none fits'}" for k, r in enumerate(self.per_stage()))
            out += ["", f"Each stage alone (its own microbatches in flight): {alone}."]
            if self.recompute_stages is not None:
                none = next(r for r in self.rungs if r.recompute == "none" and r.sp == self.chosen.sp)
                per = "; ".join(f"stage {k}: {self.chosen.recompute} recompute" if k in self.recompute_stages else
                                f"stage {k}: none ({size(none.stage_bytes[k])} fits)" for k in range(self.pp))
                out += ["", f"Applied per stage (one recompute kind, only where a stage needs it; SP, where "
                            f"chosen, runs on every stage since it shards their boundaries): {per}."]
        return out + [""]


class MemoryLimitError(ValueError):
    """No rung fits: ``missing`` bytes per rank over ``limit`` for the smallest (``needed``)."""

    def __init__(self, message: str, needed: float, limit: float):
        super().__init__(message)
        self.needed, self.limit = needed, limit
        self.missing = needed - limit


def rungs_for(tp: int, seq: int, recompute: str | None = None, sp: bool | None = None) -> list:
    """(recompute, sp) of each rung, in ladder order; a setting given (not None) holds on every rung. SP
    needs tp > 1 and a sequence that tp divides."""
    sp_ok = tp > 1 and seq % tp == 0
    if sp and not sp_ok:
        raise ValueError(f"sequence_parallel=True shards the sequence over tp, but tp={tp} and the sequence is "
                         f"{seq} long: use tp > 1 dividing the sequence, or leave sequence_parallel out")
    if sp is None and recompute is None:
        if not sp_ok:
            return [("none", False), ("selective", False), ("full", False)]
        return [("none", False), ("none", True), ("none", "regather"), ("selective", True),
                ("selective", "regather"), ("full", True)]
    if recompute is None:
        return [(r, sp) for r in ("none", "selective", "full")]
    if sp is None:
        if not sp_ok:
            return [(recompute, False)]
        regather = [] if recompute == "full" else [(recompute, "regather")]   # full keeps only layer inputs
        return [(recompute, False), (recompute, True)] + regather
    return [(recompute, sp)]


def choose(shape: ModelShape, limit: float, *, dp: int = 1, pp: int = 1, tp: int = 1, b: int = 1, m: int = 1,
           v: int = 1, zero: int = 0, cluster="dgx-a100", flash: bool = True, recompute: str | None = None,
           sp: bool | None = None, schedule: str = "1f1b", activation_bytes: int = 2) -> MemoryChoice:
    """The fastest rung of the ladder whose most loaded rank fits in ``limit`` bytes (see the module
    docstring). ``recompute`` ("none", "selective", "full") or ``sp`` given: only rungs with that setting
    (both given: only a check). ``schedule`` sets the microbatches in flight (GPipe holds all m), and
    ``activation_bytes`` the bytes of an activation element (2 for bf16 compute, 4 for fp32). Raises
    ``MemoryLimitError`` naming the bytes missing when none fits."""
    if not limit > 0:
        raise ValueError(f"memory_limit={limit!r}: give the bytes a rank may hold, a positive number")
    cluster = cluster_named(cluster)
    fixed = tuple(k for k, given in (("recompute", recompute), ("sequence_parallel", sp)) if given is not None)
    priced = []
    for r, s in rungs_for(tp, shape.seq, recompute, sp):
        c = Candidate(dp, pp, tp, b, m, v, r, zero, s)
        q = predict(shape, cluster, c, flash)
        per_stage = [stage_memory(shape, c, rank, flash, schedule, activation_bytes) for rank in range(pp)]
        most = max(per_stage, key=lambda mem: mem.total)
        priced.append(Rung(r, s, tp, most, tuple(mem.total for mem in per_stage), q.step_seconds))
    ladder = tuple(sorted(priced, key=lambda r: r.step_seconds))     # stable: ties keep the ladder's order
    chosen = next((r for r in ladder if r.bytes <= limit), None)
    if chosen is None:
        smallest = min(ladder, key=lambda r: r.bytes)
        raise MemoryLimitError(_nothing_fits(shape, limit, smallest, dp, pp, tp, b, m, v, zero, fixed, cluster,
                                             flash, schedule, activation_bytes), smallest.bytes, limit)
    return MemoryChoice(shape.name, dp, pp, tp, b, m, v, zero, float(limit), cluster.name, ladder, chosen, fixed,
                        _stages_that_recompute(ladder, chosen, limit, pp, fixed))


def _stages_that_recompute(ladder, chosen: Rung, limit: float, pp: int, fixed: tuple) -> tuple | None:
    """The stages that must run the chosen recompute: those that would not fit without it (with the same
    SP). 1F1B's first stages hold the most microbatches in flight; the last ones often fit as they are,
    and skip the recompute's time. None: every stage (or nothing to narrow: no recompute, one stage, or a
    recompute the user gave)."""
    if chosen.recompute == "none" or pp == 1 or "recompute" in fixed:
        return None
    none = next((r for r in ladder if r.recompute == "none" and r.sp == chosen.sp), None)
    if none is None:
        return None
    stages = tuple(k for k in range(pp) if none.stage_bytes[k] > limit)
    return None if len(stages) == pp else stages


def _nothing_fits(shape, limit, smallest: Rung, dp, pp, tp, b, m, v, zero, fixed, cluster, flash, schedule,
                  activation_bytes) -> str:
    """The error when no rung fits: the bytes missing, where they go, and what would make room."""
    mem, missing = smallest.memory, smallest.bytes - limit
    states = mem.parameters + mem.gradients + mem.optimizer
    given = ", ".join(f"{k}={smallest.options()[k]!r}" for k in fixed)
    what = f"{smallest.name} ({given}, as given)" if fixed else f"the smallest, {smallest.name},"
    msg = (f"memory_limit={limit:.0f} bytes ({size(limit)}) per rank: {shape.name} on dp={dp} pp={pp} tp={tp} "
           f"with microbatches of {b} rows does not fit: {what} needs {smallest.bytes:.0f} bytes ({size(smallest.bytes)}) "
           f"on the most loaded rank, {missing:.0f} bytes ({size(missing)}) missing per rank (parameters, gradients "
           f"and optimizer state {size(states)}, activations {size(mem.activations)}). ")
    if fixed:
        try:
            free = choose(shape, limit, dp=dp, pp=pp, tp=tp, b=b, m=m, v=v, zero=zero, cluster=cluster, flash=flash,
                          schedule=schedule, activation_bytes=activation_bytes)
            return msg + (f"Leave {' and '.join(fixed)} out and memory_limit chooses {free.chosen.name} "
                          f"({size(free.chosen.bytes)}), which fits.")
        except MemoryLimitError:
            msg += f"Leaving {' and '.join(fixed)} out would not fit either. "
    tries = ["more GPUs (a larger tp or pp shards the parameters and the activations further)"]
    if b > 1:
        tries.append(f"a smaller microbatch (microbatches={2 * m}: {b // 2} rows each, about half the activations)")
    if dp > 1 and not zero:
        tries.append(f"zero=1 (the optimizer's {size(mem.optimizer)} divided over dp={dp})")
    if v > 1:
        tries.append("fewer virtual stages (the interleaved schedule holds more microbatches in flight)")
    if states > limit:
        tries.insert(0, f"more tp or pp first: the parameters, gradients and optimizer state alone need {size(states)}")
    return msg + "Try " + "; or ".join(tries) + "; or raise memory_limit."


# --- what parallelize runs -------------------------------------------------------------------------------

def default_cluster() -> Cluster:
    """The preset whose times rank the rungs when no cluster is given: DGX H100 on an H100 or H200, DGX
    A100 elsewhere (a CPU too: the rungs' order barely depends on the machine, and their bytes not at
    all)."""
    if torch.cuda.is_available() and any(k in torch.cuda.get_device_name() for k in ("H100", "H200")):
        return DGX_H100
    return DGX_A100


def attention_is_flash(model) -> bool:
    """Whether the model's attention keeps no s x s matrix: the built-in GPT's ``flash`` (SDPA), an HF
    model's ``_attn_implementation`` other than "eager"; unknown models are taken as flash."""
    config = getattr(model, "config", None)
    flash = getattr(config, "flash", None)
    if isinstance(flash, bool):
        return flash
    impl = getattr(config, "_attn_implementation", None)
    return impl != "eager" if isinstance(impl, str) else True


def batch_rows_and_seq(args, kwargs) -> tuple | None:
    """(rows, sequence length) of a call's batch: its first 2-D integer tensor (token ids), else its first
    tensor of two or more dims; None when it has neither."""
    leaves = [x for x in torch.utils._pytree.tree_leaves((tuple(args), dict(kwargs or {})))
              if isinstance(x, torch.Tensor) and x.dim() >= 2]
    ids = [x for x in leaves if x.dim() == 2 and not x.is_floating_point()]
    pick = (ids or leaves or [None])[0]
    return None if pick is None else (int(pick.shape[0]), int(pick.shape[1]))


def memory_options(model, spec, args, kwargs, options, fixed=frozenset(), cluster=None) -> tuple:
    """``(options, MemoryChoice or None)``: ``options`` (a ``CompileOptions``) with ``recompute`` and
    ``sequence_parallel`` set by the ladder for ``options.pipeline.memory_limit``. Settings named in
    ``fixed`` are the user's: kept, and only checked. Without a limit, or for a model whose sizes the
    planner cannot read (not the built-in GPT or an HF transformer), the options come back unchanged and
    the limit bounds only the pipeline stage balancer (``passes/pipeline_split.py``)."""
    popts = options.pipeline
    limit = popts.memory_limit if popts is not None else None
    if limit is None:
        return options, None
    batch = batch_rows_and_seq(args, kwargs)
    try:
        shape = model_shape(model, batch[1] if batch else None)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        log.warning("autoshard: memory_limit bounds only the pipeline stages: the planner cannot read %s's sizes "
                    "(%s), so it cannot choose recompute or sequence_parallel; set them yourself",
                    type(model).__name__, e)
        return options, None
    rows = batch[0] if batch else 1
    m = popts.microbatches
    recompute = {True: "full", False: "none", "selective": "selective"}.get(options.recompute, "none")
    choice = choose(shape, limit, dp=spec.dp, pp=spec.pp, tp=spec.tp, b=max(1, rows // m), m=m,
                    v=popts.virtual_stages, zero=popts.zero, cluster=cluster or default_cluster(),
                    flash=attention_is_flash(model), recompute=recompute if "recompute" in fixed else None,
                    sp=options.sequence_parallel if "sequence_parallel" in fixed else None,
                    schedule=popts.schedule, activation_bytes=2 if options.mixed_precision == "bf16" else 4)
    return dataclasses.replace(options, **choice.options()), choice
