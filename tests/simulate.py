"""Run every tensor-parallel rank's compiled program in threads of one process (forward and backward).

A ``SimComm`` exchanges tensors through a shared barrier instead of a process group, so a test can
check a sharding rule against eager PyTorch in milliseconds, on any tp, without gloo. The multi-process
tests (test_parity.py) remain the ground truth for the real collectives.
"""
from __future__ import annotations

import copy
import threading

import torch
import torch.distributed as dist

import autoshard
from autoshard.passes.spec import Shard
from autoshard.runtime.collectives import TPComm, gather_full
from autoshard.runtime.module import ParallelModule


class _Group:
    def __init__(self, t):
        self.barrier = threading.Barrier(t, timeout=20)
        self.slots = [None] * t


class SimComm(TPComm):
    def __init__(self, size, rank, group_state):
        super().__init__(size, rank, group=None)
        self.state = group_state

    def _exchange(self, x):
        self.state.slots[self.rank] = x.detach().clone()
        self.state.barrier.wait()
        parts = list(self.state.slots)
        self.state.barrier.wait()
        return parts

    def all_reduce(self, x, phase, op=dist.ReduceOp.SUM):
        if x.is_meta or self.size == 1:
            return x
        self._log("all_reduce", x, phase)
        parts = self._exchange(x)
        out = torch.stack(parts).amax(0) if op == dist.ReduceOp.MAX else sum(parts)
        return x.copy_(out)

    def all_reduce_async(self, x, phase):
        self.all_reduce(x, phase)
        return None

    def all_gather(self, x, dim, phase):
        if self.size == 1 or x.is_meta:  # meta: the compile-time shape check
            return super().all_gather(x, dim, phase)
        self._log("all_gather", x, phase)
        return torch.cat(self._exchange(x), dim)

    def reduce_scatter(self, x, dim, phase):
        if self.size == 1 or x.is_meta:
            return super().reduce_scatter(x, dim, phase)
        self._log("reduce_scatter", x, phase)
        return sum(self._exchange(x)).chunk(self.size, dim)[self.rank].contiguous()


def simulate(model, t, args=(), kwargs=None, loss_fn=None, **options):
    """Run ``model`` at tensor-parallel size ``t``: per rank, (output, {name: full grad}, input grads).

    ``loss_fn(output) -> scalar`` is backpropagated (default: the output itself, or its sum).
    """
    kwargs = kwargs or {}
    state = _Group(t)
    pms = []
    for r in range(t):
        comm = SimComm(t, r, state)
        prog = autoshard.compile_rank(model, {"tp": t}, r, args, kwargs,
                                      options=autoshard.CompileOptions(**options), comm=comm)
        pms.append(ParallelModule(prog, model))
    results, errors = [None] * t, []

    def rank_main(r):
        try:
            a, kw = copy.deepcopy((args, kwargs))
            out = pms[r](*a, **kw)
            loss = loss_fn(out) if loss_fn else (out if out.dim() == 0 else out.sum())
            loss.backward()
            grads = {}
            for name, p in pms[r].local_parameters().items():
                g, pl = p.grad, pms[r].placements[name]
                if g is not None and isinstance(pl, Shard):
                    g = gather_full(g, pl.dim, pms[r]._full_shapes[name][pl.dim], pms[r].comm, pl.blocks, "test")
                grads[name] = g
            in_grads = [x.grad for x in torch.utils._pytree.tree_leaves((a, kw)) if isinstance(x, torch.Tensor)]
            results[r] = (out, grads, in_grads)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            state.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(t)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:  # the root cause, not the other ranks' broken barriers
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results
