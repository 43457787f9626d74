"""``parallelize`` and ``compile_rank``: from a plain model to one rank's program.

This module (with ``captures.py``, which traces the model for it) runs the compiler (``autoshard.passes``);
the runtime never imports it. ``compile_rank`` is process-free (compile-only runs: dumps and unit tests of
any rank of any mesh; ``compile_ranks`` does several ranks from one capture and one plan); ``parallelize``
calls it for this process's rank and instantiates the program as a ``ParallelModule`` bound to the mesh's
process groups, handing it a compiler for new shapes and modes.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard.captures import CaptureCache, capture_model
from autoshard.ir import meta as M
from autoshard.ir.options import PIPELINE_KEYWORDS, CompileOptions, PipelineOptions, dump_dir, options_from_keywords
from autoshard.ir.pipeline import LOSS_REWRITE, STAGE_PLAN, PipelineProgram
from autoshard.ir.program import Captured, Program
from autoshard.ir.schedule import add_communication, make_schedule, validate
from autoshard.mesh import group_timeout, mesh_spec
from autoshard.passes import dump as D
from autoshard.passes.dump_pipeline import write_pipeline
from autoshard.passes.lower import collective_records, param_records
from autoshard.passes.manager import PassContext, check_pass_list, run_mesh_passes, run_passes, run_rank_passes
from autoshard.passes.microbatch_loss import LossError
from autoshard.passes.stages import split_chunks
from autoshard.planner.memory_ladder import memory_options
from autoshard.planned import plan_keywords, user_memory_settings
from autoshard.runtime.comm import comms_for_mesh
from autoshard.runtime.module import ParallelModule
from autoshard.runtime.microbatch import row_counts, split_batch

log = logging.getLogger("autoshard")


def _recompute_resolved(options: CompileOptions, model: nn.Module) -> CompileOptions:
    """``recompute="auto"`` as the model asks: HF's ``activation_checkpointing_enable()`` (before
    transformers 5.x: ``gradient_checkpointing_enable()``) sets ``is_activation_checkpointing``
    (``is_gradient_checkpointing``), which export cannot see: it traces through the checkpoint."""
    if options.recompute != "auto":
        return options
    flag = next((f for f in ("is_activation_checkpointing", "is_gradient_checkpointing")
                 if hasattr(type(model), f)), None)
    return dataclasses.replace(options, recompute=bool(flag and getattr(model, flag)))


def _rank_dump_dir(options: CompileOptions, rank: int) -> str | None:
    out = dump_dir(options.dump)
    return f"{out}/rank{rank}" if out and rank != 0 else out


def compile_options(**keywords) -> CompileOptions:
    """The one ``CompileOptions`` that ``parallelize``'s keywords (documented there) describe; the
    compile-only entry points take the same keywords, so a dump made without processes is the program
    ``parallelize`` would run (``ir/options.py:options_from_keywords``: the keywords are its fields)."""
    return options_from_keywords(**keywords)


def _options(options: CompileOptions | None, keywords: dict, entry: str) -> CompileOptions | None:
    if keywords and options is not None:
        raise TypeError(f"{entry}: give the options as keywords ({', '.join(sorted(keywords))}) or as options=, "
                        "not both")
    return compile_options(**keywords) if keywords else options


def compile_rank(model: nn.Module, mesh, rank: int, example_args=(), example_kwargs=None,
                 options: CompileOptions | None = None, captured: Captured | None = None,
                 training: bool | None = None, captures: CaptureCache | None = None, **keywords) -> Program:
    """Compile ``model`` for global ``rank`` of ``mesh`` (a DeviceMesh, a MeshSpec or ``{"tp": 4}``), in
    ``training`` mode (default: the model's current mode).

    No collective runs and no process group is touched: the program's parallel ops name their mesh axis
    and are bound when it is instantiated (``ParallelModule(program, model, comms)``). The options are
    ``options=`` or ``parallelize``'s keywords (``loss_only=True``, ``dump="d"``, ...).
    """
    options = _rank_options(options, keywords, "compile_rank")
    return compile_ranks(model, mesh, [rank], example_args, example_kwargs, options, captured, training,
                         captures=captures)[0]


def _rank_options(options: CompileOptions | None, keywords: dict, entry: str) -> CompileOptions | None:
    """A single program's options: keywords make no pipeline (that is ``compile_pipeline``'s)."""
    if keywords.get("memory_limit") is not None:
        raise ValueError(f"{entry}(memory_limit=...): a memory limit bounds pm.step's pipeline (its microbatches "
                         "in flight, and the recompute and sequence parallelism that fit them); compile with "
                         "compile_pipeline, or parallelize, which do")
    options = _options(options, keywords, entry)
    return dataclasses.replace(options, pipeline=None) if keywords else options


def compile_ranks(model: nn.Module, mesh, ranks=None, example_args=(), example_kwargs=None,
                  options: CompileOptions | None = None, captured: Captured | None = None,
                  training: bool | None = None, captures: CaptureCache | None = None, **keywords) -> list:
    """``compile_rank`` for each of ``ranks`` (default: every rank of ``mesh``), in one process: the
    model is captured once and the passes that every rank runs alike (through ``plan``) run once, so
    the ranks share one plan by construction and a tp=8 compile-only run costs one plan, not eight.
    Returns the ``Program`` of each rank, in the order given. Each program's ``compile_seconds`` and
    ``timings`` count the shared capture and passes as its own (the time that rank alone would have taken
    with them), so they are not to be summed over ranks. ``captured`` is the model already captured for
    these inputs; ``captures``, a ``CaptureCache`` to take the capture from (or add it to). At pp=1 these
    are forward programs (``pm(...)``): pm.step's pipeline options (microbatches, ZeRO, a memory limit)
    are ``parallelize``'s and ``compile_pipeline``'s, dropped here (a memory limit is refused)."""
    options = _rank_options(options, keywords, "compile_ranks")
    options = _recompute_resolved(options or CompileOptions(), model)
    spec = mesh_spec(mesh)
    if spec.pp > 1 and options.pipeline is None:
        raise ValueError(f"mesh {spec} has a pipeline axis: compile it with compile_pipeline (parallelize does) "
                         "and train with pm.step")
    if spec.pp == 1 and options.pipeline is not None:
        # a forward program (pm(...)): compile_options() always fills in pm.step's pipeline options, whose
        # microbatch rewrite would return the summed loss here, which no step divides back
        if options.pipeline.memory_limit is not None:
            raise ValueError("compile_ranks(options with memory_limit): a memory limit bounds pm.step's pipeline; "
                             "compile with compile_pipeline, or parallelize, which do")
        options = dataclasses.replace(options, pipeline=None)
    ranks = list(range(spec.size)) if ranks is None else list(ranks)
    if not ranks:
        raise ValueError("compile_ranks: ranks is empty; give the ranks to compile, or None for every rank")
    for rank in ranks:
        spec.coords(rank)  # a clear error for a rank outside the mesh
    check_pass_list(options.disable)
    start = time.perf_counter()
    if captured is None:
        captured = _captured(captures, model, example_args, example_kwargs, options,
                             training if training is not None else model.training)
    pinned = _pins_by_graph_name(options, captured)
    first = 0 if 0 in ranks else ranks[0]     # rank 0 says the shared passes' warnings, as one by one
    planned = run_mesh_passes(captured.gm, PassContext(spec, first, pinned, _rank_dump_dir(options, first)))
    symbols = D.model_symbols(captured.gm)
    shared = time.perf_counter() - start
    programs = []
    for rank in ranks:
        start = time.perf_counter()
        out = _rank_dump_dir(options, rank)
        local, timings = run_rank_passes(planned, PassContext(spec, rank, pinned, out))
        prog = Program(local, captured, spec, rank, options, param_records(local), collective_records(local),
                       symbols, local.meta.get(M.PLAN_REPORT), timings,
                       compile_seconds=shared + time.perf_counter() - start)
        if out:
            D.write_plan(prog, out)
        programs.append(prog)
    return programs


def _captured(captures: CaptureCache | None, model, args, kwargs, options, training: bool) -> Captured:
    return (captures.get if captures is not None else capture_model)(model, args, kwargs, options, training)


def _pins_by_graph_name(options: CompileOptions, captured) -> CompileOptions:
    """A pin given under a tied weight's other name (``lm_head.weight``) applies to the one tensor, which
    the graph knows by its first name (``model.embed_tokens.weight``)."""
    if not any(name in captured.aliases for name in options.pins):
        return options
    return dataclasses.replace(options, pins={captured.aliases.get(k, k): v for k, v in options.pins.items()})


def compile_pipeline(model: nn.Module, mesh, rank: int, example_args=(), example_kwargs=None,
                     options: CompileOptions | None = None, training: bool = True,
                     captures: CaptureCache | None = None, _memory_chosen: bool = False,
                     **keywords) -> PipelineProgram:
    """Compile ``model``'s training step for global ``rank`` of ``mesh`` as a pipeline of ``pp x v`` stages
    over ``options.pipeline.microbatches`` microbatches. The example inputs are the whole batch.

    The model is captured on one microbatch and planned for tensor parallelism as one graph (so every
    boundary and every tied weight has one placement), then cut into stages (``passes/stages.py``). Every
    rank compiles every stage, so all ranks agree on the plan; each runs its own. The options are
    ``options=`` or ``parallelize``'s keywords (``microbatches=8, schedule="interleaved"``, ...);
    ``captures``, a ``CaptureCache`` to take the microbatch's capture from (or add it to). A
    ``memory_limit`` chooses recompute and sequence parallelism as ``parallelize`` does (which has chosen
    them already when it calls here: ``_memory_chosen``), so a compile-only dump is the program it runs."""
    fixed = user_memory_settings(keywords, options, None)
    options = _options(options, keywords, "compile_pipeline") or CompileOptions(pipeline=PipelineOptions())
    if options.pipeline is None:
        options = dataclasses.replace(options, pipeline=PipelineOptions())
    spec = mesh_spec(mesh)
    spec.coords(rank)
    if not _memory_chosen:      # a direct call: memory_limit's recompute and SP, as parallelize chooses them
        options, _ = _memory_limited(model, spec, example_args, example_kwargs, options, fixed, rank)
    options = _recompute_resolved(dataclasses.replace(options, loss_only=True), model)
    check_pass_list(options.disable)
    start = time.perf_counter()
    popts = options.pipeline
    schedule = add_communication(make_schedule(popts.schedule, spec.pp, popts.microbatches, popts.virtual_stages))
    validate(schedule)
    leaves, in_spec = torch.utils._pytree.tree_flatten((tuple(example_args), dict(example_kwargs or {})))
    args, kwargs = torch.utils._pytree.tree_unflatten(
        split_batch(leaves, popts.microbatches, call=(tuple(example_args), dict(example_kwargs or {})))[0], in_spec)
    captured = _captured(captures, model, args, kwargs, options, training)
    out = _rank_dump_dir(options, rank)
    local, timings = run_passes(captured.gm, PassContext(spec, rank, _pins_by_graph_name(options, captured), out))
    plan = local.meta[STAGE_PLAN]
    if plan.schedule is not None:      # the one pipeline_split priced (the zero-bubble ones are generated on the stages' costs)
        schedule = add_communication(plan.schedule)
        validate(schedule)
    chunks, plan.recomputed = split_chunks(local, plan)
    read = {name for c in chunks for name in c.param_names}
    prog = PipelineProgram(captured, spec, rank, options, chunks, schedule, plan, local.meta[LOSS_REWRITE],
                           collective_records(local), D.model_symbols(captured.gm), time.perf_counter() - start,
                           local.meta.get(M.PLAN_REPORT), timings, gm=local,
                           unread=[r for r in param_records(local) if r.name not in read])
    if out:
        write_pipeline(prog, out)
    return prog


def _fitting_microbatches(popts: PipelineOptions, pp: int, args, kwargs) -> PipelineOptions:
    """The pipeline options for a batch of another size (an epoch's short last batch): the same, unless
    ``microbatches`` does not divide its rows; then the most microbatches at most that many which do, and
    which the schedule takes. The loss stays the whole batch's (sum over count), whatever the count."""
    sizes = row_counts(torch.utils._pytree.tree_leaves((args, kwargs)))
    rows, m = (sizes.pop() if len(sizes) == 1 else None), popts.microbatches
    if rows is None or rows % m == 0:
        return popts            # (split_batch explains anything else)
    for d in range(min(m, rows), 0, -1):
        if rows % d:
            continue
        try:
            validate(add_communication(make_schedule(popts.schedule, pp, d, popts.virtual_stages)))
        except ValueError:
            continue
        log.warning("autoshard: a batch of %d rows runs as %d microbatches (microbatches=%d does not divide it); "
                    "the loss and gradients are still the whole batch's", rows, d, m)
        return dataclasses.replace(popts, microbatches=d)
    fits = -(-rows // pp) * pp
    raise ValueError(f"a batch of {rows} rows cannot run schedule={popts.schedule!r} at pp={pp}: the microbatch "
                     f"count must divide the rows and be a multiple of pp={pp}, and no count up to microbatches={m} "
                     f"is both. Use drop_last=True in the DataLoader for an epoch's short last batch, a batch of "
                     f"{fits} rows (a multiple of pp), or schedule='1f1b', which takes any microbatch count")


def _pp_groups(spec, rank: int, pp_sets) -> dict:
    """One process group per tuple of pp ranks in ``pp_sets``, for every (dp, tp) coordinate, created in
    the same order on every rank (``new_group`` is collective, even for ranks outside it), bounded by
    ``AUTOSHARD_TIMEOUT``; this rank keeps ``{pp tuple: group}`` for the tuples it is in."""
    mine = {}
    for ranks in pp_sets:
        for dp in range(spec.dp):
            for tp in range(spec.tp):
                members = [spec.rank_of({"dp": dp, "pp": r, "tp": tp}) for r in ranks]
                group = dist.new_group(members, timeout=group_timeout())
                if rank in members:
                    mine[ranks] = group
    return mine


def _tie_groups(spec, rank: int, ties: dict) -> dict:
    """The group of the pp ranks sharing each tied weight (``name -> group``), this rank's only."""
    mine = _pp_groups(spec, rank, sorted({tuple(r) for r in ties.values()}))
    return {name: mine[tuple(r)] for name, r in ties.items() if tuple(r) in mine}


def _p2p_groups(spec, rank: int) -> dict:
    """One two-rank group per ordered pair of neighbouring pp ranks ``(src, dst)``: the executor sends each
    transfer on its direction's group. NCCL runs a communicator's transfers in order on one stream, and
    with one group for both directions the interleaved schedule's transfers wait on each other in a cycle
    once activations outgrow NCCL's buffers (a simulation of every schedule, pp 2-8, m up to 32: a
    deadlock in 18 interleaved cases; none with a group a direction)."""
    pp = spec.pp
    return _pp_groups(spec, rank, sorted({(r, (r + 1) % pp) for r in range(pp)} | {((r + 1) % pp, r) for r in range(pp)}))


def _memory_limited(model, spec, args, kwargs, options: CompileOptions, fixed: set, rank: int) -> tuple:
    """``(options, MemoryChoice or None)``: recompute and sequence parallelism as ``memory_limit`` needs
    them (``planner/memory_ladder.py``), said on rank 0; a model that asks for recompute itself (HF's
    checkpointing flag under ``recompute="auto"``) keeps it, checked."""
    if options.pipeline is None or options.pipeline.memory_limit is None:
        return options, None
    resolved = _recompute_resolved(options, model)
    if options.recompute == "auto" and resolved.recompute is True:
        fixed = fixed | {"recompute"}
    options, choice = memory_options(model, spec, args, kwargs, resolved, frozenset(fixed))
    if choice is not None and rank == 0:
        saved = choice.chosen is not choice.rungs[0] and not choice.fixed     # it costs time: say so loudly
        (log.warning if saved else log.info)("autoshard: %s", choice.summary())
    return options, choice


def _dump_memory(choice, options: CompileOptions, rank: int) -> None:
    """The ladder's section at the end of this rank's ``plan.md``, when one was written."""
    out = _rank_dump_dir(options, rank)
    if choice is None or not out or not os.path.exists(os.path.join(out, "plan.md")):
        return
    with open(os.path.join(out, "plan.md"), "a") as f:
        f.write("\n" + "\n".join(choice.lines()))


def _say_compiled(prog, spec, rank: int) -> None:
    """One line on rank 0 (INFO, the ``autoshard`` logger): what was compiled, in how long, and where the
    time went (the capture, and the slowest passes: the ILP's ``plan`` on a large model)."""
    if rank != 0 or not log.isEnabledFor(logging.INFO):
        return
    passes = sum(prog.timings.values())
    slowest = sorted(prog.timings.items(), key=lambda kv: -kv[1])[:3]
    what = "step" if isinstance(prog, PipelineProgram) else "forward"
    log.info("autoshard: compiled the %s program for dp=%d pp=%d tp=%d in %.2f s (capture and lowering %.2f s, "
             "passes %.2f s: %s)", what, spec.dp, spec.pp, spec.tp, prog.compile_seconds,
             max(prog.compile_seconds - passes, 0.0), passes, ", ".join(f"{k} {v:.2f} s" for k, v in slowest))


def parallelize(model: nn.Module, mesh, example_args=(), example_kwargs=None, *, max_programs: int = 8,
                options: CompileOptions | None = None, plan=None, **keywords):
    """``model`` parallelized over ``mesh`` (its tp, pp and dp axes): an ``nn.Module`` holding this rank's shards.

    ``example_args``/``example_kwargs`` are traced first; other shapes, and the other of train/eval
    mode, compile their own program on first use (at most ``max_programs`` are kept). ``pins`` maps
    parameter names to placements (``{"lm_head.weight": Replicate()}``); ``loss_only`` returns None for
    the logits so they are never gathered; ``mixed_precision="bf16"`` keeps fp32 parameters and
    gradients and computes in bf16; ``dump`` (or ``AUTOSHARD_DUMP``) writes the pass dumps and
    ``plan.md``; ``disable`` names passes to skip. The keywords build one ``CompileOptions``; pass
    ``options=`` instead to give it whole.

    With a ``pp`` axis in the mesh (or ``microbatches`` given), train with ``pm.step(*batch)``, which
    splits the whole batch into ``microbatches`` and runs ``schedule`` ("gpipe", "1f1b", "interleaved" with
    ``virtual_stages`` chunks per rank (2 by default), the zero-bubble "zb-h1", "zb-h2" and "zb-v", or
    "auto"), with stages cut by the cost model or at ``pipeline_cuts`` (layer indices), within
    ``memory_limit`` bytes per rank; ``scatter_gather`` sends a boundary every tp rank holds whole as 1/t
    slices ("auto": on NCCL).
    With a ``dp`` axis each dp rank passes its own rows of the global batch (``autoshard.local_batch``)
    and ``pm.step`` returns the global batch's loss (at pp = 1 the training step program is then the one
    compiled here, when the model is in training mode and the example call returns a loss, since ``pm(...)``
    trains at dp = 1 only; an eval forward compiles on first use); ``zero=1`` makes ``pm.optimizer(cls, ...)`` shard
    the optimizer state over dp (ZeRO-1).

    ``fuse`` runs chains of pointwise ops and row reductions (bias, dropout, residual add, LayerNorm,
    RMSNorm, softmax) as generated Triton kernels, forward and backward: ``"auto"`` on CUDA only;
    ``True`` on CPU too when ``TRITON_INTERPRET=1`` (slow: for tests). When only the loss reads the
    logits (``loss_only``, ``pm.step``), the LM head and the cross-entropy run chunked over tokens so the
    logits never exist whole: ``loss_chunk_rows`` rows at a time ("auto": Liger's rule, at least 256, and
    on CUDA at least 0.3 TFLOP of GEMM a chunk; None: off). ``recompute=True`` (``"full"``; ``"none"`` is False)
    keeps only each layer's input for backward and runs the layer again there (Megatron's full recompute); ``"selective"`` runs only each attention's core again (scores,
    softmax, dropout, times v: Korthikanti et al.'s selective recompute); ``"auto"`` does full recompute
    when the model asks (HF's
    ``model.activation_checkpointing_enable()``, formerly ``gradient_checkpointing_enable()``).

    ``codegen="inductor"`` compiles each rank's program (forward, loss and backward, its collectives as
    functional collectives) with ``torch.compile``: Inductor writes the kernels (Triton on a GPU, C++ on
    a CPU) instead of the eager ops and ``fuse``'s generated kernels; "autoshard" runs the program
    eagerly; "auto" is the path measured fastest (README, "Code generation"). With "inductor" on CUDA,
    ``cuda_graphs=True`` replays each program's forward and backward as CUDA graphs.

    ``sequence_parallel=True`` shards the residual stream along the sequence where the plan would
    replicate it (Korthikanti et al.): the norms and residual adds run on 1/t of the tokens, the
    row-parallel all-reduces become reduce-scatters and each column-parallel input an all-gather whose
    backward reduce-scatters; a pipeline boundary is sent sequence-sharded (1/t of the bytes).

    ``memory_limit`` (bytes per rank) also bounds the whole rank, as the planner's cost model counts it
    (``planner/memory_ladder.py``): with ``recompute`` and ``sequence_parallel`` left out, it sets them to
    the fastest of TP alone, + sequence parallelism, + selective recompute, full recompute that fits, one
    choice for every stage (``pm.memory_choice``, a log line and ``plan.md`` say which and why), and raises
    naming the bytes missing per rank when none fits; set by the user (or a plan), they are only checked.

    ``check_finite=True`` (or ``AUTOSHARD_CHECK_FINITE=1``) raises on every rank, naming the step, when a
    training loss (and, in ``pm.step``, the gradient norm) is NaN or inf, as Megatron's
    ``check_for_nan_in_loss_and_grad`` does; off by default (it reads the loss back each step).

    ``loss_fn(output, target)`` (torch pipelining's convention) is compiled in after the model, for a
    model that returns logits: pass ``{"target": y}`` in ``example_kwargs`` and ``pm.step(x, target=y)``.
    """
    spec = mesh_spec(mesh)
    fixed = user_memory_settings(keywords, options, plan)
    if plan is not None and options is not None:    # the plan's settings over the options given whole
        planned = plan_keywords(plan, spec, example_args, example_kwargs, {})
        pipe = {PIPELINE_KEYWORDS[k]: v for k, v in planned.items() if k in PIPELINE_KEYWORDS}
        options = dataclasses.replace(options, **{k: v for k, v in planned.items() if k not in PIPELINE_KEYWORDS},
                                      pipeline=dataclasses.replace(options.pipeline or PipelineOptions(), **pipe))
    elif plan is not None:
        keywords = plan_keywords(plan, spec, example_args, example_kwargs, keywords)
    options = _options(options, keywords, "parallelize") or compile_options()
    real_mesh = hasattr(mesh, "get_group")
    if spec.size > 1 and not real_mesh:
        raise ValueError("parallelize needs a DeviceMesh from autoshard.init_mesh for more than one rank; "
                         "use autoshard.compile_rank for compile-only runs")
    rank = dist.get_rank() if dist.is_initialized() else 0
    options, memory = _memory_limited(model, spec, example_args, example_kwargs, options, fixed, rank)
    captures = CaptureCache()       # one trace per call signature, whichever of this module's programs asks
    if spec.pp > 1:
        with torch.enable_grad():          # traced as pm.step traces it (parallelize may be called under no_grad)
            program = compile_pipeline(model, spec, rank, example_args, example_kwargs, options, captures=captures,
                                       _memory_chosen=True)
        _say_compiled(program, spec, rank)
        _dump_memory(memory, options, rank)
        comms = comms_for_mesh(mesh, spec, rank) if spec.size > 1 else None
        peers = spec.group_ranks(rank, "pp")
        ties = _tie_groups(spec, rank, program.ties()) if spec.pp > 1 else {}
        p2p = _p2p_groups(spec, rank) if real_mesh else {}
        pins = {r.name: r.spec.tp for r in program.params}

        def twin_compiler(args, kwargs, training):
            """Another program of this pipeline (eval mode, or another batch shape) on the training
            program's cuts and placements, so it runs on the same parameter shards."""
            popts = dataclasses.replace(_fitting_microbatches(options.pipeline, spec.pp, args, kwargs),
                                        stretches=tuple(program.plan.stretches))
            if popts.schedule == "auto" and program.schedule.virtual == 2:   # auto chose ZB-V: its 2p stages
                popts = dataclasses.replace(popts, schedule="zb-v")
            later = dataclasses.replace(options, pins={**pins, **options.pins}, dump=None, pipeline=popts)
            return compile_pipeline(model, spec, rank, args, kwargs, later, training=training, captures=captures,
                                    _memory_chosen=True)
        pm = ParallelModule(program, model, comms, mesh["tp"] if real_mesh else None, step_compiler=twin_compiler,
                            max_programs=max_programs, peers=peers, tie_groups=ties, p2p_groups=p2p)
        pm.memory_choice, pm.captures = memory, captures
        return pm
    step_options = options
    options = dataclasses.replace(options, pipeline=None)
    pins = {}                      # the first program's placements: every later program shares its shards

    def compiler(args, kwargs, training, pinned):
        # a forward call without target= (pm.eval(); pm(x)) runs the model alone and returns its output
        loss = options.loss_fn if "target" in (kwargs or {}) else None
        later = dataclasses.replace(options, pins={**pinned, **options.pins}, dump=None, loss_fn=loss)
        return compile_rank(model, spec, rank, args, kwargs, later, training=training, captures=captures)

    def step_program(args, kwargs, training, dump):
        popts = _fitting_microbatches(step_options.pipeline or PipelineOptions(), spec.pp, args, kwargs)
        if not training:               # pm.eval_batch: one stage, as the training step's
            popts = dataclasses.replace(popts, stretches=())
        later = dataclasses.replace(step_options, pins={**pins, **options.pins}, dump=dump, pipeline=popts)
        return compile_pipeline(model, spec, rank, args, kwargs, later, training=training, captures=captures,
                                _memory_chosen=True)

    def step_compiler(args, kwargs, training):
        out = dump_dir(options.dump)   # a step program compiled on first use dumps into step/
        return step_program(args, kwargs, training, out and training and f"{out}/step" or None)

    prog = None
    if spec.dp > 1 and model.training:
        # pm(...) does not train at dp > 1 (pm.step sums the gradients over dp): the first program is the
        # training step's, and an eval forward compiles its own on first use; unless the example call
        # returns no loss to step on (logits only: eval forwards are all such a module runs)
        try:
            with torch.enable_grad():      # traced as pm.step traces it (parallelize may be called under no_grad)
                prog = step_program(example_args, example_kwargs, True, options.dump)
        except LossError:
            prog = None
    if prog is None:
        prog = compile_rank(model, spec, rank, example_args, example_kwargs, options, captures=captures)
    pins.update({r.name: r.spec.tp for r in prog.params})
    _say_compiled(prog, spec, rank)
    _dump_memory(memory, options, rank)

    comms = comms_for_mesh(mesh, spec, rank) if spec.size > 1 else None
    tp_mesh = mesh["tp"] if real_mesh else None
    pm = ParallelModule(prog, model, comms, tp_mesh, compiler=compiler, step_compiler=step_compiler,
                        max_programs=max_programs)
    pm.zero = step_options.pipeline.zero if step_options.pipeline is not None else 0
    pm.memory_choice, pm.captures = memory, captures
    return pm
