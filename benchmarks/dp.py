"""Data-parallel scaling against torch DDP on the same model: step time at dp = 1, 2 and 4.

    python -m benchmarks.dp [--dp 1 2 4] [--steps 10] [--hidden 128] [--layers 8]

Each rank steps on its own batch of ``--batch`` sequences (weak scaling: the global batch grows with
dp). A step is forward, backward and the gradient reduction over dp, no optimizer: ``pm.step`` against
``DistributedDataParallel(model)`` forward and ``loss.backward()``, interleaved (A B A B ...) after
checking that the global losses agree. Reported: median step time, the ratio, and the share of
autoshard's dp all-reduce hidden behind backward, ``1 - blocked / alone``, where ``blocked`` is the
time ``pm.step`` waits for the reduction after the last backward and ``alone`` is the same all-reduces
run on their own after the step. On 2 CPU cores, dp=4 puts 2 ranks on each core.

Writes ``dp_results.md`` and ``dp_results.json`` into ``--out`` (default ``benchmarks/results``).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from autoshard.launcher import launch
from autoshard.runtime.comm import collective_device
from benchmarks.pp import OUT, _batch, _gpt, _sync, _timed_step, loss_rtol


def _chunk_rows(text: str):
    return None if text == "none" else text if text == "auto" else int(text)


def _rank(rank, world, job):
    import autoshard
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _gpt(job["layers"], job["vocab"], job["hidden"], job["seq"], tie=False)
    x, y = _batch(job["vocab"], job["batch"], job["seq"], seed=rank)   # this rank's own data
    mesh = autoshard.init_mesh(dp=world)
    pm = autoshard.parallelize(copy.deepcopy(model), mesh, (x, y), microbatches=1,
                               fuse={"auto": "auto", "on": True, "off": False}[job["fuse"]],
                               loss_chunk_rows=_chunk_rows(job["loss_chunk_rows"]))
    if hasattr(pm, "bucket_bytes") and job["bucket_mb"] is not None:
        pm.bucket_bytes = int(job["bucket_mb"] * 2**20)
    if job["first_bucket_mb"] is not None:   # DDP's 1 MiB first bucket starts the all-reduce during backward
        pm.first_bucket_bytes = int(job["first_bucket_mb"] * 2**20)
    dev = collective_device()
    ddp = DDP(copy.deepcopy(model), device_ids=[dev.index] if dev.type == "cuda" else None,
              **({} if job["bucket_mb"] is None else {"bucket_cap_mb": job["bucket_mb"]}))

    def ours():
        return float(pm.step(x, y))

    def theirs():
        _, loss = ddp(x, y)
        loss.backward()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        return float(t) / world

    def clear():
        for p in list(pm.parameters()) + list(ddp.parameters()):
            p.grad = None

    check = (ours(), theirs())
    clear()
    if abs(check[0] - check[1]) > loss_rtol() * abs(check[1]):
        raise RuntimeError(f"global losses differ: autoshard {check[0]} vs DDP {check[1]}")
    times, hidden = {"autoshard": [], "ddp": []}, []
    for step in range(job["warmup"] + job["steps"]):
        for name, fn in (("autoshard", ours), ("ddp", theirs)):
            _, t = _timed_step(fn)
            if step >= job["warmup"]:
                times[name].append(t)
            if name == "autoshard" and world > 1 and step >= job["warmup"]:
                blocked = pm.last_dp_wait
                grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in pm.parameters()]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.barrier()
                _sync()
                start = time.perf_counter()
                dist.all_reduce(flat)
                _sync()                   # NCCL returns before the GPU has reduced anything
                alone = time.perf_counter() - start
                hidden.append(max(0.0, 1 - blocked / alone) if alone > 0 else 0.0)
        clear()
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    # ZeRO-1: AdamW state bytes this rank holds after one step, plain and sharded (predicted: 2 x the
    # parameter bytes, divided by dp when sharded)
    state = {}
    for zero in (0, 1):
        opt = pm.optimizer(torch.optim.AdamW, zero=zero, lr=1e-3)
        ours()
        opt.step()
        clear()
        inner = getattr(opt, "inner", opt)
        held = sum(v.numel() * v.element_size() for st in inner.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.dim())
        t = torch.tensor([float(held)], device=collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        state[zero] = float(t)
    return dict(dp=world, ours=statistics.median(times["autoshard"]), ddp=statistics.median(times["ddp"]),
                hidden=statistics.median(hidden) if hidden else None, grad_bytes=nbytes, loss=check,
                state_plain=state[0], state_zero=state[1], predicted_plain=2 * nbytes, predicted_zero=2 * nbytes / world)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="gradient bucket size for both (default: 25 MiB for both)")
    ap.add_argument("--first-bucket-mb", type=float, default=None,
                    help="autoshard's first bucket (default: 1 MiB on CUDA as DDP's; on CPU as large as the others, "
                         "since overlap slows a CPU backward; 1 measures the overlap DDP gets)")
    ap.add_argument("--fuse", choices=["auto", "on", "off"], default="auto",
                    help="autoshard's generated Triton fusion (auto: on under NCCL on CUDA, as parallelize's default)")
    ap.add_argument("--loss-chunk-rows", default="auto",
                    help="parallelize's loss_chunk_rows: auto (chunk logits over 64 MiB), none, or rows per chunk")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    job = {k: v for k, v in vars(args).items() if k not in ("dp", "out")}
    rows = []
    for dp in args.dp:
        r = launch(_rank, dp, job, timeout=900)[0]
        rows.append(r)
        print(f"dp={dp}: autoshard {r['ours'] * 1e3:.1f} ms, DDP {r['ddp'] * 1e3:.1f} ms ({r['ours'] / r['ddp']:.3f}x)"
              + (f", all-reduce hidden behind backward {r['hidden']:.0%}" if r["hidden"] is not None else ""),
              flush=True)
    L = ["# Data parallel against DDP", "", f"Config: {job}", "",
         "| dp | autoshard ms | DDP ms | ratio | dp all-reduce hidden behind backward | gradient MiB all-reduced | "
         "AdamW state MiB per rank: plain / ZeRO-1 (predicted) |",
         "|---|---|---|---|---|---|---|"]
    for r in rows:
        hid = f"{r['hidden']:.0%}" if r["hidden"] is not None else "-"
        L.append(f"| {r['dp']} | {r['ours'] * 1e3:.1f} | {r['ddp'] * 1e3:.1f} | {r['ours'] / r['ddp']:.3f} | {hid} | "
                 f"{r['grad_bytes'] / 2**20:.1f} | {r['state_plain'] / 2**20:.1f} / {r['state_zero'] / 2**20:.1f} "
                 f"({r['predicted_plain'] / 2**20:.1f} / {r['predicted_zero'] / 2**20:.1f}) |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dp_results.json"), "w") as f:
        json.dump({"config": job, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "dp_results.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main()
