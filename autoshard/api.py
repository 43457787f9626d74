"""``parallelize`` and ``compile_rank``: from a plain model to one rank's tensor-parallel program.

``compile_rank`` is process-free (a compile-only run: dumps and unit tests of any rank of any mesh);
``parallelize`` calls it for this process's rank and wraps the program in a ``ParallelModule``.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from autoshard.config import CompileOptions, MeshSpec, dump_dir as _dump_dir
from autoshard.mesh import mesh_spec
from autoshard.passes import dump as D
from autoshard.passes.capture import Captured, capture
from autoshard.passes.pipeline import CompileContext, compile_graph
from autoshard.passes.spec import local_shape
from autoshard.runtime.collectives import TPComm

aten = torch.ops.aten


@dataclass
class Program:
    """One rank's compiled program and everything the runtime and the dumps need to know about it."""
    gm: torch.fx.GraphModule
    captured: Captured
    spec: MeshSpec
    rank: int
    comm: TPComm
    params: list            # (name, placement, global shape, dtype), in placeholder order
    symbols: dict
    cc: CompileContext
    compile_seconds: float = 0.0
    collectives: list = field(default_factory=list)


def warn_dropout(gm, t):
    """Dropout with p > 0 in a replicated region must draw the same mask on every tp rank."""
    if t == 1:
        return
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.dropout.default:
            p, train = (list(n.args[1:3]) + [0.5, True])[:2]
            if p > 0 and train:
                warnings.warn("the model has dropout with p > 0: replicated activations stay identical across tp "
                              "ranks only if every rank seeds torch identically (torch.manual_seed(seed) on all "
                              "ranks); a model-parallel RNG tracker is not implemented yet", stacklevel=3)
                return


def check_heads(gm, t):
    """Attention heads must divide evenly over tp: say which module, how many heads, and what works."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.scaled_dot_product_attention.default:
            shape = tuple(n.args[0].meta["val"].shape)
            if len(shape) != 4:
                continue  # (B, L, E): no head dim; the planner shards it by batch or not at all
            heads = shape[1]
            if heads % t:
                stack = n.meta.get("nn_module_stack") or {}
                where = next(reversed(stack.values()))[0] if stack else n.name
                ok = [d for d in range(1, heads + 1) if heads % d == 0]
                raise ValueError(f"attention in '{where}' has {heads} heads, which tp={t} does not divide: "
                                 f"tensor parallelism splits attention by heads; use tp in {ok}")


def compile_rank(model: nn.Module, mesh, rank: int, example_args=(), example_kwargs=None,
                 options: CompileOptions | None = None, group=None, captured: Captured | None = None,
                 comm: TPComm | None = None) -> Program:
    """Compile ``model`` for global ``rank`` of ``mesh`` (a DeviceMesh, a MeshSpec or ``{"tp": 4}``).

    No collective runs here: with ``group=None`` the program is built (and shape-checked on meta
    tensors) for inspection only. ``comm`` replaces the rank's ``TPComm`` (the tests' in-process
    simulator runs every rank's program in threads this way).
    """
    options = options or CompileOptions()
    spec = mesh_spec(mesh)
    if spec.pp > 1 or spec.dp > 1:
        raise NotImplementedError(f"mesh {spec}: pipeline and data parallelism are not implemented yet "
                                  "(tensor parallelism only); use a mesh with dp=1 and pp=1")
    coords = spec.coords(rank)
    start = time.perf_counter()
    captured = captured or capture(model, tuple(example_args), dict(example_kwargs or {}))
    gm = captured.gm
    check_heads(gm, spec.tp)
    warn_dropout(gm, spec.tp)
    comm = comm if comm is not None else TPComm(spec.tp, coords["tp"], group)
    dump = _dump_dir(options.dump)
    if dump and rank != 0:
        dump = f"{dump}/rank{rank}"
    cc = CompileContext(comm=comm, cost_model=options.cost_model, pins=dict(options.pins),
                        loss_only=options.loss_only, disable=tuple(options.disable), dump_dir=dump)
    symbols = D.model_symbols(gm)
    local = compile_graph(gm, cc)
    params = []
    for n in local.graph.nodes:
        if n.op == "placeholder" and n.meta.get("autoshard_kind") == "parameter":
            params.append((n.meta["autoshard_name"], n.meta["placement"], tuple(n.meta["global_shape"]),
                           n.meta["val"].dtype))
    prog = Program(local, captured, spec, rank, comm, params, symbols, cc,
                   compile_seconds=time.perf_counter() - start)
    prog.collectives = D.collectives(local)
    if dump:
        D.write_plan(local, dump, t=spec.tp, rank=rank, symbols=symbols, info=cc.info, timings=cc.timings,
                     params=[(nm, pl, local_shape(gs, pl, spec.tp), gs, torch.empty((), dtype=dt).element_size())
                             for nm, pl, gs, dt in params])
    return prog


def parallelize(model: nn.Module, mesh, example_args=(), example_kwargs=None, *, pins: dict | None = None,
                loss_only: bool = False, dump: str | None = None, cost_model=None, disable=()):
    """Tensor-parallel ``model`` over ``mesh["tp"]``: returns an ``nn.Module`` with this rank's shards.

    ``example_args``/``example_kwargs`` are traced once (their shapes are the shapes the program runs);
    ``pins`` maps parameter names to placements (``{"lm_head.weight": Replicate()}``); ``loss_only``
    returns None for the logits so they are never gathered; ``dump`` (or ``AUTOSHARD_DUMP``) writes the
    pass dumps and ``plan.md``.
    """
    import torch.distributed as dist
    from autoshard.runtime.module import ParallelModule

    spec = mesh_spec(mesh)
    rank = dist.get_rank() if dist.is_initialized() else 0
    group = mesh.get_group("tp") if hasattr(mesh, "get_group") and spec.tp > 1 else None
    if spec.tp > 1 and group is None:
        raise ValueError("parallelize needs a DeviceMesh from autoshard.init_mesh for tp > 1; "
                         "use autoshard.compile_rank for compile-only runs")
    opts = CompileOptions(pins=dict(pins or {}), loss_only=loss_only, dump=dump, disable=tuple(disable))
    if cost_model is not None:
        opts.cost_model = cost_model
    prog = compile_rank(model, spec, rank, example_args, example_kwargs, opts, group=group)
    return ParallelModule(prog, model)
