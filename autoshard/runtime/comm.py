"""One communicator per mesh axis, each counting what it sends.

``AxisComm`` wraps the process group of this rank's group along one axis (tp, dp or pp). Its tracer
counts calls and bytes by ``(axis, phase, kind)``, the same keys as the program's planned collectives
(``ir.program.comm_summary``), so a test or a benchmark can check the run against the plan call for call.
Bytes are those of the full tensor communicated (an all-gather's output, a reduce-scatter's input).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autoshard.ir.options import uses_nccl


def collective_device() -> torch.device:
    """Where a tensor must live for the process groups' collectives: NCCL takes only CUDA tensors (the
    current device), gloo CPU ones. For the small tensors a rank makes itself (a norm with no gradients, a
    batch fingerprint), whatever device the model's tensors are on."""
    if dist.is_available() and dist.is_initialized() and uses_nccl():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Tracer:
    calls: Counter = field(default_factory=Counter)   # (axis, phase, kind) -> calls
    bytes: Counter = field(default_factory=Counter)   # (axis, phase, kind) -> bytes

    def log(self, axis, phase, kind, nbytes):
        self.calls[axis, phase, kind] += 1
        self.bytes[axis, phase, kind] += nbytes

    def reset(self):
        self.calls.clear()
        self.bytes.clear()


@dataclass
class AxisComm:
    """This rank's group along ``axis``: ``size`` ranks, this one at index ``rank``."""
    axis: str
    size: int
    rank: int
    group: object = None                  # a torch ProcessGroup; None when size == 1
    tracer: Tracer = field(default_factory=Tracer)

    def _log(self, kind, numel, itemsize, phase):
        self.tracer.log(self.axis, phase, kind, numel * itemsize)

    def all_reduce(self, x, phase, op=dist.ReduceOp.SUM):
        if x.is_meta or self.size == 1:
            return x
        x = x.contiguous()
        self._log("all_reduce", x.numel(), x.element_size(), phase)
        dist.all_reduce(x, op=op, group=self.group)
        return x

    def all_reduce_async(self, x, phase):
        """Start an in-place all-reduce of ``x``; returns a handle to ``wait()`` on (or None)."""
        if x.is_meta or self.size == 1:
            return None
        self._log("all_reduce", x.numel(), x.element_size(), phase)
        return dist.all_reduce(x, group=self.group, async_op=True)

    def all_gather(self, x, dim, phase):
        """Concatenate every rank's ``x`` along ``dim``."""
        return self.all_gather_async(x, dim, phase).wait()

    def all_gather_async(self, x, dim, phase) -> "Pending":
        """Start ``all_gather``; ``wait()`` on the handle returns the concatenation. ``x`` is read until then
        (sent as it is, and put in place at ``wait()``): do not write it before."""
        if self.size == 1:
            return Pending(None, lambda: x)
        if x.is_meta:
            shape = list(x.shape)
            shape[dim] *= self.size
            return Pending(None, lambda: x.new_empty(shape))
        x = x.contiguous()
        self._log("all_gather", x.numel() * self.size, x.element_size(), phase)
        if dist.get_backend(self.group) == "gloo" and _all_to_all_single is not None:
            # as reduce_scatter below: gloo's all-to-all beats its all-gather (a sequence shard of 128 KiB,
            # measured: 0.30 against 0.38 ms on 2 ranks, 2.1 against 3.8 ms on 4). Each rank sends its part
            # to every other rank, the same (n-1)/n of the bytes, and nothing to itself: on 2 ranks the
            # shard goes out as it is, uncopied (0.55 against 0.68 ms for 128 KiB, 1.3 against 2.0 ms for
            # 1 MiB, medians of 15 rounds; tests/distributed/test_comm.py holds it to the plain gather)
            rows, others = x.shape[0], self.size - 1
            send = x if others == 1 else x.unsqueeze(0).expand(others, *x.shape).flatten(0, 1).contiguous()
            recv = x.new_empty((others * rows,) + tuple(x.shape[1:]))
            split = [0 if j == self.rank else rows for j in range(self.size)]
            work = _all_to_all_single(recv, send, split, split, group=self.group, async_op=True)

            def gathered():
                parts = list(recv.view(others, *x.shape).unbind(0))
                parts.insert(self.rank, x)
                return torch.cat(parts, dim=dim)
            return Pending(work, gathered)
        if dim == 0:
            out = x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:]))
            return Pending(_all_gather_single(out, x, group=self.group, async_op=True), lambda: out)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        return Pending(dist.all_gather(parts, x, group=self.group, async_op=True), lambda: torch.cat(parts, dim=dim))

    def all_gather_objects(self, obj) -> list:
        """Every rank's ``obj`` in rank order (pickled: hand it CPU tensors only, as a CUDA tensor would
        unpickle on its sender's device). Not counted: it carries metadata, not the step's tensors."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def reduce_scatter(self, x, dim, phase):
        """This rank's chunk along ``dim`` of the sum of every rank's ``x``."""
        return self.reduce_scatter_async(x, dim, phase).wait()

    def reduce_scatter_async(self, x, dim, phase) -> "Pending":
        """Start ``reduce_scatter``; ``wait()`` on the handle returns this rank's chunk of the sum (in ``x``'s
        dtype). ``x`` may be read until then: do not write it before."""
        if self.size == 1:
            return Pending(None, lambda: x)
        if x.is_meta:
            return Pending(None, lambda: x.chunk(self.size, dim=dim)[0].contiguous())
        self._log("reduce_scatter", x.numel(), x.element_size(), phase)
        if dist.get_backend(self.group) == "gloo" and _all_to_all_single is not None:
            # gloo's reduce-scatter costs more than an all-reduce of the whole tensor (0.96 against 0.76 ms for
            # 1 MiB on 2 ranks, measured); an all-to-all of the chunks and a local sum moves the same
            # (n-1)/n of the bytes and took 0.47 ms. The chunks go out as one copy of x with the split dim
            # moved first (0.60 against 1.03 ms for 256 KiB, chunk by chunk then stacked; 1.9 against 2.4
            # ms for 2 MiB, medians of 15 rounds)
            dim = dim % x.dim()
            front = x.unflatten(dim, (self.size, -1)).movedim(dim, 0).contiguous()   # [rank, ...its chunk]
            parts = torch.empty_like(front)
            work = _all_to_all_single(parts, front, group=self.group, async_op=True)
            return Pending(work, lambda: parts.sum(0, dtype=x.dtype))
        chunks = [c.contiguous() for c in x.chunk(self.size, dim=dim)]
        out = torch.empty_like(chunks[self.rank])
        return Pending(dist.reduce_scatter(out, chunks, group=self.group, async_op=True), lambda: out)


class Pending:
    """A collective in flight: ``wait()`` finishes it and returns its result."""

    def __init__(self, work, result):
        self.work, self.result = work, result

    def wait(self):
        if self.work is not None:
            self.work.wait()
        return self.result()


# one tensor in, one out: ``all_gather_single`` from torch 2.13, ``all_gather_into_tensor`` before (2.13
# deprecates that name, and the lent GPU machines run 2.11)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_all_to_all_single = getattr(dist, "all_to_all_single", None)


def comms_for_mesh(device_mesh, spec, rank: int) -> dict:
    """``{axis: AxisComm}`` for this rank of a torch ``DeviceMesh`` (groups only for axes of size > 1)."""
    coords = spec.coords(rank)
    return {axis: AxisComm(axis, spec.axis_size(axis), coords[axis],
                           device_mesh.get_group(axis) if spec.axis_size(axis) > 1 else None)
            for axis in coords}


class CommCounting:
    """``comm_counts`` / ``reset_comm_counts`` for a module holding ``self.comms`` (one AxisComm per axis)."""

    def comm_counts(self):
        """Calls and bytes run since the last ``reset_comm_counts``, by (axis, phase, kind)."""
        total = Tracer()
        for c in self.comms.values():
            total.calls.update(c.tracer.calls)
            total.bytes.update(c.tracer.bytes)
        return total.calls, total.bytes

    def reset_comm_counts(self):
        for c in self.comms.values():
            c.tracer.reset()
