"""``plan``: every configuration of N GPUs for a model and a global batch, priced and ranked.

The search is exhaustive over what is legal: t divides the heads (and the kv heads, or is a multiple of
them), p at most the layers, d = N / (t p) dividing the global batch, b a power of two, m = B / (d b),
v chunks per rank when each still holds a layer (and m a multiple of p, as Megatron's interleaved
schedule needs), recompute none, selective (attention cores) or full (layers), ZeRO-1 or not, and at
v = 1 with a pipeline 1F1B or ZB-H1 (its weight gradients in the bubbles; not under full recompute,
nor where ranks share cores). Each is priced by ``cost.predict`` in
microseconds, so thousands of GPUs plan in seconds. A configuration that does not fit in memory is
kept aside with the bytes it misses; the ranking says why each runner-up lost to the winner (the cost it
pays most over it), and why each faster configuration was not chosen (memory).
"""
from __future__ import annotations

import logging
import numbers
import operator
import time
from dataclasses import dataclass, field

from autoshard.planner.cluster import Cluster, cluster_named
from autoshard.planner.config_reading import model_shape
from autoshard.planner.cost import Candidate, Prediction, predict
from autoshard.planner.runtimes import AUTOSHARD, Runtime, runtime_named
from autoshard.planner.shape import ModelShape

GiB = 2**30
log = logging.getLogger("autoshard")


def size(nbytes: float) -> str:
    """Bytes for a person: GiB, MiB or KiB, whichever reads best."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


@dataclass(frozen=True)
class Plan:
    """A configuration with its prediction: what ``parallelize(..., plan=p)`` and ``init_mesh(plan=p)``
    train with. ``why`` says why it ranks where it does (for the winner: what bounds it)."""
    dp: int
    pp: int
    tp: int
    b: int
    m: int
    v: int
    schedule: str
    recompute: str
    zero: int
    sp: bool | str            # "regather": the column-parallel inputs kept as sequence shards
    prediction: Prediction
    fits: bool
    why: str = ""
    seq: int = 0                      # the sequence length it was priced for (0: not recorded)
    mixed_precision: str | None = "bf16"   # the compute dtype it was priced at (None: fp32)
    runtime: str = "autoshard"        # the runtime it was priced for (``planner.runtimes``)

    @property
    def step_seconds(self) -> float:
        return self.prediction.step_seconds

    @property
    def tflops_per_gpu(self) -> float:
        return self.prediction.tflops_per_gpu

    @property
    def memory_bytes(self) -> float:
        return self.prediction.memory.total

    @property
    def mesh(self) -> dict:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}

    def parallelize_options(self) -> dict:
        """The keywords of ``parallelize`` this plan sets."""
        out = {"recompute": {"none": False, "full": True, "selective": "selective"}[self.recompute]}
        if self.pp > 1 or self.m > 1:
            out.update(microbatches=self.m, schedule=self.schedule)
            if self.v > 1:
                out["virtual_stages"] = self.v
        if self.zero:
            out["zero"] = self.zero
        if self.sp:
            out["sequence_parallel"] = self.sp
        if self.mixed_precision:      # priced at the cluster's bf16 rate and bf16 activations
            out["mixed_precision"] = self.mixed_precision
        return out

    def label(self) -> str:
        sp = " sp=regather" if self.sp == "regather" else " sp" if self.sp else ""
        return (f"dp={self.dp} pp={self.pp} tp={self.tp} b={self.b} m={self.m} v={self.v} "
                f"recompute={self.recompute} zero={self.zero}" + sp + (" zb-h1" if self.schedule == "zb-h1" else ""))


@dataclass
class Plans:
    """The ranked plans that fit (``ranked[0]`` is the winner) and the faster ones that do not."""
    shape: ModelShape
    cluster: Cluster
    gpus: int
    global_batch: int
    ranked: list
    too_big: list              # faster than the winner, out of memory (the fastest first)
    considered: int
    seconds: float
    priced: list = field(default_factory=list)   # every configuration, as a Plan (its ``why`` empty)
    memory_limit: float | None = None            # bytes per GPU asked for (plan(memory_limit=...)), if any
    runtime: Runtime = AUTOSHARD                 # the runtime every plan was priced for
    # every GPU given is used; where a count of whole nodes below it plans a faster step (100 GPUs allow
    # only meshes of 4 x 25), that count and its winner
    fewer: "Fewer | None" = None

    @property
    def limit(self) -> float:
        """Bytes a plan may hold per GPU: the cluster's usable memory, or ``memory_limit`` below it."""
        return usable_bytes(self.cluster, self.memory_limit)

    @property
    def best(self) -> Plan:
        if not self.ranked:
            small = min(self.priced, key=lambda p: p.memory_bytes, default=None)
            need = (f"the smallest, {small.label()}, needs {size(small.memory_bytes)}, "
                    f"{size(small.memory_bytes - self.limit)} more" if small is not None else "none was priced")
            raise ValueError(f"no configuration of {self.gpus} GPUs fits {self.shape.name} in "
                             f"{size(self.limit)} per GPU: {need}; use more GPUs, a smaller global batch or "
                             "sequence, or a cluster with more memory")
        return self.ranked[0]

    def __iter__(self):
        return iter(self.ranked)

    def __len__(self):
        return len(self.ranked)

    def __getitem__(self, i):
        return self.ranked[i]


@dataclass(frozen=True)
class Fewer:
    """A smaller GPU count (whole nodes) that is predicted to step faster than the count asked for."""
    gpus: int
    step_seconds: float
    label: str

    def says(self, gpus: int, step_seconds: float) -> str:
        return (f"{self.gpus} GPUs (whole nodes) would step in {self.step_seconds:.4g} s against {step_seconds:.4g} s on "
                f"{gpus}: a plan uses every GPU it is given, and {gpus} splits into few meshes ({self.label})")


def usable_bytes(cluster: Cluster, memory_limit: float | None = None) -> float:
    """What a plan may hold per GPU: the cluster's usable memory (``hbm_bytes x usable_memory``), or
    ``memory_limit`` where that is lower (a limit above what the GPU holds cannot raise it)."""
    usable = cluster.hbm_bytes * cluster.usable_memory
    return usable if memory_limit is None else min(usable, float(memory_limit))


def _divisors(n: int) -> list:
    return [k for k in range(1, n + 1) if n % k == 0]


def _powers_of_two(limit: int) -> list:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def candidates(shape: ModelShape, gpus: int, global_batch: int, max_b: int = 16, max_v: int = 8,
               max_tp: int | None = None, zero_bubble: bool = True) -> list:
    """Every legal configuration (see the module docstring). ``zero_bubble``: offer ZB-H1 beside 1F1B."""
    out = []
    for t in _tp_sizes(shape, gpus, max_tp):
        for p in _divisors(gpus // t):
            if p > shape.layers:
                continue
            d = gpus // (t * p)
            if global_batch % d:
                continue
            for b in _powers_of_two(min(max_b, global_batch // d)):
                if (global_batch // d) % b:
                    continue
                m = global_batch // (d * b)
                if p > 1 and m < p:     # fewer microbatches than stages: most of the pipeline idles
                    continue
                for v in (1, 2, 3, 4, 6, 8):
                    if v > max_v or (v > 1 and (p == 1 or shape.layers < p * v or m % p)):
                        continue
                    for recompute in ("none", "selective", "full"):
                        for zero in ((0, 1) if d > 1 else (0,)):
                            for sp in _sequence_parallel(t, shape.seq, recompute):
                                # not under full recompute: W would hold the recomputed layer, which
                                # ZB-H1's 1F1B memory cap leaves no room to defer
                                zbs = zero_bubble and p > 1 and v == 1 and recompute != "full"
                                for zb in ((False, True) if zbs else (False,)):
                                    out.append(Candidate(d, p, t, b, m, v, recompute, zero, sp, zb))
    return out


def _tp_sizes(shape: ModelShape, gpus: int, max_tp: int | None) -> list:
    """The tp sizes ``candidates`` may use: dividing the GPUs, the hidden size and the heads (and the kv
    heads, or a multiple of them)."""
    return [t for t in _divisors(gpus) if (max_tp is None or t <= max_tp) and not shape.hidden % t
            and not (shape.attention and (shape.heads % t or (shape.kv_heads % t and t % shape.kv_heads)))]


def _meshes(shape: ModelShape, gpus: int, global_batch: int, max_tp: int | None) -> list:
    """(t, p, d) of ``gpus`` with at least one configuration: p at most the layers, d dividing the batch,
    and a pipeline given at least p microbatches (b = 1 gives the most)."""
    return [(t, p, gpus // (t * p)) for t in _tp_sizes(shape, gpus, max_tp) for p in _divisors(gpus // t)
            if p <= shape.layers and not global_batch % (gpus // (t * p))
            and (p == 1 or global_batch // (gpus // (t * p)) >= p)]


def no_configuration(shape: ModelShape, gpus: int, global_batch: int, max_tp: int | None = None) -> str:
    """Why no configuration of ``gpus`` GPUs is legal, by the first rule that leaves none, and the nearest
    GPU counts and batches that have one."""
    head = f"no legal configuration of {gpus} GPUs for {shape.name} and a global batch of {global_batch}: "
    ts = _tp_sizes(shape, gpus, max_tp)
    if not ts:
        why = (f"no tp size divides the {gpus} GPUs, the hidden size {shape.hidden} and the {shape.heads} heads "
               f"({shape.kv_heads} kv heads)" + (f" at most max_tp={max_tp}" if max_tp is not None else ""))
    else:
        shapes = [(t, p) for t in ts for p in _divisors(gpus // t) if p <= shape.layers]
        if not shapes:
            why = (f"every split of the GPUs over tp sizes {ts} needs more pipeline stages than the "
                   f"{shape.layers} layers")
        elif not any(not global_batch % (gpus // (t * p)) for t, p in shapes):
            ds = sorted({gpus // (t * p) for t, p in shapes})
            why = f"the batch divides over none of the dp sizes the GPUs allow ({', '.join(map(str, ds[:8]))})"
        else:
            why = ("each split whose dp size divides the batch is a pipeline with fewer microbatches than "
                   "stages (a pipeline of p stages needs at least p)")
    near = sorted({n for n in range(max(1, gpus - 16), gpus + 17)
                   if n != gpus and _meshes(shape, n, global_batch, max_tp)}, key=lambda n: (abs(n - gpus), n))[:3]
    batches = [b for b in sorted(range(max(1, global_batch // 2), 2 * global_batch + 65),
                                 key=lambda b: (abs(b - global_batch), b))
               if b != global_batch and _meshes(shape, gpus, b, max_tp)][:1]
    fixes = ([f"{', '.join(map(str, sorted(near)))} GPUs"] if near else []) + \
            ([f"a global batch of {batches[0]}"] if batches else [])
    return head + why + (f"; these would plan: {' or '.join(fixes)}" if fixes else "")


def _sequence_parallel(t: int, seq: int, recompute: str) -> tuple:
    """The ``sequence_parallel`` settings to price with ``recompute``: the memory ladder's
    (``memory_ladder.rungs_for``): none without a sequence to shard; SP kept gathered, and regathered
    (one more all-gather of each column-parallel input in backward for 4 sbh (1 - 1/t) fewer 16-bit
    bytes a layer), except under full recompute, which keeps only the layer inputs."""
    from autoshard.planner.memory_ladder import rungs_for      # it imports this module
    return tuple(sp for _, sp in rungs_for(t, seq, recompute))


def _positive(name: str, value) -> int:
    """``value`` as an int (numpy's too), or a ValueError naming the argument."""
    try:
        whole = operator.index(value)
    except TypeError:
        whole = None
    if isinstance(value, bool) or whole is None or whole < 1:
        raise ValueError(f"{name}={value!r}: give a positive whole number")
    return whole


def plan(model, gpus: int, cluster="dgx-a100", global_batch: int = 512, seq: int | None = None,
         flash: bool = True, top: int = 10, max_tp: int | None = None, progress=None,
         memory_limit: float | None = None, runtime: Runtime | str = AUTOSHARD) -> Plans:
    """The configurations of ``gpus`` GPUs of ``cluster`` training ``model`` on ``global_batch``
    sequences a step, fastest first. ``model`` is a ``ModelShape``, the built-in GPT (config or model),
    an HF config (object, dict or ``config.json`` path) or model; ``seq`` overrides its context length.
    ``flash``: attention keeps no s x s matrix (FlashAttention / SDPA). ``memory_limit``: bytes per GPU a
    plan may hold, a hard constraint where it is below the cluster's usable memory (which it replaces);
    SP and selective or full recompute are among the candidates, so the fastest that fits uses them only
    as far as the limit needs. ``progress(done, total)`` is called while pricing. ``runtime``: the program
    that will run the plan, autoshard's unless the plan is for another (a ``planner.Runtime``, or a
    name of ``planner.runtimes.RUNTIMES``)."""
    start = time.perf_counter()
    gpus, global_batch, top = (_positive(n, v) for n, v in (("gpus", gpus), ("global_batch", global_batch), ("top", top)))
    if max_tp is not None:
        max_tp = _positive("max_tp", max_tp)
    if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, numbers.Real)
                                     or not memory_limit > 0):
        raise ValueError(f"memory_limit={memory_limit!r}: give the bytes a GPU may hold, a positive number")
    shape = model_shape(model, seq)
    if shape.layers < 1:
        raise ValueError(f"ModelShape {shape.name!r}: layers={shape.layers}; give a positive whole number")
    cluster = cluster_named(cluster)
    if gpus > 1 and not cluster.links_measured:
        log.warning("autoshard: cluster %r was measured in one process, so no collective was timed: its links are "
                    "placeholders and every communication cost of a %d-GPU plan is a guess; run Cluster.measure() "
                    "in a process group of the node's ranks (torchrun --nproc-per-node ...)", cluster.name, gpus)
    runtime = runtime_named(runtime)
    # ZB-H1 fills the bubble with W, which buys nothing where ranks share cores: a rank idle in the bubble
    # already lends its core (``cost._shared_cores``). Measured on this 2-core host, pp=4 m=4: ZB-H1 68.3
    # ms, 1F1B 68.2; priced alike, the planner had predicted ZB-H1 13% faster
    pool = candidates(shape, gpus, global_batch, max_tp=max_tp, zero_bubble=cluster.oversubscription <= 1)
    if not pool:
        raise ValueError(no_configuration(shape, gpus, global_batch, max_tp))
    limit = usable_bytes(cluster, memory_limit)
    fits, big = [], []
    for i, c in enumerate(pool):
        pred = predict(shape, cluster, c, flash, runtime)
        (fits if pred.memory.total <= limit else big).append(pred)
        if progress is not None and (i + 1) % 2000 == 0:
            progress(i + 1, len(pool))
    fits.sort(key=lambda q: q.step_seconds)
    big.sort(key=lambda q: q.step_seconds)
    ranked = []
    winner = fits[0] if fits else None
    made = _PlanMaker(shape.seq, "bf16" if cluster.compute_dtype == "bf16" else None, runtime.name)
    for q in _distinct(fits)[:top]:
        ranked.append(made(q, True, _why(q, winner, limit) if q is not winner else _bound(q)))
    # the faster configurations that do not fit; where none fits at all, the nearest misses instead
    faster = ([q for q in big if q.step_seconds < winner.step_seconds] if winner is not None
              else sorted(big, key=lambda q: q.memory.total))
    too_big = [made(q, False, f"needs {size(q.memory.total)} per GPU, {size(q.memory.total - limit)} more than "
                              f"the {size(limit)} {_limit_word(cluster, limit)}")
               for q in _distinct(faster)[:top]]
    priced = [made(q, True, "") for q in fits] + [made(q, False, "") for q in big]
    fewer = _fewer(shape, gpus, cluster, global_batch, flash, max_tp, memory_limit, runtime, winner)
    return Plans(shape, cluster, gpus, global_batch, ranked, too_big, len(pool), time.perf_counter() - start, priced,
                 memory_limit, runtime, fewer)


def _fewer(shape, gpus, cluster, global_batch, flash, max_tp, memory_limit, runtime, winner) -> Fewer | None:
    """The whole nodes below ``gpus``, planned, where ``gpus`` is not whole nodes and they step faster."""
    whole = gpus - gpus % cluster.gpus_per_node
    if winner is None or whole in (0, gpus):
        return None
    try:
        other = plan(shape, whole, cluster, global_batch, flash=flash, top=1, max_tp=max_tp,
                     memory_limit=memory_limit, runtime=runtime)
    except ValueError:          # no legal configuration of that count
        return None
    if not other.ranked or other.best.step_seconds >= winner.step_seconds:
        return None
    return Fewer(whole, other.best.step_seconds, other.best.label())


def _limit_word(cluster: Cluster, limit: float) -> str:
    return "allowed (memory_limit)" if limit < usable_bytes(cluster) else "usable"


@dataclass(frozen=True)
class _PlanMaker:
    """``Plan`` records of one ``plan()`` call: what each was priced for besides its configuration."""
    seq: int
    mixed_precision: str | None
    runtime: str

    def __call__(self, q: Prediction, fits: bool, why: str) -> Plan:
        c = q.candidate
        return Plan(c.dp, c.pp, c.tp, c.b, c.m, c.v, c.schedule, c.recompute, c.zero, c.sp, q, fits, why,
                    self.seq, self.mixed_precision, self.runtime)


def check_plan(plan) -> Plan:
    """``plan`` as ``parallelize(plan=)`` and ``init_mesh(plan=)`` take it: one ``Plan``, else a TypeError
    that says which to pass."""
    if isinstance(plan, Plans):
        raise TypeError("plan= takes one Plan, and this is the ranked Plans of autoshard.plan(...): pass "
                        "plans.best (the winner) or one of plans.ranked")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan= takes a Plan of autoshard.plan(...), not {type(plan).__name__}: pass "
                        "autoshard.plan(model, gpus, ...).best")
    return plan


def _bound(q: Prediction) -> str:
    """What the winner's time goes to beyond compute."""
    parts = sorted(((s, name) for name, s in q.breakdown.items() if name != "compute"), reverse=True)
    total = q.step_seconds
    top = ", ".join(f"{name} {s / total:.0%}" for s, name in parts[:3] if s > 0)
    return f"compute {q.breakdown.compute / total:.0%} of the step" + (f"; then {top}" if top else "")


def _why(q: Prediction, winner: Prediction, limit: float) -> str:
    """Why ``q`` lost to ``winner``: the cost it pays most over it."""
    mine, theirs = dict(q.breakdown.items()), dict(winner.breakdown.items())
    name = max(mine, key=lambda k: mine[k] - theirs[k])
    extra = (mine[name] - theirs[name]) * 1e3
    return f"{(q.step_seconds / winner.step_seconds - 1):+.1%}: {extra:+.1f} ms of {name}"


def _distinct(preds: list) -> list:
    """One per (dp, pp, tp, v, recompute, sp): the fastest microbatch size and ZeRO setting of each."""
    seen, out = set(), []
    for q in preds:
        c = q.candidate
        key = (c.dp, c.pp, c.tp, c.v, c.recompute, c.sp)
        if key not in seen:
            seen.add(key)
            out.append(q)
    return out
