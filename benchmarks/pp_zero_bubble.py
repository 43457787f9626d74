"""Zero-bubble pipelines against 1F1B and against torch.distributed.pipelining's own schedules.

    python -m benchmarks.pp_zero_bubble [--pp 2] [--m 8] [--steps 6] [--out benchmarks/results]

One job of ``--pp`` (2) gloo ranks (NCCL on GPUs) trains the built-in GPT (8 layers, untied head, the same
weights everywhere) many ways: autoshard's ``schedule="1f1b"``, ``"zb-h1"``, ``"zb-h2"`` and ``"zb-v"`` (2p stages,
two a rank in a V) on torch's layer cuts, the same four and ``"auto"`` on autoshard's own cost-balanced cuts (which may
fall inside a layer, so the LM head's stage takes fewer layers), and torch's ``Schedule1F1B``,
``ScheduleInterleavedZeroBubble`` (ZB1P, one stage a rank) and ``ScheduleZBVZeroBubble`` (on ZB-V's 2p
stages). The losses must agree first; then they are timed in turn, step after step (A B C ... A B C
...), a step's time being the slowest rank's. Reported:

- step time (median) and each against torch's 1F1B and torch's zero-bubble schedule;
- autoshard's measured bubble (idle over busy, all ranks, from the executor's action timestamps); the
  bubble of the simulator's replay of the same schedule with each stage's measured F, B and W (what the
  schedule leaves on these stages with a free runtime: its gap to the closed form is the stages'
  imbalance, the measured bubble's gap to it the runtime's); and the closed forms: ``(p-1)/m`` for 1F1B,
  ``(p-1)(F+B-W) / (m (F+B+W))`` for ZB-H1, from the measured mean F, B and W (``(p-1)/(3m)`` when they
  are equal);
- peak saved activations per rank (the executor's count for autoshard, which holds what B keeps for W;
  a ``saved_tensors_hooks`` count around torch's step);
- the measured timelines, ``zb_timeline_pp<p>_<schedule>.svg``.

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


OWN_CUTS = ("1f1b own cuts", "zb-h1 own cuts", "zb-h2 own cuts", "zb-v own cuts", "auto own cuts")
ROWS = ("1f1b", "zb-h1", "zb-h2", "zb-v") + OWN_CUTS + ("torch 1f1b", "torch zb", "torch zbv")


def _means(timeline, stage=None) -> dict:
    """Mean seconds of each compute kind over all stages of a measured timeline (or over one stage's)."""
    out = {}
    for kind in ("F", "B", "W"):
        xs = [s.end - s.start for spans in timeline.spans.values() for s in spans
              if s.action.kind.value == kind and stage in (None, s.action.stage)]
        out[kind] = statistics.mean(xs) if xs else 0.0
    return out


def replayed_bubble(schedule, timeline) -> float:
    """The bubble the schedule itself leaves with each stage's measured mean F, B and W (the simulator's
    replay, transfers free): what the measured bubble would be with no runtime overhead. Its gap to the
    closed form is the stages' imbalance (the LM head's stage is heavier); the measured bubble's gap to
    it is the runtime's (transfers, waits, the host)."""
    from autoshard.ir.simulator import Costs, simulate
    per = [_means(timeline, s) for s in range(schedule.num_stages)]
    costs = Costs(tuple(k["F"] for k in per), tuple(k["B"] + k["W"] for k in per), (0,) * len(per),
                  weight=tuple(k["W"] for k in per) if schedule.split else None)
    return simulate(schedule, costs).bubble_over_ideal


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
            for name in ("1f1b", "zb-h1", "zb-h2", "zb-v")}
    for name in OWN_CUTS:      # autoshard's cost-balanced cuts (a cut may fall inside a layer)
        ours[name] = autoshard.parallelize(copy.deepcopy(model), mesh, (x, y), microbatches=m,
                                           schedule=name.split()[0])
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
    replayed = {name: [] for name in ours}
    stages = {name: [] for name in ours}            # per timed step, each stage's mean F, B and W
    kinds = {name: [] for name in ours}
    for step in range(job["warmup"] + job["steps"]):
        for name, fn in steps.items():
            _, t = _timed_step(fn)
            if step >= job["warmup"]:
                times[name].append(t)
                if name in ours:
                    tl = ours[name].measured_timeline()
                    bubbles[name].append(tl.bubble_over_ideal)
                    replayed[name].append(replayed_bubble(ours[name].schedule, tl))
                    stages[name].append([_means(tl, s) for s in range(ours[name].schedule.num_stages)])
                    kinds[name].append(_means(tl))
        for p in params:
            p.grad = None
    svgs = {}
    for name, pm in ours.items():
        tl = pm.measured_timeline()          # every rank: it gathers the ranks' spans
        if rank == 0 and job["out"] != "none":
            path = os.path.join(job["out"], f"zb_timeline_pp{world}_{name.replace(' ', '-')}.svg")
            tl.to_svg(path)
            svgs[name] = os.path.basename(path)
    top = {k: torch.tensor([float(v)], device=collective_device()) for k, v in peak.items()}
    for t in top.values():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(loss=ref, step={k: statistics.median(v) for k, v in times.items()},
                bubble={k: statistics.median(v) for k, v in bubbles.items()},
                replayed={k: statistics.median(v) for k, v in replayed.items()},
                stage_kinds={name: [{c: statistics.mean(d[s][c] for d in v) for c in ("F", "B", "W")}
                                    for s in range(ours[name].schedule.num_stages)] for name, v in stages.items()},
                own_cuts={name: ours[name].program.plan.boundaries for name in OWN_CUTS},
                auto=ours["auto own cuts"].schedule.name,
                kinds={k: {c: statistics.mean(d[c] for d in v) for c in ("F", "B", "W")} for k, v in kinds.items()},
                peak={k: float(v) for k, v in top.items()}, svgs=svgs)


def closed_forms(pp: int, m: int, kinds: dict) -> dict:
    """(p-1)/m for 1F1B; Qi et al.'s (p-1)(F+B-W) / (m (F+B+W)) for ZB-H1, from its measured mean F, B, W."""
    out = {"1f1b": (pp - 1) / m, "1f1b own cuts": (pp - 1) / m}
    for name in ("zb-h1", "zb-h1 own cuts"):
        f, b, w = kinds[name]["F"], kinds[name]["B"], kinds[name]["W"]
        out[name] = (pp - 1) * (f + b - w) / (m * (f + b + w))
    return out


def _floor(res: dict, m: int) -> str:
    """What no schedule beats on the balanced stages: the busiest rank's compute, m (F + B + W) of its
    stage, against torch's 1F1B step (a zero bubble and a free runtime would reach it)."""
    busiest = max(m * sum(k[c] for c in "FBW") for k in res["stage_kinds"]["zb-h1 own cuts"])
    return (f"The floor on autoshard's own cuts: the busiest rank's compute, m (F + B + W) = {busiest * 1e3:.1f} ms, "
            f"{busiest / res['step']['torch 1f1b']:.3f} of torch's 1F1B step.")


def markdown(res: dict, job: dict, pp: int = 2) -> str:
    m = job["m"]
    closed = closed_forms(pp, m, res["kinds"])
    s, pk = res["step"], res["peak"]
    lines = ["# Zero-bubble pipelines (`python -m benchmarks.pp_zero_bubble`)", "",
             f"GPT: {job['layers']} layers (untied head), hidden {job['hidden']}, seq {job['seq']}, vocab {job['vocab']}, "
             f"batch {job['batch']} in m={m} microbatches; pp={pp} gloo ranks (on 2 cores), {job['layers'] // pp} layers a "
             "stage, the same cuts and weights for all but the \"own cuts\" rows (autoshard's cost-balanced cuts, "
             f"after {res['own_cuts']}); {job['steps']} timed steps after {job['warmup']}, in turn; "
             f"loss {res['loss']:.6f} on all.", "",
             "| schedule | step ms | vs torch 1F1B | vs torch ZB | measured bubble | replayed from measured stages "
             "| closed form | peak saved MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ROWS:
        bubble = f"{res['bubble'][name]:.3f}" if name in res["bubble"] else "-"
        again = f"{res['replayed'][name]:.3f}" if name in res["replayed"] else "-"
        form = f"{closed[name]:.3f}" if name in closed else "-"
        lines.append(f"| {'autoshard ' + name if name in res['bubble'] else name} | {s[name] * 1e3:.1f} | "
                     f"{s[name] / s['torch 1f1b']:.3f} | {s[name] / s['torch zb']:.3f} | {bubble} | {again} | {form} | "
                     f"{pk[name] / 2**20:.2f} |")
    k = res["kinds"]["zb-h1"]
    lines += ["", f"ZB-H1's measured mean F, B, W: {k['F'] * 1e3:.2f}, {k['B'] * 1e3:.2f}, {k['W'] * 1e3:.2f} ms "
              f"(1F1B's B, input and weight gradients together: {res['kinds']['1f1b']['B'] * 1e3:.2f} ms). Per stage "
              "(F, B, W ms): " + "; ".join(f"{s_}: " + ", ".join(f"{k[c] * 1e3:.2f}" for c in "FBW")
                                          for s_, k in enumerate(res["stage_kinds"]["zb-h1"])) + ".",
              _floor(res, m),
              "The replayed bubble is the simulator's replay of the same schedule with each stage's measured F, B "
              "and W: the closed form assumes equal stages, so the replay's gap to it is the stages' imbalance, "
              "and the measured bubble's gap to the replay is the runtime's.",
              f"Peak saved activations, ZB-H1 over 1F1B: {pk['zb-h1'] / pk['1f1b']:.3f} (on autoshard's own cuts "
              f"{pk['zb-h1 own cuts'] / pk['1f1b own cuts']:.3f}); ZB-H2 over 1F1B: {pk['zb-h2'] / pk['1f1b']:.3f}; "
              f"ZB-V over 1F1B: {pk['zb-v'] / pk['1f1b']:.3f}. ZB-V runs 2p stages (two a rank, in a V) on the same layers; its "
              "ideal bubble is about 0 (the paper's, with F = B = W).",
              f"`schedule=\"auto\"` (no memory_limit, so ZB-H2 not tried) chose {res['auto']} on its own cuts.", ""]
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
