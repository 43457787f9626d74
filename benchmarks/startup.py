"""Start-up of a training loop at pp = 1: ``parallelize``, then the first step, per mesh and loop.

    python -m benchmarks.startup [--layers 8] [--hidden 256] [--seq 128] [--batch 8] [--out none]

A user's loop pays for compiling before its first step ends: the trace (``torch.export``), the passes
(the ILP among them) and binding, once per program it needs. Two loops, on the built-in GPT, one gloo
job per mesh (the slowest rank's seconds):

- *step loop*: ``pm.step(x, y)`` each step (needed at dp > 1, where ``pm(...)`` does not train);
- *call loop*: ``loss = pm(x, y)[1]; loss.backward()`` (the standard loop; dp = 1 only).

Reported: seconds in ``parallelize``, in the first step, their sum, the traces the module made
(``pm.captures.traced``) and the programs it compiled (forward and step). At pp = 1 one trace serves the
forward and the step program of the same batch (``autoshard/captures.py``), and at dp > 1 ``parallelize``
compiles the step program itself (``runtime/module.py``), so a step loop compiles one program there.
Writes ``startup_results.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist

from autoshard.launcher import launch
from benchmarks.pp import OUT, _batch, _gpt, _max_over_ranks

MESHES = ({"tp": 2}, {"dp": 2}, {"dp": 2, "tp": 2})


def _rank(rank, world, job):
    import autoshard
    torch.set_num_threads(1)
    mesh = autoshard.init_mesh(**job["mesh"])
    (x, y), _ = autoshard.local_batch((_batch(job["vocab"], job["batch"], job["seq"], 1), {}), mesh)
    model = _gpt(job["layers"], job["vocab"], job["hidden"], job["seq"], tie=True)
    dist.barrier()
    start = time.perf_counter()
    pm = autoshard.parallelize(model, mesh, (x, y))
    built = time.perf_counter()
    if job["loop"] == "step":
        pm.step(x, y)
    else:
        pm(x, y)[1].backward()
    done = time.perf_counter()
    programs = len(pm.forward_graphs) + len(pm.step_runners)
    return dict(parallelize=_max_over_ranks(built - start), first=_max_over_ranks(done - built),
                traced=pm.captures.traced, programs=programs)


def markdown(rows: list, job: dict) -> str:
    lines = ["# Start-up of a training loop at pp = 1 (`python -m benchmarks.startup`)", "",
             f"Built-in GPT: {job['layers']} layers, hidden {job['hidden']}, seq {job['seq']}, vocab {job['vocab']}, "
             f"a global batch of {job['batch']}; gloo ranks on this machine's cores, one thread each; the slowest "
             "rank's seconds.", "",
             "| mesh | loop | parallelize s | first step s | to the first step's end s | traces | programs |",
             "|---|---|---|---|---|---|---|"]
    for mesh, loop, r in rows:
        dims = " x ".join(f"{k}={v}" for k, v in mesh.items())
        lines.append(f"| {dims} | {loop} | {r['parallelize']:.2f} | {r['first']:.2f} | "
                     f"{r['parallelize'] + r['first']:.2f} | {r['traced']} | {r['programs']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=OUT)
    ns = ap.parse_args(argv)
    job = {k: v for k, v in vars(ns).items() if k not in ("timeout", "out")}
    rows = []
    for mesh in MESHES:
        world = math.prod(mesh.values())
        for loop in ("step", "call") if "dp" not in mesh else ("step",):
            res = launch(_rank, world, {**job, "mesh": mesh, "loop": loop}, timeout=ns.timeout)[0]
            rows.append((mesh, loop, res))
            print(mesh, loop, res, flush=True)
    text = markdown(rows, job)
    print(text)
    if ns.out != "none":
        os.makedirs(ns.out, exist_ok=True)
        with open(os.path.join(ns.out, "startup_results.md"), "w") as f:
            f.write(text)
    return rows


if __name__ == "__main__":
    main()
