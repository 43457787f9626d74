"""Tensor-parallel benchmark: autoshard vs hand-written Megatron-Core TP vs DTensor vs one process.

    python -m benchmarks.tp                       # the default sweep: TP 2 and 4, vocab 1024 and 50304
    python -m benchmarks.tp --tp 2 --vocab 1024 --steps 5 --warmup 1
    python -m benchmarks.tp --profile 15          # also write each variant's top ops (torch.profiler)

For each TP size and vocabulary the script spawns TP ranks (gloo on 127.0.0.1; NCCL on GPUs), builds every
variant from the SAME single-device GPT (same weights, same batch), checks that they all give the same
loss at step 0 (relative 1e-5; it aborts otherwise: a benchmark of a wrong program is worthless; that
untimed step also counts the collectives and warms every variant up), then runs ``--warmup`` more steps
and the ``--steps`` timed steps INTERLEAVED (A B C A B C ...) so machine noise hits all variants alike. A step is forward + backward (no optimizer). Every rank uses one intra-op thread; before each
timed step the ranks meet at a barrier, and a step's time is the max over ranks.

Reported per variant: median and min step time, the ratio to Megatron, collectives and bytes per step
(autoshard: its own ``pm.comm_counts()``, checked against the compiler's plan ``pm.program.collectives``;
the others: ``benchmarks.comm.CommTracer`` on an untimed step), and memory:

- ``peak MB``: tensor memory of one step, max over ranks: the rank's parameter shards plus the peak of
  bytes allocated during forward+backward (gradients start at None), from torch.profiler's allocator
  events (CPU; torch's CPU allocator has no peak counter) or ``torch.cuda.max_memory_allocated`` (GPU);
- ``max RSS MB`` (per rank, ``getrusage`` ru_maxrss): the whole process, all variants together, since they
  share the process.

Writes ``tp_results.md``, ``tp_results.json`` and ``tp_results.png`` into ``--out``
(default ``benchmarks/results``).
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time
import warnings
from collections import Counter

import torch

from autoshard.launcher import RankError, backend, launch
from benchmarks.variants import VARIANTS

DEFAULTS = dict(tp=[2, 4], vocab=[1024, 50304], layers=4, hidden=256, heads=8, seq=128, batch=8,
                steps=16, warmup=1, seed=0)
RTOL = 1e-5
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class LossMismatch(RuntimeError):
    """The variants disagree on the step-0 loss: the benchmark would time a wrong program."""


# --- inside one rank ----------------------------------------------------------------------------------
def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_step_bytes(v, idx, tgt, device) -> int:
    """Parameter shards + the peak of bytes allocated during one forward+backward."""
    v.zero_grad()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        v.step(idx, tgt)
        torch.cuda.synchronize(device)
        extra = torch.cuda.max_memory_allocated(device) - base
    else:
        from torch.profiler import ProfilerActivity, profile

        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            v.step(idx, tgt)
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]")
        cur = extra = 0
        for _, nbytes in events:
            cur += nbytes
            extra = max(extra, cur)
    v.zero_grad()
    return v.local_param_bytes() + extra


class _quiet_stderr:
    """Kineto prints profiler start/stop lines on fd 2; hide them."""

    def __enter__(self):
        try:
            sys.stderr.flush()
            self.saved = os.dup(2)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
        except OSError:
            self.saved = None
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            os.dup2(self.saved, 2)
            os.close(self.saved)


def _profile_table(v, idx, tgt, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    v.zero_grad()
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            v.zero_grad()
            v.step(idx, tgt)
    v.zero_grad()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def check_losses(per_rank_losses, rtol=RTOL):
    """``[{variant: loss} per rank]`` -> None if all agree with the single-process loss, else why not."""
    first = per_rank_losses[0]
    ref_name = next((n for n in ("single_1t", "single_nt") if n in first), None) or next(iter(first), None)
    if ref_name is None:
        return None
    ref = first[ref_name]
    bad = [f"{k} on rank {r}: {val!r}" for r, losses in enumerate(per_rank_losses) for k, val in losses.items()
           if not (math.isfinite(val) and abs(val - ref) <= rtol * abs(ref))]
    if bad:
        return f"step-0 losses disagree with {ref_name} = {ref!r} (relative tolerance {rtol}): " + "; ".join(bad)
    return None


def _bench_rank(rank, world, job):
    import torch.distributed as dist

    from autoshard.models import GPT, GPTConfig
    from autoshard.ir.program import comm_summary
    from benchmarks.comm import CommTracer, as_json
    from benchmarks.variants import Unavailable, build

    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    rss_start = _max_rss_mb()

    cfg = GPTConfig(block_size=job["seq"], vocab_size=job["vocab"], n_layer=job["layers"], n_head=job["heads"],
                    n_embd=job["hidden"], dropout=0.0, bias=True, fused_qkv=True, tie_weights=True)
    torch.manual_seed(job["seed"])
    model = GPT(cfg).to(device)
    gen = torch.Generator().manual_seed(job["seed"] + 1)
    idx = torch.randint(0, job["vocab"], (job["batch"], job["seq"]), generator=gen).to(device)
    tgt = torch.randint(0, job["vocab"], (job["batch"], job["seq"]), generator=gen).to(device)

    variants, unavailable, build_s = {}, {}, {}
    for name in job["variants"]:
        t0 = time.perf_counter()
        try:
            variants[name] = build(name, model, world, device, idx, tgt)
        except Unavailable as e:
            unavailable[name] = str(e)
        build_s[name] = time.perf_counter() - t0
        dist.barrier()
    out = dict(rank=rank, unavailable=unavailable, build_s=build_s)

    # --- step 0: losses (all variants must agree) and communication, on an untimed traced step ---------
    check, plan_warnings = {}, []
    for name, v in variants.items():
        if not (v.rank0_only and rank != 0):
            v.zero_grad()
            pm = getattr(v, "pm", None)
            if pm is not None:
                pm.reset_comm_counts()
            tracer = CommTracer()
            with tracer:
                loss = v.step(idx, tgt, tracer)
            _sync(device)
            c = dict(loss=v.loss_value(loss), calls=as_json(tracer.calls), bytes=as_json(tracer.bytes))
            if pm is not None:
                c["traced_calls"], c["traced_bytes"] = c["calls"], c["bytes"]
                c["calls"], c["bytes"] = (as_json(_without_axis(n)) for n in pm.comm_counts())
                c["plan_calls"], c["plan_bytes"] = (as_json(_without_axis(n))
                                                    for n in comm_summary(pm.program.collectives))
                if c["plan_calls"] != c["calls"] or c["plan_bytes"] != c["bytes"]:
                    plan_warnings.append(
                        f"WARNING rank {rank}: autoshard's measured collectives per step (pm.comm_counts()) differ from its "
                        f"plan (pm.program.collectives): measured calls {c['calls']} bytes {c['bytes']}; "
                        f"plan calls {c['plan_calls']} bytes {c['plan_bytes']}")
                if c["traced_calls"] != c["calls"] or c["traced_bytes"] != c["bytes"]:
                    plan_warnings.append(
                        f"WARNING rank {rank}: pm.comm_counts() and the dispatcher-level tracer disagree for autoshard: "
                        f"pm.comm_counts() {c['calls']} / {c['bytes']}, tracer {c['traced_calls']} / {c['traced_bytes']}")
            check[name] = c
            v.zero_grad()
        dist.barrier()
    out["check"], out["warnings"] = check, plan_warnings

    # every rank sees every rank's losses and takes the same decision
    gathered = [None] * world
    dist.all_gather_object(gathered, {k: c["loss"] for k, c in check.items()})
    out["losses"] = gathered
    mismatch = check_losses(gathered)
    if mismatch:
        out["mismatch"] = mismatch
        return out

    # --- warm-up, then the timed steps, interleaved ------------------------------------------------------
    def one(v):
        v.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        if not (v.rank0_only and rank != 0):
            v.step(idx, tgt)
            if job["optimizer"]:
                v.optimizer_step()
            _sync(device)
        dt = time.perf_counter() - t0
        return dt if not (v.rank0_only and rank != 0) else 0.0

    for _ in range(job["warmup"]):
        for v in variants.values():
            one(v)
    times = {name: [] for name in variants}
    for _ in range(job["steps"]):
        for name, v in variants.items():
            times[name].append(one(v))
    for v in variants.values():
        v.zero_grad()
    dist.barrier()
    out["times"] = times

    # --- memory of one step, per variant --------------------------------------------------------------
    mem = {}
    for name, v in variants.items():
        dist.barrier()
        if not (v.rank0_only and rank != 0):
            mem[name] = _peak_step_bytes(v, idx, tgt, device)
    dist.barrier()
    out["peak_bytes"] = mem

    # --- optional: top ops per variant (rank 0 keeps the tables) -----------------------------------------
    if job.get("profile"):
        tables = {}
        for name, v in variants.items():
            dist.barrier()
            if not (v.rank0_only and rank != 0):
                table = _profile_table(v, idx, tgt, job["profile"])
                if rank == 0:
                    tables[name] = table
        dist.barrier()
        out["profile"] = tables

    out["max_rss_mb"] = _max_rss_mb()
    out["rss_start_mb"] = rss_start
    autoshard_v = variants.get("autoshard")
    if autoshard_v is not None:
        out["autoshard_compile_s"] = autoshard_v.pm.program.compile_seconds
    return out


# --- the parent ---------------------------------------------------------------------------------------
def _summary(per_rank, job):
    """Fold the ranks' reports into one row per variant."""
    r0 = per_rank[0]
    tp = len(per_rank)
    rows = {}
    for name in job["variants"]:
        if name in r0["unavailable"]:
            rows[name] = dict(available=False, reason=r0["unavailable"][name])
            continue
        steps = [max(rep["times"][name][s] for rep in per_rank) for s in range(job["steps"])]
        c = r0["check"][name]
        calls, nbytes = c["calls"], c["bytes"]
        row = dict(
            available=True,
            median_ms=1e3 * statistics.median(steps) if steps else float("nan"),
            min_ms=1e3 * min(steps) if steps else float("nan"),
            step_ms=[1e3 * s for s in steps],
            loss=c["loss"],
            calls=calls, bytes=nbytes,
            calls_per_step=sum(calls.values()), bytes_per_step=sum(nbytes.values()),
            calls_by_kind=_by_kind(calls), bytes_by_kind=_by_kind(nbytes),
            comm_source="pm.comm_counts()" if name == "autoshard" else "CommTracer",
            peak_mb=max(rep["peak_bytes"][name] for rep in per_rank if name in rep["peak_bytes"]) / 2**20,
            build_s=max(rep["build_s"][name] for rep in per_rank),
        )
        if name == "autoshard":
            row.update(plan_calls=c["plan_calls"], plan_bytes=c["plan_bytes"], traced_calls=c["traced_calls"],
                       traced_bytes=c["traced_bytes"], compile_s=r0.get("autoshard_compile_s"))
        rows[name] = row
    meg = rows.get("megatron", {})
    for name, row in rows.items():
        if row.get("available") and meg.get("available"):
            row["vs_megatron"] = row["median_ms"] / meg["median_ms"]
            row["vs_megatron_min"] = row["min_ms"] / meg["min_ms"]
    return dict(tp=tp, vocab=job["vocab"], variants=rows, losses=r0["losses"],
                max_rss_mb=[rep["max_rss_mb"] for rep in per_rank],
                warnings=[w for rep in per_rank for w in rep["warnings"]],
                profile=r0.get("profile") or {})


def _without_axis(counter):
    """autoshard counts by (axis, phase, kind); the dispatcher-level tracer by (phase, kind)."""
    out = Counter()
    for (_, phase, kind), n in counter.items():
        out[phase, kind] += n
    return out


def _by_kind(d):
    out = {}
    for key, n in d.items():
        kind = key.split("/", 1)[1]
        out[kind] = out.get(kind, 0) + n
    return out


def _targets(runs):
    """The issue's targets, measured (not asserted)."""
    lines = []
    for run in runs:
        v = run["variants"]
        a, m, d = v.get("autoshard", {}), v.get("megatron", {}), v.get("dtensor", {})
        tag = f"tp={run['tp']} vocab={run['vocab']}"
        if a.get("available") and m.get("available"):
            ratio = a["vs_megatron"]
            lines.append(f"{tag}: autoshard/Megatron median step time {ratio:.3f} (target <= 1.02): "
                         f"{'MET' if ratio <= 1.02 else 'MISSED'}")
            ok_c = a["calls_per_step"] <= m["calls_per_step"]
            ok_b = a["bytes_per_step"] <= m["bytes_per_step"]
            lines.append(f"{tag}: collectives/step autoshard {a['calls_per_step']} vs Megatron {m['calls_per_step']}, "
                         f"bytes/step {a['bytes_per_step'] / 2**20:.2f} MiB vs {m['bytes_per_step'] / 2**20:.2f} MiB "
                         f"(target <=): {'MET' if ok_c and ok_b else 'MISSED'}")
        if a.get("available") and d.get("available"):
            faster = a["median_ms"] < d["median_ms"]
            lines.append(f"{tag}: autoshard {a['median_ms']:.1f} ms vs DTensor {d['median_ms']:.1f} ms "
                         f"(target: faster): {'MET' if faster else 'MISSED'}")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=DEFAULTS["tp"], help="tensor-parallel sizes")
    p.add_argument("--vocab", type=int, nargs="+", default=DEFAULTS["vocab"], help="vocabulary sizes")
    p.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    p.add_argument("--hidden", type=int, default=DEFAULTS["hidden"])
    p.add_argument("--heads", type=int, default=DEFAULTS["heads"])
    p.add_argument("--seq", type=int, default=DEFAULTS["seq"])
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="untimed steps per variant first")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--optimizer", action="store_true",
                   help="time an AdamW step with each forward+backward (each variant on its own parameters)")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="also write the top ROWS ops (self CPU time) of each variant on rank 0")
    p.add_argument("--out", default=OUT, help="directory for tp_results.{md,json,png}; 'none' writes nothing")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per (tp, vocab) job")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv=None) -> dict:
    """Run the sweep; returns the results (also written to ``--out``). Raises ``LossMismatch`` on wrong losses."""
    from benchmarks import report

    args = parse_args(argv)
    variants = list(dict.fromkeys(args.variants))
    if torch.cuda.is_available() and "single_nt" in variants:
        variants.remove("single_nt")  # threads mean nothing on a GPU
    runs, started = [], time.time()
    for tp in args.tp:
        if backend() == "nccl" and torch.cuda.device_count() < tp:
            print(f"[benchmarks.tp] tp={tp} skipped: needs {tp} GPUs, this machine has {torch.cuda.device_count()}",
                  flush=True)
            continue
        for vocab in args.vocab:
            job = dict(vocab=vocab, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                       batch=args.batch, steps=args.steps, warmup=args.warmup, seed=args.seed, variants=variants,
                       profile=args.profile, optimizer=args.optimizer)
            print(f"[benchmarks.tp] tp={tp} vocab={vocab}: {args.warmup} warm-up + {args.steps} timed steps "
                  f"x {len(variants)} variants on {tp} {backend()} ranks ...", flush=True)
            t0 = time.perf_counter()
            per_rank = launch(_bench_rank, tp, job, timeout=args.timeout)
            if any("mismatch" in rep for rep in per_rank):
                msg = next(rep["mismatch"] for rep in per_rank if "mismatch" in rep)
                raise LossMismatch(f"tp={tp} vocab={vocab}: {msg}. Aborting: a benchmark of a wrong program "
                                   "is worthless.")
            run = _summary(per_rank, job)
            run["wall_s"] = time.perf_counter() - t0
            for w in run["warnings"]:
                print(w, flush=True)
            for name, row in run["variants"].items():
                if not row.get("available"):
                    print(f"    {name:10s} skipped: {row['reason']}", flush=True)
                else:
                    print(f"    {name:10s} median {row['median_ms']:9.2f} ms  min {row['min_ms']:9.2f} ms  "
                          f"{row['calls_per_step']:4d} collectives  {row['bytes_per_step'] / 2**20:8.2f} MiB/step",
                          flush=True)
            runs.append(run)
    if not runs:   # never overwrite the saved results with empty tables
        raise SystemExit(f"[benchmarks.tp] no tp size in {args.tp} fits this machine's "
                         f"{torch.cuda.device_count()} GPU(s): pass --tp 1 (or fewer ranks), or AUTOSHARD_BACKEND=gloo")
    results = dict(
        config=dict(tp=args.tp, vocab=args.vocab, layers=args.layers, hidden=args.hidden, heads=args.heads,
                    seq=args.seq, batch=args.batch, steps=args.steps, warmup=args.warmup, seed=args.seed,
                    variants=variants, rtol=RTOL),
        env=report.environment(),
        runs=runs,
        targets=_targets(runs),
        wall_s=time.time() - started,
    )
    if args.out and args.out.lower() != "none":
        paths = report.write_all(results, args.out)
        results["files"] = paths
        print("[benchmarks.tp] wrote " + ", ".join(paths), flush=True)
    print(report.markdown(results), flush=True)
    return results


if __name__ == "__main__":
    try:
        main()
    except LossMismatch as e:
        print(f"ERROR: {e}", file=sys.stderr)
        sys.exit(2)
    except RankError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        sys.exit(1)
