"""Predict a pipeline schedule's step time, bubble and activation memory without running it.

The simulator replays the same per-rank action lists the executor runs (``autoshard.ir.schedule``): each
rank executes its list in order, and an action starts once its rank is free and the actions it depends on
(``schedule.dependencies``: the previous stage's forward, the next stage's backward, or the matching
send) have finished, plus ``p2p`` seconds when the value crosses ranks. There is no contention model:
transfers overlap compute (a separate stream). Two runtime costs are off by default: ``overhead``, what
the runtime spends on each compute action beyond its stage's work, and ``send``, how long a SEND holds
its rank (a lowered schedule's; gloo's send returns once the kernel has taken the bytes). Without them,
for equal stage costs the result is the textbook pipeline, and ``tests/unit/test_schedule.py`` checks
the closed forms of Narayanan et al. (SC'21) exactly. With them, a schedule of more actions and more
transfers (ZB-V: two chunks a rank, four sends a microbatch where 1F1B has two) pays for them.

Times are whatever number type the costs use: pass ``fractions.Fraction`` (or ints) for exact
arithmetic. Pure Python: no torch, no processes, nothing from the compiler.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

from autoshard.ir.schedule import W_MEMORY, Action, Kind, Schedule, dependencies, execution_order, whole_backwards


@dataclass(frozen=True)
class Costs:
    """Per-stage costs of one microbatch: ``forward[s]`` and ``backward[s]`` in seconds,
    ``activation_bytes[s]`` saved by the forward of stage s until its backward, and the latency of one
    boundary transfer between ranks (``p2p``). ``weight[s]``: the part of ``backward[s]`` a split schedule
    runs as W (the weight gradients); None: half of it (the zero-bubble paper's B = W). ``kept_bytes[s]``:
    what its B keeps for W (each matmul's input and output gradient: under recompute far more than the
    layer inputs the forward saved)."""
    forward: tuple
    backward: tuple
    activation_bytes: tuple
    p2p: float = 0
    weight: tuple | None = None
    kept_bytes: tuple | None = None     # a split schedule: what B keeps for W (None: W_MEMORY of the activations)
    overhead: float = 0                 # seconds each compute action costs its rank beyond its work
    send: float = 0                     # seconds a SEND holds its rank

    def w(self, stage: int):
        return self.weight[stage] if self.weight is not None else self.backward[stage] / 2

    def kept(self, stage: int):
        return self.kept_bytes[stage] if self.kept_bytes is not None else W_MEMORY * self.activation_bytes[stage]

    @staticmethod
    def of_stages(stages, p2p=0, kept_bytes=None, backward_scale=1, overhead=0, send=0) -> Costs:
        """From per-stage records with ``forward_seconds``, ``backward_seconds`` and ``activation_bytes``
        (the balancer's ``StageCost``), and ``weight_seconds`` where priced (a split schedule's W; else
        half the backward); ``backward_scale`` prices a split backward's extra pass."""
        priced = any(c.weight_seconds for c in stages)
        weight = tuple(c.weight_seconds * backward_scale for c in stages) if priced else None
        return Costs(tuple(c.forward_seconds for c in stages), tuple(c.backward_seconds * backward_scale for c in stages),
                     tuple(c.activation_bytes for c in stages), p2p, weight, kept_bytes, overhead, send)

    @staticmethod
    def uniform(num_stages: int, forward, backward, activation_bytes: int = 0, p2p=0) -> Costs:
        return Costs((forward,) * num_stages, (backward,) * num_stages, (activation_bytes,) * num_stages, p2p)

    def check(self, schedule: Schedule) -> None:
        for name in ("forward", "backward", "activation_bytes") + (("weight",) if self.weight is not None else ()):
            if len(getattr(self, name)) != schedule.num_stages:
                raise ValueError(f"Costs.{name} has {len(getattr(self, name))} entries but schedule "
                                 f"{schedule.name!r} has pp * v = {schedule.num_stages} stages; give one per stage")


@dataclass(frozen=True)
class Span:
    """When one action ran. A RECV spans the time its rank waited for the data; a SEND holds its rank
    ``Costs.send`` (none by default)."""
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """The simulated step. ``busy[r]`` is rank r's compute time, ``peak_activation_bytes[r]`` the most
    activation bytes it held at once (forwards whose backward had not yet run; in a split schedule,
    ``W_MEMORY`` of a microbatch's from its B to its W)."""
    name: str
    pp: int
    spans: dict[int, list[Span]]
    step_time: float
    busy: dict[int, float]
    peak_activation_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def bubble_fraction(self):
        """Idle share of the step over all ranks: ``1 - sum(busy) / (pp * step_time)``. With equal stages
        this is ``(p-1)/(m+p-1)`` for GPipe and 1F1B (a share of the *step*)."""
        return 1 - sum(self.busy.values()) / (self.pp * self.step_time)

    @property
    def bubble_over_ideal(self):
        """Idle time over compute time, ``sum(idle) / sum(busy)``: the paper's bubble fraction, relative to
        the ideal step (no bubble). Equal stages give ``(p-1)/m`` (GPipe, 1F1B), ``(p-1)/(v m)`` interleaved."""
        busy = sum(self.busy.values())
        return (self.pp * self.step_time - busy) / busy

    def to_svg(self, path: str, width: int = 1000) -> None:
        """Draw one row per rank, one box per forward (blue), backward (orange) or W (green) labelled with its text
        form, on a time axis in ms. Hand-written SVG: opens in any browser, needs no plotting library."""
        left, top, row, gap = 70, 40, 28, 6
        scale = (width - left - 20) / float(self.step_time or 1)  # px per second
        height = top + self.pp * (row + gap) + 40
        colour = {Kind.F: "#4c78a8", Kind.B: "#f58518", Kind.W: "#54a24b"}
        title = (f"{escape(self.name)}: step {float(self.step_time) * 1e3:.6g} ms, bubble "
                 f"{float(self.bubble_fraction):.1%} of the step ({float(self.bubble_over_ideal):.1%} of ideal)")
        out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                'font-family="monospace" font-size="11">'),
               f'<rect width="{width}" height="{height}" fill="white"/>',
               f'<text x="{left}" y="16">{title}</text>']
        for k, kind in enumerate(colour):  # the legend
            x = width - 160 + 40 * k
            out.append(f'<rect x="{x}" y="6" width="12" height="12" fill="{colour[kind]}"/>'
                       f'<text x="{x + 16}" y="16">{kind.value}</text>')
        for r in range(self.pp):
            y = top + r * (row + gap)
            out.append(f'<g class="rank" data-rank="{r}">')
            out.append(f'<text x="4" y="{y + row / 2 + 4:.1f}">rank {r}</text>')
            for span in self.spans.get(r, []):
                if not span.action.is_compute:
                    continue
                x, w = left + float(span.start) * scale, float(span.end - span.start) * scale
                label = str(span.action)
                out.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row}" '
                           f'fill="{colour[span.action.kind]}" stroke="white" stroke-width="0.5">'
                           f'<title>{label}: {float(span.start) * 1e3:.4g} to {float(span.end) * 1e3:.4g} ms'
                           f'</title></rect>')
                size = min(11.0, 1.6 * w / len(label))  # shrink the label to fit its box
                if size >= 4:
                    out.append(f'<text x="{x + w / 2:.2f}" y="{y + row / 2 + size / 3:.1f}" font-size="{size:.1f}" '
                               f'text-anchor="middle" fill="white">{label}</text>')
            out.append("</g>")
        axis_y = top + self.pp * (row + gap) + 4
        out.append(f'<line x1="{left}" y1="{axis_y}" x2="{width - 20}" y2="{axis_y}" stroke="black"/>')
        total_ms = float(self.step_time) * 1e3
        tick = _nice_step(total_ms / 10) if total_ms > 0 else 1.0
        for k in range(int(total_ms / tick + 1e-9) + 1):
            x = left + k * tick / 1e3 * scale
            out.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 5}" stroke="black"/>'
                       f'<text x="{x:.2f}" y="{axis_y + 18}" text-anchor="middle">{k * tick:g}</text>')
        out.append(f'<text x="{width - 20}" y="{axis_y + 32}" text-anchor="end">time (ms)</text>')
        out.append("</svg>")
        with open(path, "w") as f:
            f.write("\n".join(out) + "\n")


def _nice_step(raw: float) -> float:
    """1, 2 or 5 times a power of ten, the smallest not below ``raw``: readable tick labels."""
    power = 10 ** math.floor(math.log10(raw))
    return next(k * power for k in (1, 2, 5, 10) if k * power >= raw)


def simulate(schedule: Schedule, costs: Costs) -> Timeline:
    """Replay ``schedule`` (compute-only or lowered by ``add_communication``: both give the same times
    unless ``costs.send`` holds a sending rank, which only a lowered schedule has) and return its
    ``Timeline``. Raises ``ValueError`` if the schedule deadlocks."""
    costs.check(schedule)
    rank_of, split = schedule.rank_of, schedule.split
    # B frees a microbatch's activations (and in a split schedule takes what it keeps for W), W frees that
    clock = {r: 0 for r in range(schedule.pp)}
    deps = dependencies(schedule)
    end: dict[Action, float] = {}
    sent: dict[Action, float] = {}           # a SEND: when it started
    spans: dict[int, list[Span]] = {r: [] for r in range(schedule.pp)}
    busy = {r: 0 for r in range(schedule.pp)}
    # a stage-0 B followed by its own W runs whole, as the executor runs it: one action, its W free
    whole = set().union(*(whole_backwards(acts) for acts in schedule.actions.values())) if split else set()
    for action in execution_order(schedule):  # every dependency comes before the action
        r = rank_of(action.stage)
        sends = action.kind in (Kind.SEND_F, Kind.SEND_B)
        ready = clock[r]
        for dep in deps[action]:     # a send's bytes leave when it starts, whatever it holds its rank
            ready = max(ready, sent.get(dep, end[dep]) + (costs.p2p if rank_of(dep.stage) != r else 0))
        if action.kind is Kind.F:
            duration = costs.forward[action.stage]
        elif action.kind is Kind.B:
            whole_b = not split or (action.stage, action.microbatch) in whole
            duration = costs.backward[action.stage] - (0 if whole_b else costs.w(action.stage))
        elif action.kind is Kind.W:
            duration = 0 if (action.stage, action.microbatch) in whole else costs.w(action.stage)
        elif sends:
            duration = costs.send
        else:
            duration = 0
        if duration and action.is_compute:      # a free action (an empty stage's) stays free
            duration += costs.overhead
        start = clock[r] if action.kind in (Kind.RECV_F, Kind.RECV_B) else ready
        if sends:
            sent[action] = ready
        end[action] = ready + duration
        spans[r].append(Span(action, start, end[action]))
        clock[r] = end[action]
        if action.is_compute:
            busy[r] += duration
    peak = {}
    for r, rank_spans in spans.items():
        held = most = 0
        for span in rank_spans:
            a = span.action
            if a.kind is Kind.F:
                held += costs.activation_bytes[a.stage]
            elif a.kind is Kind.B:
                held -= costs.activation_bytes[a.stage] - (costs.kept(a.stage) if split else 0)
            elif a.kind is Kind.W:
                held -= costs.kept(a.stage)
            most = max(most, held)
        peak[r] = most
    step = max(clock.values(), default=0)
    return Timeline(schedule.name, schedule.pp, spans, step, busy, peak)
