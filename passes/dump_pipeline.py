"""``pipeline.md``: the stages, the loss over microbatches, the schedule per rank, and the timelines.

Written next to ``plan.md`` (which links to it) when a pipelined program is compiled with a dump
directory. The simulated timeline is drawn at compile time (``simulated.svg``); the first ``pm.step``
draws the measured one (``measured.svg``, by ``runtime/step_runner.py``) and appends its bubble, so the
two pictures sit side by side in the file.
"""
from __future__ import annotations

import os

from autoshard.ir.schedule import Schedule
from autoshard.ir.simulator import Costs, simulate
from autoshard.passes import dump as D


def _mib(n) -> str:
    return f"{n / 2**20:.2f} MiB"


def closed_form(schedule: Schedule) -> float:
    """The ideal bubble over compute time: ``(p-1)/m``, or ``(p-1)/(v m)`` interleaved."""
    return (schedule.pp - 1) / (schedule.virtual * schedule.microbatches)


def simulated(prog):
    plan, sched = prog.plan, prog.schedule
    return simulate(sched, Costs(tuple(c.forward_seconds for c in plan.costs),
                                 tuple(c.backward_seconds for c in plan.costs),
                                 tuple(c.activation_bytes for c in plan.costs)))


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
    L += ["## Schedule", "", "```", sched.text(), "```", ""]
    L += ["## Timelines", "",
          f"Simulated bubble {sim.bubble_over_ideal:.3f} of the ideal step; closed form "
          f"(p-1)/(v m) = {closed_form(sched):.3f}.", "",
          "| simulated | measured (second pm.step; the first is warm-up) |", "|---|---|",
          "| ![simulated](simulated.svg) | ![measured](measured.svg) |", "",
          "The measured bubble and peak memory: [measured.md](measured.md) (written by pm.step).", ""]
    with open(os.path.join(out, "pipeline.md"), "w") as f:
        f.write("\n".join(L))
