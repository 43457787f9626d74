"""Run a function on N local CPU ranks joined by a gloo process group.

Usage from a test::

    from tests.distributed import run_distributed

    def _body(rank, world_size, x):   # top level, so it pickles under spawn
        ...
        return something_picklable

    results = run_distributed(_body, 2, x)   # list ordered by rank

Any rank that raises, exits without reporting, or is still running when the
overall timeout expires makes ``run_distributed`` kill every child and raise
``AssertionError`` carrying each failing rank's traceback.
"""
from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, result_queue, init_pg=True):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        if init_pg:
            dist.init_process_group(
                "gloo",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=60),
            )
        result = fn(rank, world_size, *args)
        result_queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result_queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _kill_all(procs):
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def run_distributed(fn, world_size, *args, timeout=120, init_pg=True):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    ``fn`` must be a picklable top-level function and its return value must be
    picklable. Returns the per-rank results ordered by rank. With ``init_pg=False`` the
    torchrun-style environment is set but ``fn`` creates the process group itself.
    """
    ctx = mp.get_context("spawn")
    result_queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, fn, args, result_queue, init_pg),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()

    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            try:
                rank, status, payload = result_queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                # A child that died without reporting (segfault, os._exit, OOM
                # kill) will never put anything: stop waiting for it.
                dead = [
                    r for r, p in enumerate(procs)
                    if r not in results and not p.is_alive() and p.exitcode is not None
                ]
                if dead:
                    # Drain anything it managed to send right before exiting.
                    try:
                        while True:
                            r, s, pl = result_queue.get(timeout=0.5)
                            results[r] = (s, pl)
                    except queue_mod.Empty:
                        pass
                    for r in dead:
                        results.setdefault(
                            r,
                            ("error", f"rank {r} exited with code {procs[r].exitcode} "
                                      "without reporting a result"),
                        )
                continue
            results[rank] = (status, payload)
            if status == "error":
                # Give the other ranks a moment to report (their own errors are
                # often the more useful ones), then stop waiting.
                grace = time.monotonic() + 5
                while len(results) < world_size and time.monotonic() < grace:
                    try:
                        r, s, pl = result_queue.get(timeout=0.5)
                        results[r] = (s, pl)
                    except queue_mod.Empty:
                        pass
                break
    finally:
        failed = timed_out or len(results) < world_size or any(
            s != "ok" for s, _ in results.values()
        )
        if failed:
            _kill_all(procs)
        else:
            for p in procs:
                p.join(timeout=30)
            _kill_all(procs)
        result_queue.close()

    if failed:
        lines = []
        if timed_out:
            lines.append(f"run_distributed timed out after {timeout}s")
        for r in range(world_size):
            if r not in results:
                lines.append(f"--- rank {r}: no result (hung or killed)")
            elif results[r][0] != "ok":
                lines.append(f"--- rank {r} failed:\n{results[r][1]}")
        raise AssertionError(
            f"{getattr(fn, '__name__', fn)} failed on {world_size} ranks:\n" + "\n".join(lines)
        )
    return [results[r][1] for r in range(world_size)]
