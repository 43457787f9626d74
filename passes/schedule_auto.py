"""``schedule="auto"``: the pipeline schedule and v with the shortest simulated step that fits the memory limit.

Once the stages are cut, each candidate schedule is generated on their costs and replayed by the
simulator (``ir/simulator.py``): the step time, and per rank the parameters plus the activations the
schedule keeps in flight. The fastest within ``memory_limit`` wins; ``pipeline.md`` says what each
candidate predicted and why the winner won. On one stage a rank the candidates are 1F1B and ZB-H1, and
ZB-H2 where a ``memory_limit`` is given (it holds about twice 1F1B's activations: without a limit to
check, a step faster by a few percent is not worth an out-of-memory);
then ZB-V, two stages a rank in a V, is cut into its own 2p stages (balanced for the V) and priced the
same way, and wins if it predicts a shorter step within the limit (``choose_virtual``). Only 1F1B where
a split backward cannot run (``codegen="inductor"``); the interleaved 1F1B is chosen by
``virtual_stages``, not here.
"""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.ir.options import resolved_codegen
from autoshard.ir.schedule import PLACEMENTS, Schedule, make_schedule
from autoshard.ir.simulator import Costs

CANDIDATES = ("1f1b", "zb-h1")
UNDER_A_LIMIT = ("zb-h2",)      # about twice 1F1B's activations: tried only where memory_limit can check it fits


@dataclass(frozen=True)
class Priced:
    """One candidate schedule on the chosen cuts."""
    name: str
    schedule: object
    costs: list
    step: float
    peak: dict            # pp rank -> bytes (parameters, gradients, AdamW state, activations in flight)
    fits: bool


def price_schedule(name: str, predict, cuts, pp: int, m: int, stages: list, memory_limit, kept: tuple | None = None,
                   v: int = 1) -> Priced:
    """Schedule ``name`` generated on the cut ``stages``' costs (and ``kept``: what a split B keeps for W
    per stage), then priced by ``predict(cuts, schedule) -> (costs, step, peak)`` (``stage_prices.predict``).
    ``v``: stages a rank (2 for ZB-V and the interleaved baseline it is set against)."""
    placed = Schedule(name, pp, v, m, placement=PLACEMENTS.get(name, "interleaved"))     # placement only
    resident = [sum(stages[s].param_bytes for s in placed.stages_of(r)) for r in range(pp)]
    schedule = make_schedule(name, pp, m, v, Costs.of_stages(stages, kept_bytes=kept), resident)
    stage_costs, step, peak = predict(cuts, schedule)
    fits = memory_limit is None or max(peak.values()) <= memory_limit
    return Priced(name, schedule, stage_costs, step, peak, fits)


def choose_schedule(predict, cuts, pp: int, m: int, first_costs: list, memory_limit, codegen: str,
                    kept: tuple | None = None) -> tuple:
    """``(Priced winner, reason)``: each candidate priced on the cuts (``price_schedule``); ``first_costs`` are the stages'
    costs the balancer gave for 1F1B."""
    names = CANDIDATES + (UNDER_A_LIMIT if memory_limit is not None else ())
    names = names if resolved_codegen(codegen) != "inductor" else ("1f1b",)
    priced = [price_schedule(name, predict, cuts, pp, m, first_costs, memory_limit, kept) for name in names]
    fitting = [p for p in priced if p.fits]
    if fitting:
        best = min(fitting, key=lambda p: (p.step, names.index(p.name)))
    else:       # none fits (the balancer has said so already): the smallest peak, as choose_virtual
        best = min(priced, key=lambda p: (max(p.peak.values()), names.index(p.name)))
    parts = [f"{p.name} {p.step * 1e3:.3f} ms, peak {max(p.peak.values()) / 2**20:.2f} MiB"
             + ("" if p.fits else f" (over memory_limit={memory_limit / 2**20:.2f} MiB)") for p in priced]
    why = (f"schedule='auto' chose {best.name}: the shortest predicted step"
           + (" within memory_limit" if memory_limit is not None else "") + " of " + "; ".join(parts) + "."
           + ("" if len(names) > 1 else " (codegen='inductor' runs whole backwards: no split schedule.)"))
    return best, why


def tries_the_v(opts, pp: int, places: int, codegen: str) -> bool:
    """Whether ``schedule="auto"`` also prices ZB-V (v = 2) on cuts of its own: it balances the cuts
    itself (no ``pipeline_cuts``, not another program's), there is a pipeline, the graph offers the 2p
    stages, and a split backward can run."""
    return (opts.schedule == "auto" and opts.stretches is None and opts.cuts is None and pp > 1
            and places >= 2 * pp and resolved_codegen(codegen) != "inductor")


def choose_virtual(first, vee, memory_limit):
    """The ``StagePlan`` to run: ``first`` (one stage a rank, its schedule chosen) or ``vee`` (ZB-V on its
    own cuts), the shorter predicted step within ``memory_limit`` (``first`` on a tie; where neither fits,
    the smaller peak), with the reason added to its ``schedule_choice``."""
    def peak(plan):
        return max(plan.predicted_peak_bytes.values())

    def fits(plan):
        return memory_limit is None or peak(plan) <= memory_limit
    fitting = [p for p in (first, vee) if fits(p)]
    best = (min(fitting, key=lambda p: (p.predicted_step, p is vee)) if fitting      # neither fits: the smaller
            else min((first, vee), key=lambda p: (peak(p), p is vee)))
    said = (f"zb-v on its own {vee.num_stages} stages (two a rank, in a V) predicts {vee.predicted_step * 1e3:.3f} ms, "
            f"peak {peak(vee) / 2**20:.2f} MiB"
            + ("" if fits(vee) else f" (over memory_limit={memory_limit / 2**20:.2f} MiB)"))
    if best is vee:
        vee.schedule_choice = (f"schedule='auto' chose zb-v: {said}, the shortest predicted step"
                               + (" within memory_limit" if memory_limit is not None else "")
                               + f"; on one stage a rank: {first.schedule_choice}")
    else:
        first.schedule_choice += f" {said}: not chosen."
    return best
