"""Start N local ranks joined by one process group (gloo on CPU, NCCL when CUDA has enough GPUs).

The single-machine stand-in for torchrun that the tests and the benchmarks share.

- ``launch(fn, world, *args)`` runs ``fn(rank, world, *args)`` in each of ``world`` fresh ranks and returns
  the results ordered by rank.
- ``RankPool(world).run(fn, *args)`` does the same on ranks that stay up between calls. Starting a rank
  and joining the group costs seconds, more than many of the tests' bodies, so the test
  suite keeps one pool per world size and test module. A call that fails, or after which the world group
  is out of step (a rank stuck in a collective, an aborted group), closes the pool; the next call starts
  a fresh one.

A rank that raises, dies or outlives ``timeout`` stops the whole job; the error carries each failing
rank's traceback (``RankError``). Each rank gets one intra-op thread (``torch.set_num_threads(1)``).

On Linux, ranks are forked from a forkserver: a server process imports torch and autoshard once, plus the
modules named in ``AUTOSHARD_PRELOAD`` (``autoshard/_forkserver_preload.py``), and each rank starts as a
copy of it, then takes the caller's environment before it unpickles ``fn`` or joins the group. A spawned
rank pays those imports again, about 3 s of CPU for torch and autoshard and 5 s more for an HF model's
modules. ``AUTOSHARD_START_METHOD=spawn`` (or another platform) spawns them. The server starts at the
process's first launch and keeps that launch's ``AUTOSHARD_PRELOAD``, and what torch read at import (e.g.
``TORCH_LOGS``): set those before it. The group's store is hosted by the caller on a port the OS picks, so
two launchers on one machine (pytest-xdist's workers) never race for a port.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import os
import pickle
import queue as queue_mod
import socket
import sys
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


def _context():
    """The multiprocessing context ranks start from: on Linux a forkserver whose imports (torch, autoshard,
    ``AUTOSHARD_PRELOAD``) every rank inherits; elsewhere, or with ``AUTOSHARD_START_METHOD=spawn``, spawn.

    Forking from the server, not from the caller, keeps the caller's threads, process groups and CUDA state
    out of the ranks; the server itself never runs a tensor op. (macOS has a forkserver too, but forking
    after torch's import is not safe there.)"""
    method = os.environ.get("AUTOSHARD_START_METHOD") or ("forkserver" if sys.platform.startswith("linux")
                                                          else "spawn")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"AUTOSHARD_START_METHOD={method!r}: use 'forkserver' (Linux's default) or 'spawn'")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["autoshard._forkserver_preload"])
    return ctx


def _adopt(environ: dict):
    """The caller's environment, as a spawned rank would inherit it (a forked one inherits the server's,
    which is the caller's as it was when the server started)."""
    os.environ.clear()
    os.environ.update(environ)


# how long the ranks wait for each other to join the group, and its store for a key
_GROUP_TIMEOUT = datetime.timedelta(seconds=300)


def _host_store():
    """The group's key-value store, served by the caller on a port the OS picks as it binds (no window in
    which another process can take it, as one found free and bound again later has)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_GROUP_TIMEOUT)


def _rank_environ(rank, world, port) -> dict:
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")


def _join_group(rank, world, port, init_pg):
    os.environ.update(_rank_environ(rank, world, port))
    torch.set_num_threads(1)
    be = backend()
    if be == "nccl":
        torch.cuda.set_device(rank)
    if init_pg:  # otherwise fn makes the group itself from the torchrun-style environment
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_GROUP_TIMEOUT)   # the caller's (_host_store)
        dist.init_process_group(be, store=store, rank=rank, world_size=world, timeout=_GROUP_TIMEOUT)


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


def _worker(rank, world, port, payload, q, init_pg, environ):
    try:
        _adopt(environ)        # before fn's module is imported: it may read the environment
        fn, args = pickle.loads(payload)
        _join_group(rank, world, port, init_pg)
        q.put((rank, *_call(rank, world, fn, args)))
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))
    finally:
        _leave_group()


def _collect(procs, q, timeout, tag=None, early=None) -> dict:
    """``{rank: (status, payload)}`` from ``q`` until every rank reported, one failed (plus a short grace for
    the others, whose errors are often the telling ones), a rank died, or ``timeout`` passed. With ``tag``,
    messages carry it first; those of the same call's other phase (``-tag``: a pool rank's health, sent
    after its result) are kept in ``early`` for that phase's collection, and others (a stale call's) are
    dropped. A fast rank's health can overtake a slow rank's result on the queue: each rank's messages
    arrive in order, but not the ranks' relative to each other."""
    world, results, deadline = len(procs), {}, time.monotonic() + timeout
    early = {} if early is None else early

    def get(block_for):
        while True:
            if tag is not None and early.get(tag):
                return early[tag].pop(0)
            item = q.get(timeout=block_for) if block_for else q.get_nowait()
            if tag is None:
                return item
            if item[0] == tag:
                return item[1:]
            if item[0] == -tag:
                early.setdefault(-tag, []).append(item[1:])

    while len(results) < world and time.monotonic() < deadline:
        try:
            r, status, payload = get(1.0)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
            if dead:     # the others' errors (a peer that noticed) may still be on their way
                _drain(get, results, world)
                for r in dead:
                    results.setdefault(r, ("error", f"rank {r} exited with code {procs[r].exitcode} "
                                                    "without reporting"))
                break
            continue
        results[r] = (status, payload)
        if status == "error":
            _drain(get, results, world)
            break
    return results


def _drain(get, results, world, grace: float = 5.0):
    """Collect what the other ranks report within ``grace`` seconds of a failure."""
    until = time.monotonic() + grace
    while len(results) < world and time.monotonic() < until:
        try:
            r, status, payload = get(0.5)
            results[r] = (status, payload)
        except queue_mod.Empty:
            pass


def _all_ok(results, world) -> bool:
    return len(results) == world and all(s == "ok" for s, _ in results.values())


def _unpack(fn, world, results) -> list:
    if _all_ok(results, world):
        return [pickle.loads(results[r][1]) for r in range(world)]
    errors = {r: (results[r][1] if r in results else "no result (hung or killed after the timeout)")
              for r in range(world) if r not in results or results[r][0] != "ok"}
    msg = "\n".join(f"--- rank {r} failed:\n{e}" for r, e in errors.items())
    raise RankError(f"{getattr(fn, '__name__', fn)} failed on {world} ranks:\n{msg}", errors)


def _stop(procs, wait: bool):
    until = time.monotonic() + 30
    for p in procs:
        if wait:
            p.join(timeout=max(0.0, until - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _check_backend(world):
    if backend() == "nccl" and torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} ranks on NCCL need {world} GPUs (one each), this machine has "
                           f"{torch.cuda.device_count()}: use fewer ranks, or AUTOSHARD_BACKEND=gloo to run on the CPU")


def launch(fn, world: int, *args, timeout: float = 900, init_pg: bool = True):
    """Run ``fn(rank, world, *args)`` on ``world`` new ranks; results ordered by rank.

    ``fn`` must be a picklable top-level function. Raises ``RankError`` with every failing rank's
    traceback if a rank raises, dies, or the job outlives ``timeout`` seconds (all ranks are killed).
    """
    _check_backend(world)
    # by value, as RankPool sends its calls: unpickled after the rank took the caller's environment, and no
    # tensor travels as a shared-memory descriptor (a forkserver passes at most 252 per process)
    payload = pickle.dumps((fn, args))
    ctx = _context()
    q = ctx.Queue()
    store = _host_store() if init_pg else None
    port = store.port if store is not None else _free_port()   # without init_pg, rank 0 serves fn's own group
    procs = [ctx.Process(target=_worker, args=(r, world, port, payload, q, init_pg, dict(os.environ)),
                         daemon=True) for r in range(world)]
    results = {}
    try:
        for p in procs:
            p.start()
        results = _collect(procs, q, timeout)
    finally:
        _stop(procs, wait=_all_ok(results, world))
        q.close()
    return _unpack(fn, world, results)


# ---- ranks that stay up between calls --------------------------------------------------------------

_HEALTH_TIMEOUT = 60.0
# Objects the calls leave alive grow a rank's heap call after call, and
# every garbage collection walks it: past this many objects (a fresh rank holds about 0.4 million, the
# first tests' bodies add 5-10% each) the pool is replaced. The kernel tests took 95 s in a fresh pool,
# 151 s in fresh ranks each, and 436 s in a pool that had first run the distributed tests without this limit.
_RECYCLE_OBJECTS = 1_000_000
# Every mesh a call makes adds gloo groups (their threads and sockets) that live as long as the rank:
# past this many threads the pool is replaced too.
_RECYCLE_THREADS = 400


def _threads() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _fresh_state(initial_seed):
    """What a fresh rank would start a call with: its own first seed, gradients on, float32, no Dynamo frames
    left from an earlier call (their guards and recompile limits). Not reset: what is cached by content
    (Inductor's and Triton's caches, generated kernel modules), imported modules, and the c10d groups
    earlier calls made."""
    torch.manual_seed(initial_seed)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


def _pool_worker(rank, world, port, tasks, q, environ):
    """Join the group once, then run each task in the same group, in the caller's environment and directory.
    After a call, a barrier on the world group shows it is still in step (a call cannot return while a rank
    is inside a blocking collective; work left pending on a mesh axis's group is not seen). A rank that
    cannot pass it, or whose heap or thread count has grown past the limits, says so and the pool closes."""
    try:
        _adopt(environ)
        _join_group(rank, world, port, init_pg=True)
        joined = None
    except BaseException:  # noqa: BLE001 - reported as the first call's error
        joined = traceback.format_exc()
    initial_seed, own = torch.initial_seed(), _rank_environ(rank, world, port)
    try:
        while (task := tasks.get()) is not None:
            tag, payload = task
            if joined is not None:
                q.put((tag, rank, "error", joined))
                return
            _fresh_state(initial_seed)
            try:
                fn, args, environ, cwd = pickle.loads(payload)
                _adopt(environ | own)       # the caller's environment and directory now, as a fresh rank's
                os.chdir(cwd)
                status, out = _call(rank, world, fn, args)
            except BaseException:  # noqa: BLE001 - the task itself did not unpickle
                status, out = "error", traceback.format_exc()
            q.put((tag, rank, status, out))
            if status != "ok":
                return
            try:
                dist.barrier()
            except BaseException:  # noqa: BLE001
                q.put((-tag, rank, "error", traceback.format_exc()))
                return
            gc.collect()
            if len(gc.get_objects()) > _RECYCLE_OBJECTS or _threads() > _RECYCLE_THREADS:
                q.put((-tag, rank, "recycle", b""))
                return
            q.put((-tag, rank, "ok", b""))
    finally:
        _leave_group()


class RankPool:
    """``world`` ranks in one process group that run call after call (``run``), each call as ``launch`` would
    run it, from a fresh rank's seed, grad mode and default dtype, in the caller's environment and working
    directory (``_fresh_state`` says what carries over). Any failure closes the pool, so a broken world
    group never carries into the next call."""

    def __init__(self, world: int):
        _check_backend(world)
        self.world, self.procs, self._tag, self._store = world, [], 0, None

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def _start(self):
        ctx = _context()
        self._q = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._store = _host_store()
        self.procs = [ctx.Process(target=_pool_worker, args=(r, self.world, self._store.port, self._tasks[r],
                                                             self._q, dict(os.environ)),
                                  daemon=True) for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 900):
        """``fn(rank, world, *args)`` on every rank of the pool; results ordered by rank (``RankError`` as
        ``launch``)."""
        # fails here, in the caller, if fn or args do not pickle
        payload = pickle.dumps((fn, args, dict(os.environ), os.getcwd()))
        if not self.alive:
            self.close()
            self._start()
        self._tag += 1
        try:
            for tasks in self._tasks:
                tasks.put((self._tag, payload))
            early = {}      # health messages that came before every result had
            results = _collect(self.procs, self._q, timeout, tag=self._tag, early=early)
            ok = _all_ok(results, self.world) and _all_ok(
                _collect(self.procs, self._q, _HEALTH_TIMEOUT, tag=-self._tag, early=early), self.world)
        except BaseException:   # the caller interrupted (Ctrl-C): the ranks may still be inside the call
            self.close(kill=True)
            raise
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
            q.cancel_join_thread()     # a killed rank may not have read its task: exit must not wait on it
            q.close()
        self.procs, self._store = [], None


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
        try:
            pool.close()
        except Exception:  # noqa: BLE001 - the next pool is closed all the same
            pool.close(kill=True)
