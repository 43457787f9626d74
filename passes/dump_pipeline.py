"""``pipeline.md``: the stages, the loss over microbatches, the schedule per rank, and the timelines.

Written next to ``plan.md`` (which links to it) when a pipelined program is compiled with a dump
directory. The simulated timeline is drawn at compile time (``simulated.svg``); the first ``pm.step``
draws the measured one (``measured.svg``, by ``runtime/step_runner.py``) and appends its bubble, so the
two pictures sit side by side in the file.
"""
from __future__ import annotations

import os

from autoshard.ir import meta as M
from autoshard.ir.schedule import Schedule, add_communication
from autoshard.ir.simulator import Costs, simulate
from autoshard.passes import dump as D


def _mib(n) -> str:
    return f"{n / 2**20:.2f} MiB"


def closed_form(schedule: Schedule, costs=None) -> float:
    """The ideal bubble over compute time: ``(p-1)/m``, or ``(p-1)/(v m)`` interleaved; for a split
    (zero-bubble) schedule ``(p-1)(F + B - W) / (m (F + B + W))`` (Qi et al.), from the stages' mean
    costs (a third of 1F1B's when F = B = W)."""
    p, m, v = schedule.pp, schedule.microbatches, schedule.virtual
    if schedule.split and costs is not None:
        n = len(costs.forward)
        f = sum(costs.forward) / n
        w = sum(costs.w(s) for s in range(n)) / n
        b = sum(costs.backward) / n - w
        return (p - 1) * (f + b - w) / (m * (f + b + w))
    return (p - 1) / (v * m)


def weight_grad_lines(prog) -> list:
    """The ``## B and W`` section: per stage, the matmuls whose weight gradient W computes and the bytes
    B keeps for them a microbatch (each matmul's input and output gradient, from the compiled shapes)."""
    from autoshard.ir.weight_grad import deferred_linear
    from autoshard.passes.plan import nbytes
    from autoshard.passes.weight_grad import parameter_of
    if not prog.schedule.split:
        return []
    L = ["## B and W (zero-bubble split of each backward)", "",
         "B computes the stage input's gradient (sent to the previous stage) and the gradients of parameters "
         "outside matmuls; W the matmuls' weight gradients, from each one's input and output gradient, which "
         "B keeps. A stage-0 backward whose W the schedule runs right after it runs whole (nothing waits for "
         "its B).", "",
         "| stage | matmuls in W | their weights | kept from B to W / microbatch | left in B |", "|---|---|---|---|---|"]
    for c in prog.chunks:
        nodes = [n for n in c.gm.graph.nodes if n.op == "call_function" and n.target is deferred_linear]
        kept = sum(nbytes(n.args[0]) + nbytes(n) for n in nodes)
        params = [parameter_of(n.args[1]) for n in nodes]
        in_w = {M.NAME.get(p, None) for p in params if p is not None}
        weights = len(in_w)
        left = [p for p in c.param_names if p not in in_w]
        L.append(f"| {c.index} | {len(nodes)} | {weights} | {_mib(kept)} | "
                 + (", ".join(f"`{p}`" for p in left[:8]) + (" ..." if len(left) > 8 else "") or "-") + " |")
    return L + [""]


def _costs(prog) -> Costs:
    """What the predicted step was simulated with (a plan from before the simulation was recorded: the
    stages' compute alone)."""
    return prog.plan.simulation or Costs.of_stages(prog.plan.costs)


def simulated(prog):
    """The predicted step's timeline: the lowered schedule, whose sends may hold their ranks."""
    s = prog.schedule
    return simulate(s if s.lowered else add_communication(s), _costs(prog))


def write_pipeline(prog, out: str) -> None:
    D.write_plan(prog, out)
    plan, sched, loss = prog.plan, prog.schedule, prog.loss
    with open(os.path.join(out, "plan.md"), "a") as f:
        f.write("\n## Pipeline\n\nStages, schedule and timelines: [pipeline.md](pipeline.md)\n")
    sim = simulated(prog)
    sim.to_svg(os.path.join(out, "simulated.svg"))
    L = [f"# Pipeline: pp={sched.pp}, v={sched.virtual}, m={sched.microbatches}, schedule {sched.name}", "",
         f"Cuts: {plan.how}, from {plan.candidates} places where the residual stream crosses, alone or "
         f"with small values carried beside it ({plan.layer_count} layers).", "",
         "| stage | rank | boundary out | layers | nodes | parameters | fwd (predicted) | params+grads+AdamW | "
         "activations / microbatch |",
         "|---|---|---|---|---|---|---|---|---|"]
    for c, cost in zip(prog.chunks, plan.costs):
        layers = f"{cost.layers[0]}..{cost.layers[-1]}" if cost.layers else "-"
        nodes = sum(1 for n in c.gm.graph.nodes if n.op not in ("placeholder", "output"))
        boundary = "(loss)" if c.last else "` + `".join(plan.sent(c.index))
        L.append(f"| {c.index} | {sched.rank_of(c.index)} | `{boundary}` {c.out_shape} | {layers} | {nodes} | "
                 f"{len(c.params)} | {cost.forward_seconds * 1e3:.3f} ms | {_mib(cost.param_bytes)} | "
                 f"{_mib(cost.activation_bytes)} |")
    L += ["", f"Predicted step: {plan.predicted_step * 1e3:.3f} ms; peak per rank (parameters, gradients, AdamW "
              "state, activations in flight): " + ", ".join(f"rank {r} {_mib(b)}"
                                                             for r, b in plan.predicted_peak_bytes.items())]
    if plan.uniform:
        u = plan.uniform
        L.append(f"Uniform layer cuts {list(u['cuts'])} would predict {u['step'] * 1e3:.3f} ms; peak "
                 + ", ".join(f"rank {r} {_mib(b)}" for r, b in u["peak"].items()))
    L += ["", "## Recomputed on each stage (input-only values, not sent)", ""]
    L += [f"- stage {k}: " + (", ".join(f"`{n}`" for n in names[:12]) + (" ..." if len(names) > 12 else "")
                              if names else "none") for k, names in plan.recomputed.items()]
    L += ["", "## Parameters per stage", ""]
    L += [f"- stage {c.index}: " + ", ".join(f"`{n}`" for n in c.param_names) for c in prog.chunks]
    ties = prog.ties()
    L += ["", "Tied across pipeline ranks (gradients summed between the copies after the last backward): "
          + (", ".join(f"`{n}` on ranks {r}" for n, r in ties.items()) or "none"), ""]
    own = sum(r.nbytes for r in prog.params)
    dp = prog.mesh.dp
    L += ["## Memory per rank (this rank's stages)", "",
          "| | parameters | gradients | AdamW state (2 moments) | total |", "|---|---|---|---|---|",
          f"| without ZeRO | {_mib(own)} | {_mib(own)} | {_mib(2 * own)} | {_mib(4 * own)} |",
          f"| ZeRO-1 over dp={dp} | {_mib(own)} | {_mib(own)} | {_mib(2 * own / dp)} (about: whole tensors are "
          f"partitioned) | {_mib(2 * own + 2 * own / dp)} |", "",
          "Plus the activations in flight (the stage table above, times the microbatches the schedule keeps).", ""]
    L += ["## Loss over microbatches", "",
          ("Exact: " if loss.exact else "Fallback, the mean of microbatch means (wrong when microbatches hold "
           "different numbers of targets): ") + loss.reason, ""]
    L += weight_grad_lines(prog)
    L += ["## Schedule", "", "```", sched.text(), "```", ""]
    if plan.schedule_choice:
        L += [plan.schedule_choice, ""]
    form = "(p-1)(F+B-W)/(m(F+B+W))" if sched.split else "(p-1)/(v m)"
    whose = "ZB-H1's closed form (ZB-H2's deeper warm-up can do better)" if sched.name == "zb-h2" else "closed form"
    L += ["## Timelines", "",
          f"Simulated bubble {sim.bubble_over_ideal:.3f} of the ideal step; {whose} "
          f"{form} = {closed_form(sched, _costs(prog)):.3f}.", "",
          "| simulated | measured (second pm.step; the first is warm-up) |", "|---|---|",
          "| ![simulated](simulated.svg) | ![measured](measured.svg) |", "",
          "The measured bubble and peak memory: [measured.md](measured.md) (written by pm.step).", ""]
    with open(os.path.join(out, "pipeline.md"), "w") as f:
        f.write("\n".join(L))
