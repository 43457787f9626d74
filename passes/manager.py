"""The compiler: one ordered list of passes, each ``(GraphModule, PassContext) -> GraphModule``.

Each ``Pass`` declares the ``node.meta`` keys it requires and provides (``autoshard.ir.meta``), like
torch's ``PassBase.requires/ensures``. ``check_pass_list`` checks the list against them before anything
runs, so ``disable=("plan",)`` is a clear error instead of a missing key two passes later, and an
unknown name in ``disable`` is an error too. ``run_passes`` lints the graph after every pass and, when
dumping, writes a numbered text file of it. The captured graph is never modified: the first pass that
works in place gets a copy. The passes before the first ``per_rank`` one plan the same graph on every rank;
``run_mesh_passes`` runs them once and ``run_rank_passes`` finishes the graph for each rank
(``api.compile_ranks``: several ranks in one process share one capture and one plan).

Where later features go (docs/architecture.md, "Where the next features go"): pipeline stage cuts are a
pass before ``plan``; activation recompute and fusion are passes after ``overlap_grad_allreduce``, each a
new file plus one line here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir.mesh import MeshSpec
from autoshard.ir.options import CompileOptions
from autoshard.passes import dump as D
from autoshard.passes.bias import decompose_bias_pass, fuse_bias_pass
from autoshard.passes.canonicalize import canonicalize_pass
from autoshard.passes.fill_slices import fill_slices_pass
from autoshard.passes.chunk_loss import chunk_loss_pass
from autoshard.passes.fusion import fuse_pass
from autoshard.passes.microbatch_loss import microbatch_loss_pass
from autoshard.passes.outputs import loss_only_pass
from autoshard.passes.overlap import overlap_grad_allreduce_pass
from autoshard.passes.pipeline_split import pipeline_split_pass
from autoshard.passes.plan import plan_pass
from autoshard.passes.recompute import recompute_pass
from autoshard.passes.sharded_dropout import sharded_dropout_pass
from autoshard.passes.sdpa_dropout import sdpa_dropout_pass
from autoshard.passes.selective_recompute import selective_recompute_pass
from autoshard.passes.stack_scans import stack_scans_pass
from autoshard.passes.tp_rewrite import tp_rewrite_pass
from autoshard.passes.unit_axis import drop_unit_axis_pass
from autoshard.passes.weight_grad import split_weight_grad_pass
from autoshard.passes.validate import check_heads_pass, check_local_shapes_pass


@dataclass
class PassContext:
    """What every pass may read: the mesh's shape, which rank is being compiled, the options."""
    mesh: MeshSpec
    rank: int
    options: CompileOptions = field(default_factory=CompileOptions)
    dump_dir: str | None = None

    @property
    def coords(self) -> dict:
        return self.mesh.coords(self.rank)


@dataclass(frozen=True)
class Pass:
    name: str
    fn: Callable                  # (gm, ctx) -> gm
    why: str                      # why it runs here, in one line
    requires: tuple = ()          # MetaKeys it reads
    provides: tuple = ()          # MetaKeys it writes
    in_place: bool = True         # False: builds a new GraphModule and leaves its input untouched
    per_rank: bool = False        # its graph depends on ctx.rank: it and every pass after it run per rank


CAPTURED = (M.KIND, M.NAME, M.REQUIRES_GRAD)   # what capture provides

PASSES = [
    Pass("fill_slices", fill_slices_pass, "a fresh buffer filled slice by slice (DeepSeek's MLA keys) is one cat"),
    Pass("canonicalize", canonicalize_pass, "ops in the spelling the rules know; in-place ops made pure"),
    Pass("stack_scans", stack_scans_pass, "a scan's chain of scatters that fills a buffer is one cat"),
    Pass("check_heads", check_heads_pass, "heads tp does not divide are an error before any work is done"),
    Pass("loss_only", loss_only_pass, "drop outputs before planning, so nothing is priced for gathering them"),
    Pass("microbatch_loss", microbatch_loss_pass,
         "pm.step: the mean cross-entropy as a sum, divided by the global count at run time (exact with ignore_index)"),
    Pass("pipeline_split", pipeline_split_pass,
         "pm.step: cut where the residual stream crosses (with small carried values), balanced by cost (plan.md: Pipeline)",
         requires=(M.KIND, M.NAME), provides=(M.CUT,)),
    Pass("decompose_bias", decompose_bias_pass, "a row-parallel bias must be added after the all-reduce"),
    Pass("plan", plan_pass, "placements for every node, from the op rules and the ILP",
         requires=CAPTURED, provides=(M.STRATEGY, M.SPEC, M.REQUIRES_GRAD)),
    Pass("tp_rewrite", tp_rewrite_pass, "local shapes, collectives as ir.ops records, vocab-parallel lowerings",
         requires=(M.STRATEGY, M.SPEC, M.REQUIRES_GRAD), provides=(M.GLOBAL_SHAPE, M.LOCAL_SHAPE, M.SOURCE),
         in_place=False, per_rank=True),
    Pass("drop_unit_axis", drop_unit_axis_pass, "at tp=1 every collective is the identity: the model's own graph"),
    Pass("sdpa_dropout", sdpa_dropout_pass, "SDPA with dropout on a tp shard spelled out as ATen's math attention "
         "(on CPU), so the next pass gives its dropout the single device's mask",
         requires=(M.SPEC, M.GLOBAL_SHAPE, M.LOCAL_SHAPE)),
    Pass("sharded_dropout", sharded_dropout_pass, "dropout on a tp shard draws the single-device mask and keeps "
         "its part, so every rank's RNG stays the single device's", requires=(M.SPEC, M.GLOBAL_SHAPE, M.LOCAL_SHAPE),
         per_rank=True),
    Pass("fuse_bias", fuse_bias_pass, "fold bias adds that stayed local back into the matmul",
         requires=(M.LOCAL_SHAPE,)),
    Pass("overlap_grad_allreduce", overlap_grad_allreduce_pass,
         "fuse f into its column-parallel matmul: the gradient all-reduce overlaps dW", requires=(M.LOCAL_SHAPE,)),
    Pass("chunk_loss", chunk_loss_pass,
         "LM head + cross-entropy chunked over tokens when only the loss reads the logits (plan.md: Chunked loss)",
         requires=(M.LOCAL_SHAPE,)),
    Pass("check_local_shapes", check_local_shapes_pass, "run on meta: every local shape as planned",
         requires=(M.LOCAL_SHAPE,), provides=(M.LOCAL_VAL,)),
    Pass("recompute", recompute_pass, "each layer keeps only its input and runs again in backward "
         "(plan.md: Activation recompute); before fuse, whose kernels stay within a layer", provides=(M.RECOMPUTE,)),
    Pass("selective_recompute", selective_recompute_pass, "recompute='selective': each attention's core (scores, "
         "softmax, dropout, times v) runs again in backward, the matmul outputs kept", provides=(M.RECOMPUTE,)),
    Pass("split_weight_grad", split_weight_grad_pass, "zero-bubble schedules: each matmul's weight gradient "
         "waits for the schedule's W (pipeline.md: B and W); after recompute, whose regions keep their nodes"),
    Pass("fuse", fuse_pass, "pointwise chains and row reductions as generated Triton kernels (plan.md: Fusion)",
         requires=(M.LOCAL_VAL,)),
]


def check_pass_list(disable=()) -> list:
    """The passes that will run, after checking ``disable`` and every pass's requirements."""
    names = [p.name for p in PASSES]
    unknown = [d for d in disable if d not in names]
    if unknown:
        raise ValueError(f"unknown pass name(s) {unknown} in disable: the passes are {names}")
    enabled = [p for p in PASSES if p.name not in disable]
    have = {k.key for k in CAPTURED}
    for p in enabled:
        for k in p.requires:
            if k.key not in have:
                raise ValueError(f"pass '{p.name}' needs the '{k.key}' annotation, which pass '{k.provided_by}' "
                                 f"provides, but '{k.provided_by}' is disabled: disable '{p.name}' too, or keep "
                                 f"'{k.provided_by}'")
        have |= {k.key for k in p.provides}
    return enabled


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose nodes (and their meta dicts) are new; tensors in meta are shared, not copied."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    out = fx.GraphModule(gm, graph)
    out.meta = dict(gm.meta)
    return out


@dataclass(frozen=True)
class MeshPlanned:
    """The graph after the passes that plan the same graph on every rank of a mesh (those before the first
    ``per_rank`` pass: through ``plan``), so several ranks compiled in one process (``compile_ranks``: the
    simulator, compile-only dumps) capture and plan once. Graph-level records made by those passes (the
    plan report; under a pipeline the stage plan and the loss rewrite) are then shared by every rank's
    program. ``dumps`` holds those passes' dump texts, copied into each rank's directory."""
    gm: fx.GraphModule
    mesh: MeshSpec
    options: CompileOptions
    timings: dict                                     # pass name -> seconds
    next_index: int                                   # PASSES index of the first per-rank pass
    dumps: tuple = ()                                 # ((file name, text), ...)
    dump_dir: str | None = None                       # where they were written as they came


def _first_per_rank() -> int:
    """Where the per-rank passes start, whether or not the first of them is enabled (so a rank's passes
    never run on the shared graph itself)."""
    return next(i for i, p in enumerate(PASSES) if p.per_rank)


def _run(gm: fx.GraphModule, ctx: PassContext, first: int, last: int, timings: dict, dumps: list | None = None):
    """PASSES[first:last] that are enabled, in order, timed into ``timings``; a copy is made before the
    first in-place pass, so the graph given is never modified. Each is dumped as it comes (a later pass
    may raise), and its text kept in ``dumps`` when given."""
    passes, owned = check_pass_list(ctx.options.disable), False
    for i in range(first, last):
        p = PASSES[i]
        if p not in passes:
            continue
        if p.in_place and not owned:
            gm, owned = copy_graph_module(gm), True
        start = time.perf_counter()
        graph_meta = dict(gm.meta)
        gm = p.fn(gm, ctx)
        gm.meta = {**graph_meta, **gm.meta}   # graph-level facts (the plan report) outlive a new graph
        owned = True
        gm.graph.lint()
        timings[p.name] = time.perf_counter() - start
        if ctx.dump_dir:
            _dump(ctx.dump_dir, dumps, D.dump_name(i + 1, p.name), D.graph_text(gm, i + 1, p.name))
    return gm


def _dump(dump_dir: str, kept: list | None, name: str, text: str) -> None:
    D.write_dump(dump_dir, name, text)
    if kept is not None:
        kept.append((name, text))


def run_mesh_passes(gm: fx.GraphModule, ctx: PassContext) -> MeshPlanned:
    """The passes before the first per-rank one. None of them makes its graph depend on ``ctx.rank``
    (``microbatch_loss`` reads it only to warn once, on rank 0)."""
    split, timings, dumps = _first_per_rank(), {}, []
    if ctx.dump_dir:
        _dump(ctx.dump_dir, dumps, D.dump_name(0, "capture"), D.graph_text(gm, 0, "capture"))
    planned = _run(gm, ctx, 0, split, timings, dumps)
    return MeshPlanned(planned, ctx.mesh, ctx.options, timings, split, tuple(dumps), ctx.dump_dir)


def run_rank_passes(planned: MeshPlanned, ctx: PassContext) -> tuple:
    """The rest, for ``ctx.rank``: ``(final graph, {pass name: seconds})``; ``planned`` is left as it was
    (its timings are included: each rank's program reports the shared passes as its own)."""
    if (ctx.mesh, ctx.options) != (planned.mesh, planned.options):
        raise ValueError(f"run_rank_passes: the graph was planned for mesh {planned.mesh} with other options "
                         f"than this rank's context ({ctx.mesh}): plan it again with run_mesh_passes")
    if ctx.dump_dir and ctx.dump_dir != planned.dump_dir:
        for name, text in planned.dumps:
            D.write_dump(ctx.dump_dir, name, text)
    timings = dict(planned.timings)
    gm = _run(planned.gm, ctx, planned.next_index, len(PASSES), timings)
    return gm, timings


def run_passes(gm: fx.GraphModule, ctx: PassContext) -> tuple:
    """Run the enabled passes in order: ``(final graph, {pass name: seconds})``."""
    return run_rank_passes(run_mesh_passes(gm, ctx), ctx)
