"""Spawn N local ranks joined by one process group (gloo on CPU, NCCL when CUDA has enough GPUs).

The single-machine stand-in for torchrun that the tests and the benchmarks share.
``launch(fn, world, *args)`` runs ``fn(rank, world, *args)`` in each rank and returns the results ordered by
rank. A rank that raises, dies or outlives ``timeout`` stops the whole job; the error carries each failing
rank's traceback (``RankError``). Each rank gets one intra-op thread (``torch.set_num_threads(1)``).
"""
from __future__ import annotations

import datetime
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


def _worker(rank, world, port, fn, args, q, init_pg):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        be = backend()
        if be == "nccl":
            torch.cuda.set_device(rank)
        if init_pg:  # otherwise fn makes the group itself from the torchrun-style environment
            dist.init_process_group(be, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
        # pickled here by value: the queue's own pickler shares tensors by file descriptor, which the parent
        # can only open while this process lives, and a rank exits as soon as it has put its result
        q.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def launch(fn, world: int, *args, timeout: float = 900, init_pg: bool = True):
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; results ordered by rank.

    ``fn`` must be a picklable top-level function. Raises ``RankError`` with every failing rank's
    traceback if a rank raises, dies, or the job outlives ``timeout`` seconds (all ranks are killed).
    """
    if backend() == "nccl" and torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} ranks on NCCL need {world} GPUs (one each), this machine has "
                           f"{torch.cuda.device_count()}: use fewer ranks, or AUTOSHARD_BACKEND=gloo to run on the CPU")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, q, init_pg),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < world:
            if time.monotonic() > deadline:
                break
            try:
                r, status, payload = q.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)
                    while True:
                        try:
                            r, status, payload = q.get_nowait()
                            results[r] = (status, payload)
                        except queue_mod.Empty:
                            break
                    for r in dead:
                        results.setdefault(r, ("error", f"rank {r} exited with code {procs[r].exitcode} "
                                                        "without reporting"))
                    break
                continue
            results[r] = (status, payload)
            if status == "error":  # give the others a moment: their errors are often the telling ones
                grace = time.monotonic() + 5
                while len(results) < world and time.monotonic() < grace:
                    try:
                        r, status, payload = q.get(timeout=0.5)
                        results[r] = (status, payload)
                    except queue_mod.Empty:
                        pass
                break
    finally:
        ok = len(results) == world and all(s == "ok" for s, _ in results.values())
        for p in procs:
            if ok:
                p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        q.close()
    if not ok:
        errors = {r: (results[r][1] if r in results else "no result (hung or killed after the timeout)")
                  for r in range(world) if r not in results or results[r][0] != "ok"}
        msg = "\n".join(f"--- rank {r} failed:\n{e}" for r, e in errors.items())
        raise RankError(f"{getattr(fn, '__name__', fn)} failed on {world} ranks:\n{msg}", errors)
    return [pickle.loads(results[r][1]) for r in range(world)]
