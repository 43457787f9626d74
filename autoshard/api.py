"""``parallelize`` and ``compile_rank``: from a plain model to one rank's program.

This is the one module in ``autoshard/`` that runs the compiler (``autoshard.passes``); the runtime never
imports it. ``compile_rank`` is process-free (compile-only runs: dumps and unit tests of any rank of any
mesh); ``parallelize`` calls it for this process's rank and instantiates the program as a
``ParallelModule`` bound to the mesh's process groups.
"""
from __future__ import annotations

import time

import torch.distributed as dist
import torch.nn as nn

from autoshard.ir import meta as M
from autoshard.ir.options import CompileOptions, dump_dir
from autoshard.ir.program import Captured, Program
from autoshard.mesh import mesh_spec
from autoshard.passes import dump as D
from autoshard.passes.capture import capture
from autoshard.passes.lower import collective_records, param_records
from autoshard.passes.manager import PassContext, check_pass_list, run_passes
from autoshard.runtime.comm import comms_for_mesh
from autoshard.runtime.module import ParallelModule


def compile_rank(model: nn.Module, mesh, rank: int, example_args=(), example_kwargs=None,
                 options: CompileOptions | None = None, captured: Captured | None = None) -> Program:
    """Compile ``model`` for global ``rank`` of ``mesh`` (a DeviceMesh, a MeshSpec or ``{"tp": 4}``).

    No collective runs and no process group is touched: the program's parallel ops name their mesh axis
    and are bound when it is instantiated (``ParallelModule(program, model, comms)``).
    """
    options = options or CompileOptions()
    spec = mesh_spec(mesh)
    if spec.pp > 1 or spec.dp > 1:
        raise NotImplementedError(f"mesh {spec}: pipeline and data parallelism are not implemented yet "
                                  "(tensor parallelism only); use a mesh with dp=1 and pp=1")
    spec.coords(rank)  # a clear error for a rank outside the mesh
    check_pass_list(options.disable)
    start = time.perf_counter()
    captured = captured or capture(model, tuple(example_args), dict(example_kwargs or {}))
    out = dump_dir(options.dump)
    if out and rank != 0:
        out = f"{out}/rank{rank}"
    ctx = PassContext(spec, rank, options, out)
    local, timings = run_passes(captured.gm, ctx)
    prog = Program(local, captured, spec, rank, options, param_records(local), collective_records(local),
                   D.model_symbols(captured.gm), local.meta.get(M.PLAN_REPORT), timings,
                   compile_seconds=time.perf_counter() - start)
    if out:
        D.write_plan(prog, out)
    return prog


def parallelize(model: nn.Module, mesh, example_args=(), example_kwargs=None, *, pins: dict | None = None,
                loss_only: bool = False, dump: str | None = None, cost_model=None, disable=(),
                options: CompileOptions | None = None) -> ParallelModule:
    """Tensor-parallel ``model`` over ``mesh["tp"]``: an ``nn.Module`` holding this rank's shards.

    ``example_args``/``example_kwargs`` are traced once (their shapes are the shapes the program runs);
    ``pins`` maps parameter names to placements (``{"lm_head.weight": Replicate()}``); ``loss_only``
    returns None for the logits so they are never gathered; ``dump`` (or ``AUTOSHARD_DUMP``) writes the
    pass dumps and ``plan.md``; ``disable`` names passes to skip. The keywords build one
    ``CompileOptions``; pass ``options=`` instead to give it whole.
    """
    if options is None:
        options = CompileOptions(pins=pins or {}, loss_only=loss_only, dump=dump, disable=disable)
        if cost_model is not None:
            options.cost_model = cost_model
    spec = mesh_spec(mesh)
    if spec.size > 1 and not hasattr(mesh, "get_group"):
        raise ValueError("parallelize needs a DeviceMesh from autoshard.init_mesh for more than one rank; "
                         "use autoshard.compile_rank for compile-only runs")
    rank = dist.get_rank() if dist.is_initialized() else 0
    prog = compile_rank(model, spec, rank, example_args, example_kwargs, options)
    comms = comms_for_mesh(mesh, spec, rank) if spec.size > 1 else None
    return ParallelModule(prog, model, comms)
