"""Device meshes with named axes ``dp``, ``pp``, ``tp``, built from torchrun's environment."""
from __future__ import annotations

import datetime
import inspect
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoshard.ir.mesh import AXES, MeshSpec
from autoshard.ir.options import default_backend, pg_timeout_seconds, uses_nccl


def init_mesh(tp: int = 1, dp: int = 1, pp: int = 1, *, plan=None) -> DeviceMesh:
    """A torch ``DeviceMesh`` of shape (dp, pp, tp) over all ranks; tp varies fastest (one node).
    ``plan``: a ``Plan`` of ``autoshard.plan`` gives the three sizes instead.

    Reads torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``; uses NCCL on CUDA and gloo on CPU, with a
    bounded timeout (``AUTOSHARD_TIMEOUT``) so a mismatched program fails instead of hanging.
    """
    if plan is not None:
        from autoshard.planner.search import check_plan
        plan = check_plan(plan)
        if (tp, dp, pp) != (1, 1, 1) and (tp, dp, pp) != (plan.tp, plan.dp, plan.pp):
            raise ValueError(f"init_mesh(tp={tp}, dp={dp}, pp={pp}, plan=...) disagrees with the plan's "
                             f"tp={plan.tp}, dp={plan.dp}, pp={plan.pp}: pass the plan alone")
        tp, dp, pp = plan.tp, plan.dp, plan.pp
    spec = MeshSpec(dp=dp, pp=pp, tp=tp)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise RuntimeError("autoshard.init_mesh needs a process group: launch with torchrun "
                               "(e.g. `torchrun --nproc_per_node=2 train.py`) or call "
                               "torch.distributed.init_process_group first")
        backend = default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=group_timeout())
    cuda = uses_nccl()   # the mesh lives where the process group communicates
    world = dist.get_world_size()
    if spec.size != world:
        raise ValueError(f"mesh dp={dp} x pp={pp} x tp={tp} = {spec.size} ranks, but the world has {world}: "
                         f"make the product of the axis sizes equal the number of processes")
    bounded = {"backend_override": _bounded_axes()} if spec.size > 1 and _has_backend_override() else {}
    return init_device_mesh("cuda" if cuda else "cpu", (dp, pp, tp), mesh_dim_names=AXES, **bounded)


def _has_backend_override() -> bool:
    """torch >= 2.9 lets a mesh give its axes' groups options (here: the timeout); older ones keep
    torch's default timeout for them."""
    return "backend_override" in inspect.signature(init_device_mesh).parameters


def group_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=pg_timeout_seconds())


def _bounded_axes() -> dict | None:
    """Each axis's process group with ``AUTOSHARD_TIMEOUT`` too: ``new_group`` (which the mesh calls per
    axis) takes torch's default (30 min on gloo, 10 on NCCL), not the world group's, so a dead tp, dp or pp
    peer would otherwise hang its group's collectives that long. None for a backend we have no options
    type for (the mesh then keeps torch's defaults)."""
    backend = dist.get_backend()
    make = {"gloo": getattr(dist.ProcessGroupGloo, "_Options", None) if hasattr(dist, "ProcessGroupGloo") else None,
            "nccl": getattr(dist.ProcessGroupNCCL, "Options", None) if hasattr(dist, "ProcessGroupNCCL") else None
            }.get(backend)
    if make is None:
        return None
    out = {}
    for axis in AXES:    # one options object each: new_group writes the group's ranks and name into it
        opts = make()
        opts._timeout = group_timeout()
        out[axis] = (backend, opts)
    return out


def mesh_spec(mesh) -> MeshSpec:
    """Validate a DeviceMesh (or a MeshSpec / dict) and return its shape as a MeshSpec."""
    if isinstance(mesh, MeshSpec):
        return mesh
    if isinstance(mesh, dict):
        unknown = set(mesh) - set(AXES)
        if unknown:
            raise ValueError(f"unknown mesh axis name(s) {sorted(unknown)}: autoshard's axes are {AXES}")
        return MeshSpec(**mesh)
    names = mesh.mesh_dim_names or ()
    unknown = [n for n in names if n not in AXES]
    if not names or unknown:
        raise ValueError(f"unknown mesh axis name(s) {unknown or '(unnamed)'}: name the mesh axes from {AXES}, "
                         f"e.g. autoshard.init_mesh(tp=2)")
    sizes = dict(zip(names, mesh.mesh.shape))
    spec = MeshSpec(**sizes)
    if dist.is_initialized() and spec.size != dist.get_world_size():
        raise ValueError(f"the mesh has {spec.size} ranks but the world has {dist.get_world_size()}: "
                         "a mesh must cover every process")
    return spec
