"""Where a rank computes, and getting the program, its buffers and the user's batch there.

A model is compiled from whatever device it was built on (the CPU, ``meta``, or a GPU) and runs on its
mesh's device: on a CUDA mesh, the rank's current GPU (torchrun's ``LOCAL_RANK``, set by
``autoshard.init_mesh``). The parameters get there as DTensors on the tp mesh; the rest follows here:

- the graph's device literals (an ``arange`` for positions, a mask's ``full``), which export baked in
  from the traced model's device, are retargeted when the program is bound (``retarget``);
- the model's buffers and the constants export lifted are moved once, when they are registered;
- each call's tensors are moved at the entry of ``pm(...)``, ``pm.step`` and ``pm.eval_batch``
  (``to_device``), as DDP and FSDP move their inputs, so a data loader's CPU batches need no ``.cuda()``.

Without a real mesh (the in-process simulator, compile-only instantiations) the device is ``None``:
nothing moves, as before.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree


def mesh_device(tp_mesh) -> torch.device | None:
    """The device of the rank's mesh: its current CUDA device on a CUDA mesh, the CPU on a CPU mesh, None
    without a mesh."""
    if tp_mesh is None:
        return None
    if tp_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(tp_mesh.device_type)


def to_device(tree, device: torch.device | None):
    """``tree`` with every tensor on ``device`` (those already there are not copied)."""
    if device is None:
        return tree
    # a pinned batch (DataLoader(pin_memory=True)) is copied without making the host wait for the GPU
    return pytree.tree_map_only(
        torch.Tensor, lambda x: x if x.device == device else x.to(device, non_blocking=x.is_pinned()), tree)


def owned(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A copy of ``t`` of the module's own, on ``device`` (one copy, also when it moves)."""
    return t.detach().to(t.device if device is None else device, copy=True)


def owned_constant(t: torch.Tensor, name: str, device: torch.device | None) -> torch.Tensor:
    """``owned`` for a constant a program reads (a tensor export lifted from the forward or from a module
    attribute). One on ``meta`` (an attribute of a model built on ``meta`` that no init rebuilds) has no
    values to run with: an error naming it, before any collective."""
    if t.is_meta:
        raise ValueError(f"the graph reads '{name}', a tensor the model keeps outside its parameters and "
                         "buffers, and it is on the meta device: build the model with it on a real device, or "
                         "register it as a buffer that the model's init (reset_parameters / _init_weights) computes")
    return owned(t, device)


def retarget(gm: fx.GraphModule, device: torch.device | None) -> fx.GraphModule:
    """Point every device literal of ``gm``'s graph at ``device`` (in place; ``gm`` is the bound copy)."""
    if device is None:
        return gm
    changed = False

    def swap(a):
        nonlocal changed
        if isinstance(a, torch.device) and a != device:
            changed = True
            return device
        return a
    for n in gm.graph.nodes:
        n.args = fx.node.map_aggregate(n.args, swap)
        n.kwargs = fx.node.map_aggregate(n.kwargs, swap)
    if changed:
        gm.recompile()
    return gm
