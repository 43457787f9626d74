"""A placement change, planned once as a list of steps that the cost model prices, the dump prints and
the runtime executes (DTensor's ``_gen_transform_infos``, on one mesh axis at a time).

A ``Transform`` is one forward step with a known backward. Its collectives follow from the gradient
invariant in ``placement.py``:

| transform        | forward                       | backward (when the value needs a gradient) |
|------------------|-------------------------------|--------------------------------------------|
| ``all_reduce``   | P -> R: all-reduce (Megatron g)| identity                                  |
| ``reduce_scatter``| P -> S, even: reduce-scatter | all-gather                                 |
| ``all_gather``   | S -> R: all-gather            | take this rank's chunk (no communication)  |
| ``shard``        | R -> S: take this rank's chunk| all-gather                                 |
| ``to_partial``   | R -> P: rank 0 keeps the value, the others zeros | identity                |
| ``shard_to_partial`` | S -> P: each rank its chunk in place, zeros elsewhere | take this rank's chunk |

``plan_redistribute`` composes them (S -> S' is gather then shard). ``CommStep`` is one collective one
rank runs per step, the record every consumer of the plan reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy

from autoshard.ir.placement import Partial, Placement, Replicate, Shard, local_size

FWD, BWD = "fwd", "bwd"
KINDS = ("all_reduce", "all_gather", "reduce_scatter")

_FWD_COLLECTIVE = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter", "all_gather": "all_gather"}
_BWD_COLLECTIVE = {"reduce_scatter": "all_gather", "shard": "all_gather"}


@dataclass(frozen=True)
class Transform:
    """One forward step of a redistribution on ``axis``. ``dim``/``length``/``blocks`` describe the sharded
    dim it gathers or cuts (``length`` is the dim's global size, so padded and blocked shards are exact)."""
    kind: str                 # all_reduce | reduce_scatter | all_gather | shard | to_partial | shard_to_partial
    axis: str
    dim: int | None = None
    length: int | None = None
    blocks: int | tuple = 1

    def collectives(self, requires_grad: bool) -> list:
        """``[(phase, collective kind)]`` this step runs, forward then backward."""
        out = []
        if self.kind in _FWD_COLLECTIVE:
            out.append((FWD, _FWD_COLLECTIVE[self.kind]))
        if requires_grad and self.kind in _BWD_COLLECTIVE:
            out.append((BWD, _BWD_COLLECTIVE[self.kind]))
        return out

    def __repr__(self):
        where = "" if self.dim is None else f"(dim {self.dim}" + (f", blocks {self.blocks}" if self.blocks != 1 else "") + ")"
        return f"{self.kind}{where}@{self.axis}"


@dataclass(frozen=True)
class CommStep:
    """One collective per step: on ``axis``, in ``phase``, of a tensor of ``shape`` (its full size)."""
    phase: str
    kind: str
    axis: str
    shape: tuple
    what: str
    itemsize: int | None = None   # bytes per element when not the moved tensor's (the loss's fp32 stats)
    stacked: int = 1              # tensors of ``shape`` sent stacked in this one call

    @property
    def numel(self) -> int:
        return self.stacked * math.prod(self.shape)


def evenly_blocked(p: Shard, shape, size: int) -> bool:
    """Whether ``size`` ranks hold equal, unpadded chunks of each of ``p``'s equal blocks: one reduce-scatter
    (or sequence gather) of the dim seen as ``(blocks, n / blocks)`` moves every block at once. A sequence shard
    of a ``(b, s, h)`` stream viewed as ``(b * s, h)`` is ``b`` such blocks (HF's Conv1D flattens it so)."""
    return (not p.unequal and shape is not None and len(shape) > p.dim
            and shape[p.dim] % (p.blocks * size) == 0)


def plan_redistribute(src: Placement, dst: Placement, shape, axis: str, size: int) -> tuple:
    """The transforms that move a tensor of global ``shape`` from ``src`` to ``dst`` on ``axis``."""
    if src == dst or size == 1:
        return ()

    def cut(p):
        return Transform("shard", axis, p.dim, shape[p.dim], p.blocks)

    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return (Transform("all_reduce", axis),)
        if evenly_blocked(dst, shape, size):     # even blocks: each block reduce-scattered (one collective)
            return (Transform("reduce_scatter", axis, dst.dim, shape[dst.dim], dst.blocks),)
        return (Transform("all_reduce", axis), cut(dst))   # padded or unequal blocks: reduce, then cut
    if isinstance(src, Shard):
        gather = Transform("all_gather", axis, src.dim, shape[src.dim], src.blocks)
        if isinstance(dst, Replicate):
            return (gather,)
        if isinstance(dst, Partial):    # no gather: the chunks, each zero-padded in place, sum to the whole
            return (Transform("shard_to_partial", axis, src.dim, shape[src.dim], src.blocks),)
        return (gather, cut(dst))
    if isinstance(dst, Shard):
        return (cut(dst),)
    return (Transform("to_partial", axis),)


def redistribute_steps(transforms, requires_grad: bool, shape, what: str, size: int) -> list:
    """The ``CommStep`` list of a planned redistribution. A gather or scatter of a padded dim moves the
    padding too (``size`` chunks of ``ceil(n / size)``), so its step says so."""
    steps = []
    for t in transforms:
        moved = list(shape)
        if t.dim is not None:
            moved[t.dim] = local_size(t.length, size, t.blocks) * size
        steps += [CommStep(phase, kind, t.axis, tuple(moved if kind != "all_reduce" else shape), what)
                  for phase, kind in t.collectives(requires_grad)]
    return steps


def sequence_gather_steps(axis: str, shape) -> list:
    """Sequence parallelism's gather: all-gather forward, reduce-scatter of the partial gradient backward."""
    return [CommStep(FWD, "all_gather", axis, tuple(shape), "sequence-parallel gather"),
            CommStep(BWD, "reduce_scatter", axis, tuple(shape), "sequence-parallel gather (partial gradient)")]


def copy_to_parallel_steps(axis: str, shape) -> list:
    """Megatron's f: identity forward, all-reduce of the (partial) gradient backward."""
    return [CommStep(BWD, "all_reduce", axis, tuple(shape), "f (gradient of a replicated input)")]


def vocab_parallel_cross_entropy_steps(axis: str, rows: int, stacked: int = 2) -> list:
    """The vocab-parallel cross-entropy's traffic: all-reduce(MAX) of the row max, then one all-reduce of
    the ``stacked`` row statistics: (sum of exps, target logit), plus the row sum of the logits when the
    loss is label-smoothed (``stacked=3``). The logits are never gathered."""
    stats = {2: "sum of exps and target logit", 3: "sum of exps, target logit and row sum of logits"}[stacked]
    return [CommStep(FWD, "all_reduce", axis, (rows,), "loss: row max", itemsize=4),
            CommStep(FWD, "all_reduce", axis, (rows,), f"loss: {stats} (stacked)", itemsize=4,
                     stacked=stacked)]


def vocab_parallel_logsumexp_steps(axis: str, shape) -> list:
    """``logsumexp`` over a sharded (vocab) dim, output of global ``shape``: all-reduce(MAX) of the local
    maxima, then all-reduce(SUM) of the local sums of exps (fp32). Backward is local: the input never moves."""
    return [CommStep(FWD, "all_reduce", axis, tuple(shape), "logsumexp: max", itemsize=4),
            CommStep(FWD, "all_reduce", axis, tuple(shape), "logsumexp: sum of exps", itemsize=4)]


def volume(kind: str, nbytes, size: int):
    """Bytes one rank sends (ring algorithm) for collective ``kind`` on a tensor of ``nbytes`` (full):
    all-reduce ``2 n (t-1)/t``, all-gather and reduce-scatter ``n (t-1)/t``. Ints or sympy expressions."""
    if size == 1:
        return 0
    factor = sympy.Rational(size - 1, size) if isinstance(nbytes, sympy.Basic) else (size - 1) / size
    return (2 if kind == "all_reduce" else 1) * nbytes * factor
