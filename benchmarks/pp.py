"""Pipeline benchmark: bubbles, torch.distributed.pipelining, balanced cuts, and the simulator's accuracy.

    python -m benchmarks.pp                 # everything (about 10 min on 2 CPU cores)
    python -m benchmarks.pp --quick         # fewer sizes and steps (a smoke run)
    python -m benchmarks.pp --only torch    # one section: bubble | torch | balance

Every section spawns its ranks with gloo (NCCL on GPUs), trains the built-in GPT with ``pm.step`` and
times steps after warm-up, a step's time being the max over ranks. Sections:

1. **Bubble**: the measured bubble (idle over busy time, summed over ranks, from the executor's action
   timestamps) against ``(p-1)/m`` (1F1B) and ``(p-1)/(v m)`` (interleaved, v=2), for p = 2, 4 and
   m = 4, 8, 16, with equal layers per stage and a small vocabulary (stages of near-equal cost), at
   ``--bubble-hidden``/``--bubble-seq`` (256/128: a microbatch of one sequence is milliseconds of work).
2. **torch.distributed.pipelining**: ``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` on the same model,
   weights, cuts and mesh, timed interleaved in one job (A B A B ...) after checking the losses agree.
   Peak saved-activation bytes per rank for both (a ``saved_tensors_hooks`` count of live storages).
3. **Balanced vs uniform cuts** on a model whose embedding and head are heavy (vocab 50304, 8 layers,
   p = 4): predicted and measured step time for both.
4. **Simulator accuracy**: from sections 1 and 3, the cost model's predicted step time, the simulator's
   prediction from the measured per-stage times, and the measured step; predicted and measured peak
   activation bytes.

On 2 CPU cores, runs with 4 ranks share cores: their absolute times and bubbles include that contention.
Writes ``pp_results.md`` and ``pp_results.json`` into ``--out`` (default ``benchmarks/results``).
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

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class LiveSaved:
    """Peak bytes of tensors autograd holds for backward (each storage counted once while any holder
    lives): the activation memory of a step, for any executor."""

    def __init__(self, params=()):
        self.live, self.peak, self.refs = 0, 0, {}
        self.exclude = {p.untyped_storage().data_ptr() for p in params}

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.exclude:
            return _Held(None, key, t)
        if key not in self.refs:
            self.refs[key] = [0, t.untyped_storage().nbytes()]
            self.live += self.refs[key][1]
            self.peak = max(self.peak, self.live)
        self.refs[key][0] += 1
        return _Held(self, key, t)

    @staticmethod
    def unpack(h):
        return h.t

    def release(self, key):
        ref = self.refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self.refs[key]


class _Held:
    def __init__(self, owner, key, t):
        self.owner, self.key, self.t = owner, key, t

    def __del__(self):
        if self.owner is not None:
            self.owner.release(self.key)


def _gpt(layers, vocab, hidden, seq, tie):
    """The benchmark GPT, on the rank's device (its GPU under NCCL), so the torch baselines run where
    autoshard does."""
    from autoshard.models import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=seq, vocab_size=vocab, n_layer=layers, n_head=4, n_embd=hidden,
                         tie_weights=tie)).to(collective_device())


def _batch(vocab, batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)
    return x.to(collective_device()), y.to(collective_device())


def _max_over_ranks(seconds: float) -> float:
    t = torch.tensor([seconds], device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _sync():
    if collective_device().type == "cuda":   # host clocks time the GPU's work only once it is done
        torch.cuda.synchronize()


def _timed_step(fn):
    _sync()
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    _sync()
    return out, _max_over_ranks(time.perf_counter() - start)


def _measured_costs(timeline, stages):
    """Mean forward and backward seconds per stage from a measured timeline's spans."""
    fwd, bwd = {s: [] for s in range(stages)}, {s: [] for s in range(stages)}
    for spans in timeline.spans.values():
        for span in spans:
            kind = span.action.kind.value
            if kind in ("F", "B"):
                (fwd if kind == "F" else bwd)[span.action.stage].append(span.end - span.start)
    return [statistics.mean(fwd[s]) for s in range(stages)], [statistics.mean(bwd[s]) for s in range(stages)]


def _simulated_from(pm, timeline):
    from autoshard.ir.simulator import Costs, simulate
    sched = pm.schedule
    f, b = _measured_costs(timeline, sched.num_stages)
    acts = tuple(c.activation_bytes for c in pm.program.plan.costs)
    return simulate(sched, Costs(tuple(f), tuple(b), acts)).step_time


# --- 1 and 4: bubbles --------------------------------------------------------------------------------
def _bubble_rank(rank, world, job):
    import autoshard
    pp, v, m, steps = job["pp"], job["v"], job["m"], job["steps"]
    layers = 2 * pp * v
    model = _gpt(layers, 64, job["hidden"], job["seq"], tie=False)
    x, y = _batch(64, m, job["seq"], 0)
    cuts = [layers * k // (pp * v) for k in range(1, pp * v)]
    pm = autoshard.parallelize(model, autoshard.init_mesh(pp=pp), (x, y), microbatches=m,
                               schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v, pipeline_cuts=cuts)
    pm.measure_memory = True      # the bubble runs report peak saved bytes too (a few % slower)
    times, bubbles, sims, peaks = [], [], [], []
    for step in range(job["warmup"] + steps):
        _, t = _timed_step(lambda: pm.step(x, y))
        tl = pm.measured_timeline()
        if step >= job["warmup"]:
            times.append(t)
            bubbles.append(tl.bubble_over_ideal)
            sims.append(_simulated_from(pm, tl))
            peaks.append(max(tl.peak_activation_bytes.values()))
    plan = pm.program.plan
    return dict(step=statistics.median(times), bubble=statistics.median(bubbles), sim_step=statistics.median(sims),
                predicted=plan.predicted_step, peak=max(peaks),
                predicted_peak=max(_activation_peak(pm).values()))


def _activation_peak(pm):
    """The simulator's peak activation bytes per rank under the cost model's per-stage bytes."""
    from autoshard.ir.simulator import Costs, simulate
    costs = pm.program.plan.costs
    sim = simulate(pm.schedule, Costs(tuple(c.forward_seconds for c in costs),
                                      tuple(2 * c.forward_seconds for c in costs),
                                      tuple(c.activation_bytes for c in costs)))
    return sim.peak_activation_bytes


def bubbles(args) -> list:
    rows = []
    for pp in (2, 4):
        for m in ((4, 8) if args.quick else (4, 8, 16)):
            for v in (1, 2):
                job = dict(pp=pp, v=v, m=m, steps=max(2, args.steps // 2), warmup=1, hidden=args.bubble_hidden,
                           seq=args.bubble_seq)
                res = launch(_bubble_rank, pp, job, timeout=args.timeout)[0]
                ideal = (pp - 1) / (v * m)
                rows.append(dict(pp=pp, v=v, m=m, closed_form=ideal, **res))
                print(f"bubble p={pp} v={v} m={m}: measured {res['bubble']:.3f}, closed form {ideal:.3f}, "
                      f"step {res['step'] * 1e3:.1f} ms", flush=True)
    return rows


def loss_rtol() -> float:
    """How close the two sides' losses must be before they are timed: fp32 on the CPU agrees to 1e-5; on a
    GPU the kernels (cuBLAS, the generated ones, the chunked loss) sum in other orders (gpu_check's 1e-4)."""
    return 1e-4 if collective_device().type == "cuda" else 1e-5


# --- 2: torch.distributed.pipelining -------------------------------------------------------------------
def _torch_rank(rank, world, job):
    import autoshard
    from benchmarks.pp_torch import torch_pipeline
    pp, v, m = job["pp"], job["v"], job["m"]
    layers = job["layers"]
    cuts = [layers * k // (pp * v) for k in range(1, pp * v)]
    model = _gpt(layers, job["vocab"], job["hidden"], job["seq"], tie=False)
    ours_model, theirs_model = copy.deepcopy(model), copy.deepcopy(model)
    x, y = _batch(job["vocab"], job["batch"], job["seq"], 0)
    mesh = autoshard.init_mesh(pp=pp)
    kw = dict(microbatches=m, schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
    pm = autoshard.parallelize(ours_model, mesh, (x, y), pipeline_cuts=cuts, **kw)
    balanced = autoshard.parallelize(copy.deepcopy(model), mesh, (x, y), **kw)   # our own cuts
    sched, modules = torch_pipeline(theirs_model, cuts, rank, pp, v, m)
    theirs_params = [p for mod in modules for p in mod.parameters()]
    last = rank == (pp * v - 1) % pp

    def theirs():
        losses = []
        if rank == 0:
            sched.step(x, target=y, losses=losses) if last else sched.step(x)
        else:
            sched.step(target=y, losses=losses) if last else sched.step()
        t = torch.tensor([float(torch.stack(losses).mean()) if losses else 0.0], device=collective_device())
        dist.all_reduce(t)
        return float(t)

    def ours():
        return float(pm.step(x, y))

    def ours_balanced():
        return float(balanced.step(x, y))

    # peak saved activations: the executor's own count for autoshard (a saved_tensors_hooks count like
    # LiveSaved, per microbatch, held from forward to backward), LiveSaved around torch's step
    pm.measure_memory = True
    loss = ours()
    pm.measure_memory = False
    mem = {"autoshard": (loss, max(pm.last_timeline.peak_activation_bytes.values()))}
    counter = LiveSaved(theirs_params)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        loss = theirs()
    mem["torch"] = (loss, counter.peak)
    for p in list(pm.parameters()) + theirs_params:
        p.grad = None
    if abs(mem["autoshard"][0] - mem["torch"][0]) > loss_rtol() * abs(mem["torch"][0]):
        raise RuntimeError(f"losses differ: autoshard {mem['autoshard'][0]} vs torch {mem['torch'][0]}")
    times = {"autoshard": [], "torch": [], "balanced": []}
    for step in range(job["warmup"] + job["steps"]):
        for name, fn in (("autoshard", ours), ("torch", theirs), ("balanced", ours_balanced)):
            _, t = _timed_step(fn)
            if step >= job["warmup"]:
                times[name].append(t)
        for p in list(pm.parameters()) + theirs_params + list(balanced.parameters()):
            p.grad = None
    if collective_device().type == "cuda":   # the allocator's peak over one step: weights, grads, transfers too
        for name, fn in (("autoshard", ours), ("torch", theirs)):   # above what is resident before the step:
            torch.cuda.synchronize()                                  # every copy of the model this job holds
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            mem[f"{name} allocated"] = (None, torch.cuda.max_memory_allocated() - base)
        for p in list(pm.parameters()) + theirs_params:
            p.grad = None
    peak = {k: torch.tensor([float(v[1])], device=collective_device()) for k, v in mem.items()}
    for t in peak.values():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(loss=mem["autoshard"][0], torch_loss=mem["torch"][0],
                balanced=statistics.median(times["balanced"]),
                balanced_layers=[list(c.layers) for c in balanced.program.plan.costs],
                ours=statistics.median(times["autoshard"]), theirs=statistics.median(times["torch"]),
                ours_min=min(times["autoshard"]), theirs_min=min(times["torch"]),
                ours_peak=float(peak["autoshard"]), theirs_peak=float(peak["torch"]),
                ours_allocated=float(peak["autoshard allocated"]) if "autoshard allocated" in peak else None,
                theirs_allocated=float(peak["torch allocated"]) if "torch allocated" in peak else None)


def versus_torch(args) -> list:
    rows = []
    for v in (1, 2):
        job = dict(pp=2, v=v, m=args.m, layers=8, vocab=args.vocab, hidden=args.hidden, seq=args.seq,
                   batch=args.batch, steps=args.steps, warmup=args.warmup)
        res = launch(_torch_rank, 2, job, timeout=args.timeout)[0]
        rows.append(dict(pp=2, v=v, m=args.m, ratio=res["ours"] / res["theirs"],
                         balanced_ratio=res["balanced"] / res["theirs"], **res))
        print(f"vs torch pp=2 v={v}: autoshard {res['ours'] * 1e3:.1f} ms (same cuts), {res['balanced'] * 1e3:.1f} ms "
              f"(own cuts {res['balanced_layers']}), torch {res['theirs'] * 1e3:.1f} ms: "
              f"{res['ours'] / res['theirs']:.3f}x and {res['balanced'] / res['theirs']:.3f}x; peak saved "
              f"{res['ours_peak'] / 2**20:.1f} vs {res['theirs_peak'] / 2**20:.1f} MiB", flush=True)
    return rows


# --- 3: balanced vs uniform --------------------------------------------------------------------------
def _balance_rank(rank, world, job):
    import autoshard
    from autoshard.passes.pipeline_split import uniform_cuts
    model = _gpt(8, 50304, job["hidden"], job["seq"], tie=True)
    x, y = _batch(50304, job["batch"], job["seq"], 0)
    mesh = autoshard.init_mesh(pp=world)
    out = {}
    pms = {"balanced": autoshard.parallelize(copy.deepcopy(model), mesh, (x, y), microbatches=job["m"]),
           "uniform": autoshard.parallelize(copy.deepcopy(model), mesh, (x, y), microbatches=job["m"],
                                            pipeline_cuts=list(uniform_cuts(8, world)))}
    times = {k: [] for k in pms}
    sims = {k: [] for k in pms}
    for pm in pms.values():
        pm.measure_memory = True
    for step in range(job["warmup"] + job["steps"]):
        for name, pm in pms.items():
            _, t = _timed_step(lambda: pm.step(x, y))
            tl = pm.measured_timeline()
            for p in pm.parameters():
                p.grad = None
            if step >= job["warmup"]:
                times[name].append(t)
                sims[name].append(_simulated_from(pm, tl))
    for name, pm in pms.items():
        out[name] = dict(layers=[list(c.layers) for c in pm.program.plan.costs], predicted=pm.program.plan.predicted_step,
                         step=statistics.median(times[name]), sim_step=statistics.median(sims[name]))
    return out


def balance(args) -> dict:
    """p = 4 as the issue asks, and p = 2: on 2 cores, 4 ranks share cores and time each other."""
    out = {}
    for pp in (2, 4):
        job = dict(m=8, hidden=args.hidden, seq=args.seq, batch=8, steps=args.steps, warmup=args.warmup)
        res = launch(_balance_rank, pp, job, timeout=args.timeout)[0]
        for name, r in res.items():
            out[f"p={pp} {name}"] = r
            print(f"p={pp} {name}: layers {r['layers']}, predicted {r['predicted'] * 1e3:.1f} ms, measured "
                  f"{r['step'] * 1e3:.1f} ms", flush=True)
    return out


# --- report ------------------------------------------------------------------------------------------
def markdown(res: dict) -> str:
    L = ["# Pipeline benchmark", "", f"Config: {res['config']}", ""]
    if res.get("bubble"):
        L += [f"## Bubble (idle / busy, all ranks; h={res['config']['bubble_hidden']}, s={res['config']['bubble_seq']}, "
              "one sequence per microbatch, 2 layers per stage)", "",
              "| p | v | m | measured | closed form | step ms | cost-model predicted ms | simulated from measured stage times ms | peak saved MiB | predicted peak MiB |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["bubble"]:
            L.append(f"| {r['pp']} | {r['v']} | {r['m']} | {r['bubble']:.3f} | {r['closed_form']:.3f} | "
                     f"{r['step'] * 1e3:.1f} | {r['predicted'] * 1e3:.1f} | {r['sim_step'] * 1e3:.1f} | "
                     f"{r['peak'] / 2**20:.2f} | {r['predicted_peak'] / 2**20:.2f} |")
    if res.get("torch"):
        L += ["", "## Against torch.distributed.pipelining (same model, weights, cuts; interleaved timing)", "",
              "| p | v | m | loss (ours / torch) | autoshard ms (torch's cuts) | torch ms | ratio (median) | ratio (min) | "
              "autoshard ms (its own cuts) | ratio | peak saved MiB ours / torch | GPU step peak above resident MiB ours / torch |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["torch"]:
            L.append(f"| {r['pp']} | {r['v']} | {r['m']} | {r['loss']:.6f} / {r['torch_loss']:.6f} | "
                     f"{r['ours'] * 1e3:.1f} | {r['theirs'] * 1e3:.1f} | {r['ratio']:.3f} | "
                     f"{r['ours_min'] / r['theirs_min']:.3f} | {r['balanced'] * 1e3:.1f} {r['balanced_layers']} | "
                     f"{r['balanced_ratio']:.3f} | {r['ours_peak'] / 2**20:.2f} / {r['theirs_peak'] / 2**20:.2f} | "
                     + (f"{r['ours_allocated'] / 2**20:.1f} / {r['theirs_allocated'] / 2**20:.1f} |"
                        if r.get("ours_allocated") is not None else "- (CPU) |"))
    if res.get("balance"):
        L += ["", "## Balanced vs uniform cuts (vocab 50304, 8 layers, m=8; p=4 runs 4 ranks on 2 cores)", "",
              "| cuts | layers per stage | predicted ms | simulated from measured stage times ms | measured ms |",
              "|---|---|---|---|---|"]
        for name, r in res["balance"].items():
            L.append(f"| {name} | {r['layers']} | {r['predicted'] * 1e3:.1f} | {r['sim_step'] * 1e3:.1f} | "
                     f"{r['step'] * 1e3:.1f} |")
    return "\n".join(L) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["bubble", "torch", "balance"], default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--bubble-hidden", type=int, default=256,
                    help="the bubble runs use heavier stages, so per-transfer overheads do not dominate")
    ap.add_argument("--bubble-seq", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.quick else 6
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    res = {"config": {k: v for k, v in vars(args).items() if k != "out"}}
    sections = {"bubble": bubbles, "torch": versus_torch, "balance": balance}
    for name, fn in sections.items():
        if args.only in (None, name):
            res[name] = fn(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pp_results.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(args.out, "pp_results.md"), "w") as f:
        f.write(markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
