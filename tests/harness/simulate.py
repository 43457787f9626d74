"""Run every rank of a small mesh in threads of one process (forward and backward).

Each rank gets one ``SimComm`` per mesh axis; the ranks of a group (those that differ only in that
axis's coordinate) exchange tensors through a shared barrier instead of a process group. A test can so
check a sharding rule against eager PyTorch in milliseconds, on any mesh, without gloo. The
multi-process tests (test_parity.py) remain the ground truth for the real collectives.
"""
from __future__ import annotations

import copy
import threading

import torch
import torch.distributed as dist

import autoshard
from autoshard.ir.mesh import AXES, MeshSpec
from autoshard.runtime.comm import AxisComm, Pending
from autoshard.runtime.module import ParallelModule


class _Group:
    def __init__(self, size):
        self.barrier = threading.Barrier(size, timeout=20)
        self.slots = [None] * size


class SimComm(AxisComm):
    """An ``AxisComm`` whose collectives are exchanges between threads."""

    def __init__(self, axis, size, rank, state: _Group):
        super().__init__(axis, size, rank, group=None)
        self.state = state

    def _exchange(self, x):
        self.state.slots[self.rank] = x.detach().clone()
        self.state.barrier.wait()
        parts = list(self.state.slots)
        self.state.barrier.wait()
        return parts

    def exchange_objects(self, obj):
        """Every rank's ``obj`` (``dist.all_gather_object`` for threads)."""
        self.state.slots[self.rank] = obj
        self.state.barrier.wait()
        every = list(self.state.slots)
        self.state.barrier.wait()
        return every

    def all_reduce(self, x, phase, op=dist.ReduceOp.SUM):
        if x.is_meta or self.size == 1:
            return x
        self._log("all_reduce", x.numel(), x.element_size(), phase)
        parts = self._exchange(x)
        out = torch.stack(parts).amax(0) if op == dist.ReduceOp.MAX else sum(parts)
        return x.copy_(out)

    def all_reduce_async(self, x, phase):
        self.all_reduce(x, phase)
        return None

    def all_gather(self, x, dim, phase):
        if self.size == 1 or x.is_meta:  # meta: the compile-time shape check
            return super().all_gather(x, dim, phase)
        self._log("all_gather", x.numel() * self.size, x.element_size(), phase)
        return torch.cat(self._exchange(x), dim)

    def all_gather_async(self, x, dim, phase):
        if self.size == 1 or x.is_meta:
            return super().all_gather_async(x, dim, phase)
        out = self.all_gather(x, dim, phase)
        return Pending(None, lambda: out)

    def reduce_scatter(self, x, dim, phase):
        if self.size == 1 or x.is_meta:
            return super().reduce_scatter(x, dim, phase)
        self._log("reduce_scatter", x.numel(), x.element_size(), phase)
        return sum(self._exchange(x)).chunk(self.size, dim)[self.rank].contiguous()

    def reduce_scatter_async(self, x, dim, phase):
        if self.size == 1 or x.is_meta:
            return super().reduce_scatter_async(x, dim, phase)
        out = self.reduce_scatter(x, dim, phase)
        return Pending(None, lambda: out)


def sim_comms(mesh: MeshSpec) -> tuple:
    """``([{axis: SimComm}] per global rank, [every group state])``."""
    groups, per_rank = {}, []
    for rank in range(mesh.size):
        comms = {}
        for axis in AXES:
            members = tuple(mesh.group_ranks(rank, axis))
            state = groups.setdefault((axis, members), _Group(len(members)))
            comms[axis] = SimComm(axis, len(members), members.index(rank), state)
        per_rank.append(comms)
    return per_rank, list(groups.values())


def run_ranks(mesh: MeshSpec, fn) -> list:
    """Run ``fn(rank, comms)`` for every rank in its own thread; results by rank, or the root-cause error."""
    comms, groups = sim_comms(mesh)
    results, errors = [None] * mesh.size, []

    def main(r):
        try:
            results[r] = fn(r, comms[r])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            for g in groups:
                g.barrier.abort()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(mesh.size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:  # the root cause, not the other ranks' broken barriers
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results


def simulate(model, t, args=(), kwargs=None, loss_fn=None, **options):
    """Run ``model`` at tensor-parallel size ``t``: per rank, (output, {name: full grad}, input grads).

    ``loss_fn(output) -> scalar`` is backpropagated (default: the output itself, or its sum).
    """
    return [(out, grads, in_grads) for out, _, grads, in_grads in train_ranks(model, t, args, kwargs, loss_fn, **options)]


def train_ranks(model, t, args=(), kwargs=None, loss_fn=None, captured=None, **options):
    """One forward and backward on every rank of a simulated tp=t mesh, compiled from one capture (given,
    or made here) and one plan: per rank (output, loss, {name incl. tied aliases: full grad}, input grads)."""
    kwargs = kwargs or {}
    mesh = MeshSpec(tp=t)
    opts = autoshard.CompileOptions(**options)
    programs = autoshard.compile_ranks(model, mesh, None, args, kwargs, options=opts, captured=captured)

    def rank_main(r, comms):
        pm = ParallelModule(programs[r], model, comms)
        a, kw = copy.deepcopy((args, kwargs))
        out = pm(*a, **kw)
        loss = loss_fn(out) if loss_fn else (out if out.dim() == 0 else out.sum())
        loss.backward()
        grads = {name: (pm.gather(name, p.grad) if p.grad is not None else None)
                 for name, p in pm.local_parameters().items()}
        grads.update({alias: grads[main] for alias, main in pm.aliases.items()})  # tied names too
        in_grads = [x.grad for x in torch.utils._pytree.tree_leaves((a, kw)) if isinstance(x, torch.Tensor)]
        return out, loss.detach(), grads, in_grads

    return run_ranks(mesh, rank_main)


def reference(model, args, loss_fn=None):
    """Eager output, every parameter's gradient (tied names too) and the inputs' gradients."""
    ref = copy.deepcopy(model)
    args = copy.deepcopy(args)
    out = ref(*args)
    (loss_fn(out) if loss_fn else out).backward()
    grads = dict(ref.named_parameters(remove_duplicate=False))
    in_grads = [a.grad for a in args if isinstance(a, torch.Tensor)]
    return out, {k: p.grad for k, p in grads.items()}, in_grads


def assert_same(model, args, t, loss_fn=None, **options):
    """Every rank of a simulated tp=t run matches eager: output, each gradient, each input gradient."""
    out, grads, in_grads = reference(model, args, loss_fn)
    for rank, (o, g, ig) in enumerate(simulate(model, t, args, loss_fn=loss_fn, **options)):
        o = loss_fn(o) if loss_fn else o
        torch.testing.assert_close(o, loss_fn(out) if loss_fn else out, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} output: {m}")
        # every parameter (tied names included) is compared: none may be missing on either side
        assert set(g) == set(grads), f"rank {rank}: gradients {sorted(set(g) ^ set(grads))} on one side only"
        for name, ref_g in grads.items():
            assert (g[name] is None) == (ref_g is None), f"rank {rank} grad {name}: one side has none"
            if ref_g is not None:
                torch.testing.assert_close(g[name], ref_g, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"rank {rank} grad {name}: {m}")
        assert len(ig) == len(in_grads)
        for a, b in zip(ig, in_grads):
            assert (a is None) == (b is None), f"rank {rank}: an input gradient exists on one side only"
            if b is not None:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {rank} input grad: {m}")


def assert_hf_matches(model, t, kwargs, tol=1e-5, **options):
    """Every rank of a simulated tp=``t`` run of an HF causal LM called with ``kwargs`` (as users call it):
    the loss within 1e-5 of the single-device model's and every gradient within ``tol`` (relative)."""
    from tests.harness.parity_checks import rel
    ref = copy.deepcopy(model)
    want = ref(**kwargs).loss
    want.backward()
    for rank, (out, grads, _) in enumerate(simulate(model, t, (), kwargs, loss_fn=lambda o: o.loss, **options)):
        assert rel(out.loss.detach(), want.detach()) <= 1e-5, rank
        for n, p in ref.named_parameters():
            if p.grad is not None:
                assert rel(grads[n], p.grad) <= tol, (rank, n)
