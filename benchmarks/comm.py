"""Count the collectives any tensor-parallel program runs, by kind, phase and bytes.

``CommTracer`` is a ``TorchDispatchMode``: every collective reaches the dispatcher as an operator, whoever
issues it, so one tracer counts all the variants alike:

- ``torch.distributed.all_reduce`` / ``all_gather`` / ``all_gather_into_tensor`` / ``reduce_scatter`` /
  ``reduce_scatter_tensor`` (Megatron-Core's mappings and layers, autoshard's runtime) dispatch
  ``c10d::allreduce_``, ``c10d::allgather_``, ``c10d::_allgather_base_``, ``c10d::reduce_scatter_``,
  ``c10d::_reduce_scatter_base_``, ...;
- DTensor's redistributions and ``loss_parallel`` use the functional collectives
  (``torch.distributed._functional_collectives``), which dispatch ``_c10d_functional::all_reduce``,
  ``_c10d_functional::all_gather_into_tensor``, ``_c10d_functional::reduce_scatter_tensor``, ...
  (like torch's own ``CommDebugMode``, the tracer returns ``NotImplemented`` on DTensor arguments so
  DTensor first lowers its op to these).

Bytes follow autoshard's tracer convention (``pm.comm_counts()``): the bytes of the *full* tensor communicated, i.e. the
tensor reduced (all-reduce), the gathered output (all-gather) or the input before scattering
(reduce-scatter). The phase ("fwd"/"bwd") is whatever the caller set in ``tracer.phase`` (the benchmark
sets it around the forward call and around ``loss.backward()``). Barriers are not counted.

The tracer slows every op down a little, so the benchmark uses it on an untimed step only.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:  # DTensor is optional for the tracer
    from torch.distributed.tensor import DTensor
except Exception:  # noqa: BLE001
    DTensor = None


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


# operator name -> (kind, which argument holds the full tensor(s): an index into args, or "out")
_OPS = {
    # c10d (torch.distributed.* eager API)
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::allgather_": ("all_gather", 0),
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::allgather_coalesced_": ("all_gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::alltoall_": ("all_to_all", 1),
    "c10d::alltoall_base_": ("all_to_all", 1),
    "c10d::broadcast_": ("broadcast", 0),
    "c10d::reduce_": ("reduce", 0),
    "c10d::gather_": ("gather", 0),
    "c10d::scatter_": ("scatter", 1),
    # functional collectives (DTensor, loss_parallel)
    "_c10d_functional::all_reduce": ("all_reduce", 0),
    "_c10d_functional::all_reduce_": ("all_reduce", 0),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", 0),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", 0),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "out"),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "out"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "_c10d_functional::all_to_all_single": ("all_to_all", 0),
    "_c10d_functional::broadcast": ("broadcast", 0),
    "_c10d_functional::broadcast_": ("broadcast", 0),
    "_c10d_functional_autograd::all_to_all_single": ("all_to_all", 0),
    "_c10d_functional_autograd::reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional_autograd::all_gather_into_tensor": ("all_gather", "out"),
}


class CommTracer(TorchDispatchMode):
    """``with CommTracer() as t: ...`` -> ``t.calls`` / ``t.bytes``: Counters keyed by (phase, kind)."""

    def __init__(self):
        super().__init__()
        self.phase = "fwd"
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def reset(self):
        self.calls.clear()
        self.bytes.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if DTensor is not None and any(isinstance(t, type) and issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower the op to local ops and collectives first
        out = func(*args, **kwargs)
        entry = _OPS.get(func._schema.name)
        if entry is not None:
            kind, where = entry
            full = out if where == "out" else args[where]
            self.calls[self.phase, kind] += 1
            self.bytes[self.phase, kind] += _nbytes(full)
        return out


def as_json(counter) -> dict:
    """``{(phase, kind): n}`` -> ``{"phase/kind": n}`` (JSON keys must be strings)."""
    return {f"{p}/{k}": int(n) for (p, k), n in sorted(counter.items())}
