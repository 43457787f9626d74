"""Spawn N local ranks joined by one process group (gloo on CPU, NCCL when CUDA has enough GPUs).

The single-machine stand-in for torchrun that the tests and the benchmarks share.

- ``launch(fn, world, *args)`` runs ``fn(rank, world, *args)`` in each of ``world`` fresh ranks and returns
  the results ordered by rank.
- ``RankPool(world).run(fn, *args)`` does the same on ranks that stay up between calls. Spawning a rank,
  importing torch and joining the group costs seconds, more than many of the tests' bodies, so the test
  suite keeps one pool per world size. A call that fails or leaves the ranks out of step (a rank stuck in a
  collective, an aborted group) closes the pool; the next call starts a fresh one.

A rank that raises, dies or outlives ``timeout`` stops the whole job; the error carries each failing
rank's traceback (``RankError``). Each rank gets one intra-op thread (``torch.set_num_threads(1)``).
"""
from __future__ import annotations

import atexit
import datetime
import gc
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autoshard.ir.options import default_backend


class RankError(RuntimeError):
    """One or more ranks failed; ``.errors`` maps rank -> traceback text."""

    def __init__(self, message, errors):
        super().__init__(message)
        self.errors = errors


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend() -> str:
    return default_backend()


def _join_group(rank, world, port, init_pg):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    be = backend()
    if be == "nccl":
        torch.cuda.set_device(rank)
    if init_pg:  # otherwise fn makes the group itself from the torchrun-style environment
        dist.init_process_group(be, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))


def _leave_group():
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _call(rank, world, fn, args) -> tuple[str, bytes | str]:
    # the result is pickled here by value: the queue's own pickler shares tensors by file descriptor, which
    # the parent can only open while this process lives, and a rank exits as soon as it has put its result
    try:
        return "ok", pickle.dumps(fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        return "error", traceback.format_exc()


def _worker(rank, world, port, fn, args, q, init_pg):
    try:
        _join_group(rank, world, port, init_pg)
        q.put((rank, *_call(rank, world, fn, args)))
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))
    finally:
        _leave_group()


def _collect(procs, q, timeout, tag=None) -> dict:
    """``{rank: (status, payload)}`` from ``q`` until every rank reported, one failed (plus a short grace for
    the others, whose errors are often the telling ones), a rank died, or ``timeout`` passed. With ``tag``,
    messages carry it first and others (a stale call's) are dropped."""
    world, results, deadline = len(procs), {}, time.monotonic() + timeout

    def get(block_for):
        while True:
            item = q.get(timeout=block_for) if block_for else q.get_nowait()
            if tag is None:
                return item
            if item[0] == tag:
                return item[1:]

    while len(results) < world and time.monotonic() < deadline:
        try:
            r, status, payload = get(1.0)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
            if dead:
                time.sleep(0.5)
                while True:
                    try:
                        r, status, payload = get(None)
                        results[r] = (status, payload)
                    except queue_mod.Empty:
                        break
                for r in dead:
                    results.setdefault(r, ("error", f"rank {r} exited with code {procs[r].exitcode} "
                                                    "without reporting"))
                break
            continue
        results[r] = (status, payload)
        if status == "error":
            grace = time.monotonic() + 5
            while len(results) < world and time.monotonic() < grace:
                try:
                    r, status, payload = get(0.5)
                    results[r] = (status, payload)
                except queue_mod.Empty:
                    pass
            break
    return results


def _unpack(fn, world, results) -> list:
    if len(results) == world and all(s == "ok" for s, _ in results.values()):
        return [pickle.loads(results[r][1]) for r in range(world)]
    errors = {r: (results[r][1] if r in results else "no result (hung or killed after the timeout)")
              for r in range(world) if r not in results or results[r][0] != "ok"}
    msg = "\n".join(f"--- rank {r} failed:\n{e}" for r, e in errors.items())
    raise RankError(f"{getattr(fn, '__name__', fn)} failed on {world} ranks:\n{msg}", errors)


def _stop(procs, wait: bool):
    for p in procs:
        if wait:
            p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _check_backend(world):
    if backend() == "nccl" and torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} ranks on NCCL need {world} GPUs (one each), this machine has "
                           f"{torch.cuda.device_count()}: use fewer ranks, or AUTOSHARD_BACKEND=gloo to run on the CPU")


def launch(fn, world: int, *args, timeout: float = 900, init_pg: bool = True):
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; results ordered by rank.

    ``fn`` must be a picklable top-level function. Raises ``RankError`` with every failing rank's
    traceback if a rank raises, dies, or the job outlives ``timeout`` seconds (all ranks are killed).
    """
    _check_backend(world)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, q, init_pg),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        results = _collect(procs, q, timeout)
    finally:
        ok = len(results) == world and all(s == "ok" for s, _ in results.values())
        _stop(procs, wait=ok)
        q.close()
    return _unpack(fn, world, results)


# ---- ranks that stay up between calls --------------------------------------------------------------

_HEALTH_TIMEOUT = 60.0
# Objects the calls leave alive grow a rank's heap call after call, and
# every garbage collection walks it: past this many objects (a fresh rank holds about 0.4 million, the
# first tests' bodies add 5-10% each) the pool is replaced. The kernel tests took 95 s in a fresh pool,
# 151 s in fresh ranks each, and 436 s in a pool that had first run the distributed tests without this limit.
_RECYCLE_OBJECTS = 1_000_000


def _fresh_state(initial_seed):
    """What a fresh rank would start a call with: its own first seed, gradients on, float32, no compiled
    frames left from an earlier call (their guards and recompile limits). The environment and the working
    directory are put back after each call."""
    torch.manual_seed(initial_seed)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    torch._dynamo.reset()


def _pool_worker(rank, world, port, tasks, q):
    """Join the group once, then run each task in the same group. After a call, a barrier shows the ranks are
    still in step (no rank left inside a collective); a rank that cannot pass it, or whose heap has grown
    past ``_RECYCLE_OBJECTS``, says so and the pool closes."""
    try:
        _join_group(rank, world, port, init_pg=True)
        joined = None
    except BaseException:  # noqa: BLE001 - reported as the first call's error
        joined = traceback.format_exc()
    initial_seed, environ, cwd = torch.initial_seed(), dict(os.environ), os.getcwd()
    try:
        while (task := tasks.get()) is not None:
            tag, payload = task
            if joined is not None:
                q.put((tag, rank, "error", joined))
                return
            _fresh_state(initial_seed)
            try:
                fn, args = pickle.loads(payload)
                status, out = _call(rank, world, fn, args)
            except BaseException:  # noqa: BLE001 - the task itself did not unpickle
                status, out = "error", traceback.format_exc()
            os.environ.clear()
            os.environ.update(environ)
            os.chdir(cwd)
            q.put((tag, rank, status, out))
            if status != "ok":
                return
            try:
                dist.barrier()
            except BaseException:  # noqa: BLE001
                q.put((-tag, rank, "error", traceback.format_exc()))
                return
            gc.collect()
            if len(gc.get_objects()) > _RECYCLE_OBJECTS:
                q.put((-tag, rank, "recycle", b""))
                return
            q.put((-tag, rank, "ok", b""))
    finally:
        _leave_group()


class RankPool:
    """``world`` ranks in one process group that run call after call (``run``), each call as ``launch`` would
    run it, from the state a fresh rank starts in (seed, environment, grad mode, default dtype, compile
    caches). Any failure closes the pool, so a broken group never carries into the next call."""

    def __init__(self, world: int):
        _check_backend(world)
        self.world, self.procs, self._tag = world, [], 0

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def _start(self):
        ctx = mp.get_context("spawn")
        self._q = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        port = _free_port()
        self.procs = [ctx.Process(target=_pool_worker, args=(r, self.world, port, self._tasks[r], self._q),
                                  daemon=True) for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 900):
        """``fn(rank, world, *args)`` on every rank of the pool; results ordered by rank (``RankError`` as
        ``launch``)."""
        payload = pickle.dumps((fn, args))   # fails here, in the caller, if fn or args do not pickle
        if not self.alive:
            self.close()
            self._start()
        self._tag += 1
        for tasks in self._tasks:
            tasks.put((self._tag, payload))
        results = _collect(self.procs, self._q, timeout, tag=self._tag)
        ok = len(results) == self.world and all(s == "ok" for s, _ in results.values())
        if ok:
            health = _collect(self.procs, self._q, _HEALTH_TIMEOUT, tag=-self._tag)
            ok = len(health) == self.world and all(s == "ok" for s, _ in health.values())
        if not ok:
            self.close(kill=True)
        return _unpack(fn, self.world, results)

    def close(self, kill: bool = False):
        """Stop the ranks: asked to leave the group and exit, or killed (``kill``, or when they do not)."""
        if not self.procs:
            return
        if not kill:
            for tasks in self._tasks:
                tasks.put(None)
        _stop(self.procs, wait=not kill)
        for q in (self._q, *self._tasks):
            q.close()
        self.procs = []


_POOLS: dict[int, RankPool] = {}


def pooled(world: int) -> RankPool:
    """The process's pool of ``world`` ranks (closed at exit)."""
    if world not in _POOLS:
        _POOLS[world] = RankPool(world)
    return _POOLS[world]


@atexit.register
def close_pools():
    """Stop every pool ``pooled`` started (at exit, or where a caller wants fresh ranks from here on)."""
    for pool in _POOLS.values():
        pool.close()
