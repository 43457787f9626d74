"""Zero-bubble pipelines against 1F1B and against torch.distributed.pipelining's own schedules.

    python -m benchmarks.pp_zero_bubble [--pp 2] [--m 8] [--steps 6] [--out benchmarks/results]

One job of ``--pp`` (2) gloo ranks (NCCL on GPUs) trains the built-in GPT (8 layers, untied head, the same
cuts and weights everywhere) six ways: autoshard's ``schedule="1f1b"``, ``"zb-h1"`` and ``"zb-v"`` (2p
stages, two a rank in a V), and torch's ``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` (ZB1P, one
stage a rank) and ``ScheduleZBVZeroBubble`` (on ZB-V's 2p stages). The losses must agree
first; then the four are timed in turn, step after step (A B C D A B C D ...), a step's time being the
slowest rank's. Reported:

- step time (median) and each against torch's 1F1B and torch's zero-bubble schedule;
- autoshard's measured bubble (idle over busy, all ranks, from the executor's action timestamps) and the
  closed forms: ``(p-1)/m`` for 1F1B, ``(p-1)(F+B-W) / (m (F+B+W))`` for ZB-H1, from the measured mean
  F, B and W (``(p-1)/(3m)`` when they are equal);
- peak saved activations per rank (the executor's count for autoshard, which holds what B keeps for W;
  a ``saved_tensors_hooks`` count around torch's step);
- the measured timelines, ``zb_timeline_1f1b.svg`` and ``zb_timeline_zb-h1.svg``.

Writes ``zero_bubble.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics

import torch
import torch.distributed as dist

from autoshard.launcher import launch
from autoshard.runtime.comm import collective_device
from benchmarks.pp import OUT, LiveSaved, _batch, _gpt, _timed_step, loss_rtol


def _means(timeline) -> dict:
    """Mean seconds of each compute kind over all stages of a measured timeline."""
    out = {}
    for kind in ("F", "B", "W"):
        xs = [s.end - s.start for spans in timeline.spans.values() for s in spans if s.action.kind.value == kind]
        out[kind] = statistics.mean(xs) if xs else 0.0
    return out


def _rank(rank, world, job):
    import autoshard
    from benchmarks.pp_torch import torch_pipeline
    pp, m, layers = world, job["m"], job["layers"]
    cuts = [layers * k // pp for k in range(1, pp)]
    model = _gpt(layers, job["vocab"], job["hidden"], job["seq"], tie=False)
    x, y = _batch(job["vocab"], job["batch"], job["seq"], 0)
    mesh = autoshard.init_mesh(pp=pp)
    vcuts = [layers * k // (2 * pp) for k in range(1, 2 * pp)]       # ZB-V: 2p stages, two a rank
    ours = {name: autoshard.parallelize(copy.deepcopy(model), mesh, (x, y), microbatches=m, schedule=name,
                                        pipeline_cuts=vcuts if name == "zb-v" else cuts)
            for name in ("1f1b", "zb-h1", "zb-v")}
    theirs = {name: torch_pipeline(copy.deepcopy(model), cuts, rank, pp, 1, m, zero_bubble=name == "torch zb")
              for name in ("torch 1f1b", "torch zb")}
    theirs["torch zbv"] = torch_pipeline(copy.deepcopy(model), vcuts, rank, pp, 2, m, v_shape=True)
    last = rank == pp - 1

    def torch_step(sched, holds_loss=last):
        losses = []
        args = (x,) if rank == 0 else ()
        sched.step(*args, target=y, losses=losses) if holds_loss else sched.step(*args)
        t = torch.tensor([float(torch.stack(losses).mean()) if losses else 0.0], device=collective_device())
        dist.all_reduce(t)
        return float(t)

    steps = {name: (lambda pm=pm: float(pm.step(x, y))) for name, pm in ours.items()}
    # ZB-V's last stage (the loss) is on rank 0, beside the first
    steps.update({name: (lambda s=s, name=name: torch_step(s, rank == 0 if name == "torch zbv" else last))
                  for name, (s, _) in theirs.items()})
    params = [p for pm in ours.values() for p in pm.parameters()] + \
             [p for _, mods in theirs.values() for mod in mods for p in mod.parameters()]
    peak, losses = {}, {}
    for name, pm in ours.items():
        pm.measure_memory = True
        losses[name] = steps[name]()
        pm.measure_memory = False
        peak[name] = max(pm.last_timeline.peak_activation_bytes.values())
    for name, (_, mods) in theirs.items():
        counter = LiveSaved([p for mod in mods for p in mod.parameters()])
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            losses[name] = steps[name]()
        peak[name] = counter.peak
    ref = losses["torch 1f1b"]
    for name, loss in losses.items():
        if abs(loss - ref) > loss_rtol() * abs(ref):
            raise RuntimeError(f"losses differ: {name} {loss} vs torch 1f1b {ref}")
    times = {name: [] for name in steps}
    bubbles = {name: [] for name in ours}
    kinds = {name: [] for name in ours}
    for step in range(job["warmup"] + job["steps"]):
        for name, fn in steps.items():
            _, t = _timed_step(fn)
            if step >= job["warmup"]:
                times[name].append(t)
                if name in ours:
                    tl = ours[name].measured_timeline()
                    bubbles[name].append(tl.bubble_over_ideal)
                    kinds[name].append(_means(tl))
        for p in params:
            p.grad = None
    svgs = {}
    for name, pm in ours.items():
        tl = pm.measured_timeline()          # every rank: it gathers the ranks' spans
        if rank == 0 and job["out"] != "none":
            path = os.path.join(job["out"], f"zb_timeline_pp{world}_{name}.svg")
            tl.to_svg(path)
            svgs[name] = os.path.basename(path)
    top = {k: torch.tensor([float(v)], device=collective_device()) for k, v in peak.items()}
    for t in top.values():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(loss=ref, step={k: statistics.median(v) for k, v in times.items()},
                bubble={k: statistics.median(v) for k, v in bubbles.items()},
                kinds={k: {c: statistics.mean(d[c] for d in v) for c in ("F", "B", "W")} for k, v in kinds.items()},
                peak={k: float(v) for k, v in top.items()}, svgs=svgs)


def closed_forms(pp: int, m: int, kinds: dict) -> dict:
    f, b, w = kinds["zb-h1"]["F"], kinds["zb-h1"]["B"], kinds["zb-h1"]["W"]
    return {"1f1b": (pp - 1) / m, "zb-h1": (pp - 1) * (f + b - w) / (m * (f + b + w))}


def markdown(res: dict, job: dict, pp: int = 2) -> str:
    m = job["m"]
    closed = closed_forms(pp, m, res["kinds"])
    s, pk = res["step"], res["peak"]
    lines = ["# Zero-bubble pipelines (`python -m benchmarks.pp_zero_bubble`)", "",
             f"GPT: {job['layers']} layers (untied head), hidden {job['hidden']}, seq {job['seq']}, vocab {job['vocab']}, "
             f"batch {job['batch']} in m={m} microbatches; pp={pp} gloo ranks (on 2 cores), {job['layers'] // pp} layers a "
             f"stage, the same cuts and weights for all four; {job['steps']} timed steps after {job['warmup']}, in turn; "
             f"loss {res['loss']:.6f} on all four.", "",
             "| schedule | step ms | vs torch 1F1B | vs torch ZB | measured bubble | closed form | peak saved MiB |",
             "|---|---|---|---|---|---|---|"]
    for name in ("1f1b", "zb-h1", "zb-v", "torch 1f1b", "torch zb", "torch zbv"):
        bubble = f"{res['bubble'][name]:.3f}" if name in res["bubble"] else "-"
        form = f"{closed[name]:.3f}" if name in closed else "-"
        lines.append(f"| {'autoshard ' + name if name in res['bubble'] else name} | {s[name] * 1e3:.1f} | "
                     f"{s[name] / s['torch 1f1b']:.3f} | {s[name] / s['torch zb']:.3f} | {bubble} | {form} | "
                     f"{pk[name] / 2**20:.2f} |")
    k = res["kinds"]["zb-h1"]
    lines += ["", f"ZB-H1's measured mean F, B, W: {k['F'] * 1e3:.2f}, {k['B'] * 1e3:.2f}, {k['W'] * 1e3:.2f} ms "
              f"(1F1B's B, input and weight gradients together: {res['kinds']['1f1b']['B'] * 1e3:.2f} ms).",
              f"Peak saved activations, ZB-H1 over 1F1B: {pk['zb-h1'] / pk['1f1b']:.3f}; ZB-V over 1F1B: "
              f"{pk['zb-v'] / pk['1f1b']:.3f}. ZB-V runs 2p stages (two a rank, in a V) on the same layers; its "
              "ideal bubble is about 0 (the paper's, with F = B = W).", ""]
    for name, path in res["svgs"].items():
        lines.append(f"![{name} measured]({path})")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=OUT)
    ns = ap.parse_args(argv)
    job = {k: v for k, v in vars(ns).items() if k not in ("timeout", "pp")}
    if ns.out != "none":
        os.makedirs(ns.out, exist_ok=True)
    res = launch(_rank, ns.pp, job, timeout=ns.timeout)[0]
    text = markdown(res, job, ns.pp)
    print(text)
    if ns.out != "none":
        with open(os.path.join(ns.out, f"zero_bubble{'' if ns.pp == 2 else f'_pp{ns.pp}'}.md"), "w") as f:
            f.write(text)
    return res


if __name__ == "__main__":
    main()
