"""Pipeline schedules as data and the simulator that replays them (no processes).

Which bubble is tested. With p ranks, m microbatches, v chunks per rank and equal stages (a chunk's
forward costs 1 and its backward 2, so the times are exact ``Fraction``s), two ratios are checked:

- ``Timeline.bubble_fraction`` = idle / (p * step), the idle share of the step. GPipe and 1F1B give
  ``(p-1)/(m+p-1)``, interleaved 1F1B ``(p-1)/(v m + p-1)``.
- ``Timeline.bubble_over_ideal`` = idle / busy, the bubble relative to the ideal step (no bubble), which
  is the paper's definition (Narayanan et al. SC'21 §2.2, DESIGN.md §4): ``(p-1)/m`` for GPipe and 1F1B,
  ``(p-1)/(v m)`` interleaved.

They are the same fact: with x = idle/busy, idle/(p * step) = x/(1+x), and x = (p-1)/m gives (p-1)/(m+p-1).
"""
import ast
import pathlib
import xml.etree.ElementTree as ET
from fractions import Fraction

import pytest

from autoshard.ir.schedule import (
    Action,
    Kind,
    Schedule,
    add_communication,
    gpipe,
    interleaved_1f1b,
    interleaved_warmup,
    one_f_one_b,
    validate,
)
from autoshard.ir.simulator import Costs, simulate

CASES = ([("gpipe", pp, m, 1) for pp in (2, 4) for m in (4, 8, 16)]
         + [("1f1b", pp, m, 1) for pp in (2, 4) for m in (4, 8, 16)]
         + [("interleaved", pp, m, v) for pp in (2, 4) for m in (4, 8, 16) for v in (2, 3)])
IDS = [f"{g}-pp{pp}-m{m}-v{v}" for g, pp, m, v in CASES]


def make(gen, pp, m, v) -> Schedule:
    return {"gpipe": lambda: gpipe(pp, m), "1f1b": lambda: one_f_one_b(pp, m),
            "interleaved": lambda: interleaved_1f1b(pp, m, v)}[gen]()


def unit_costs(schedule, p2p=0, activation_bytes=0):
    return Costs.uniform(schedule.num_stages, Fraction(1), Fraction(2), activation_bytes, p2p)


@pytest.mark.parametrize("gen,pp,m,v", CASES, ids=IDS)
def test_every_microbatch_forwarded_and_backwarded_once_per_stage(gen, pp, m, v):
    s = make(gen, pp, m, v)
    assert (s.pp, s.virtual, s.microbatches) == (pp, v, m)
    for kind in (Kind.F, Kind.B):
        done = [a for acts in s.actions.values() for a in acts if a.kind is kind]
        assert sorted((a.stage, a.microbatch) for a in done) == [(st, i) for st in range(pp * v) for i in range(m)]
    for r in range(pp):  # each rank runs only its own stages: r, r + pp, ...
        assert {a.stage for a in s.actions[r]} == set(s.stages_of(r)) == set(range(r, pp * v, pp))
        assert all(s.rank_of(st) == r for st in s.stages_of(r))
    validate(s)


@pytest.mark.parametrize("gen,pp,m,v", CASES, ids=IDS)
def test_sends_match_receives_after_lowering(gen, pp, m, v):
    s = make(gen, pp, m, v)
    lowered = add_communication(s)
    assert validate(lowered) == validate(s)
    placed = {a: r for r, acts in lowered.actions.items() for a in acts}
    comm = [a for a in placed if not a.is_compute]
    # every stage boundary crosses ranks (pp >= 2), once per microbatch, each way
    assert len(comm) == 4 * (pp * v - 1) * m
    for a in comm:
        if a.kind is Kind.SEND_F:
            assert placed[Action(a.stage + 1, Kind.RECV_F, a.microbatch)] == lowered.rank_of(a.stage + 1)
        if a.kind is Kind.SEND_B:
            assert placed[Action(a.stage - 1, Kind.RECV_B, a.microbatch)] == lowered.rank_of(a.stage - 1)
    for acts in lowered.actions.values():  # a RECV right before its compute, a SEND right after
        for k, a in enumerate(acts):
            if a.kind in (Kind.RECV_F, Kind.RECV_B):
                assert acts[k + 1] == Action(a.stage, Kind.F if a.kind is Kind.RECV_F else Kind.B, a.microbatch)
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                assert acts[k - 1] == Action(a.stage, Kind.F if a.kind is Kind.SEND_F else Kind.B, a.microbatch)
    with pytest.raises(ValueError, match="already has communication"):
        add_communication(lowered)


@pytest.mark.parametrize("gen,pp,m,v", CASES, ids=IDS)
def test_in_flight_microbatches_per_rank_are_as_promised(gen, pp, m, v):
    s = make(gen, pp, m, v)
    in_flight = validate(s)
    for r in range(pp):
        if gen == "gpipe":
            assert in_flight[r] == m
        elif gen == "1f1b":
            assert in_flight[r] == min(pp - r, m) <= pp - r
        else:  # warm-up forwards plus the one of the first steady 1F1B pair, in chunk-microbatches
            assert in_flight[r] == min(interleaved_warmup(pp, m, v, r) + 1, m * v)
    # the simulator's memory agrees: equal activations per stage, so peak bytes = in-flight x bytes
    timeline = simulate(s, unit_costs(s, activation_bytes=1000))
    assert timeline.peak_activation_bytes == {r: 1000 * in_flight[r] for r in range(pp)}


@pytest.mark.parametrize("gen,pp,m,v", CASES, ids=IDS)
def test_text_form_round_trips(gen, pp, m, v):
    s = make(gen, pp, m, v)
    for schedule in (s, add_communication(s)):
        text = schedule.text()
        assert len(text.splitlines()) == pp + 1  # the header, then one line per rank
        assert Schedule.from_text(text) == schedule
        headerless = "\n".join(text.splitlines()[1:])
        assert Schedule.from_text(headerless, name=schedule.name) == schedule
        for acts in schedule.actions.values():
            assert all(Action.parse(str(a)) == a for a in acts)


def test_action_text():
    assert str(Action(2, Kind.F, 0)) == "2F0"
    assert str(Action(1, Kind.B, 3)) == "1B3"
    assert str(Action(0, Kind.SEND_F, 1)) == "0SEND_F1"
    assert Action.parse("12RECV_B10") == Action(12, Kind.RECV_B, 10)
    assert one_f_one_b(2, 3).text() == "# 1f1b pp=2 v=1 m=3\n0: 0F0 0F1 0B0 0F2 0B1 0B2\n1: 1F0 1B0 1F1 1B1 1F2 1B2"
    for bad in ("F0", "2X0", "2F", "2F0x"):
        with pytest.raises(ValueError, match="not an action"):
            Action.parse(bad)


@pytest.mark.parametrize("gen,pp,m,v", CASES, ids=IDS)
def test_bubble_matches_the_closed_forms(gen, pp, m, v):
    """Equal stages, F = 1 and B = 2 per chunk: idle/busy is the paper's (p-1)/m, or (p-1)/(v m)
    interleaved, and idle/step is (p-1)/(v m + p - 1) (v = 1 for GPipe and 1F1B). Exact, in Fractions."""
    s = make(gen, pp, m, v)
    t = simulate(s, unit_costs(s))
    assert t.step_time == (v * m + pp - 1) * 3                # ideal v m (F + B), plus (p-1)(F + B)
    assert t.busy == {r: v * m * 3 for r in range(pp)}
    assert t.bubble_over_ideal == Fraction(pp - 1, v * m)
    assert t.bubble_fraction == Fraction(pp - 1, v * m + pp - 1)
    bubble = t.bubble_over_ideal
    assert t.bubble_fraction == bubble / (1 + bubble)


@pytest.mark.parametrize("gen,pp,m,v", CASES[::4], ids=IDS[::4])
def test_lowered_and_compute_only_simulate_the_same(gen, pp, m, v):
    s = make(gen, pp, m, v)
    costs = unit_costs(s, p2p=Fraction(1, 10))
    compute_only, lowered = simulate(s, costs), simulate(add_communication(s), costs)
    assert compute_only.step_time == lowered.step_time > simulate(s, unit_costs(s)).step_time
    for r in range(pp):
        assert ([(x.action, x.start, x.end) for x in compute_only.spans[r]]
                == [(x.action, x.start, x.end) for x in lowered.spans[r] if x.action.is_compute])


def test_runtime_overhead_is_an_inflated_action_and_a_send_holds_its_rank():
    """``Costs.overhead`` is the same as every compute action's work grown by it (counted as busy);
    ``Costs.send`` holds a lowered schedule's sending rank (not counted as busy), so a schedule sending
    twice as often (ZB-V: two chunks a rank) pays twice."""
    import dataclasses
    from autoshard.ir.zero_bubble import zero_bubble_h1, zero_bubble_v
    pp, m, o, send = 2, 8, Fraction(1, 4), Fraction(1, 10)
    s = add_communication(one_f_one_b(pp, m))
    inflated = Costs.uniform(pp, Fraction(1) + o, Fraction(2) + o, 0, Fraction(1, 10))
    with_overhead = dataclasses.replace(unit_costs(s, p2p=Fraction(1, 10)), overhead=o)
    a, b = simulate(s, with_overhead), simulate(s, inflated)
    assert a.step_time == b.step_time and a.busy == b.busy
    held = simulate(s, dataclasses.replace(with_overhead, send=send))
    assert held.busy == a.busy and held.step_time > a.step_time
    sends = {r: sum(x.action.kind in (Kind.SEND_F, Kind.SEND_B) for x in held.spans[r]) for r in range(pp)}
    assert sends == {0: m, 1: m}                  # 1F1B at pp=2: one send a microbatch per rank
    zv = add_communication(zero_bubble_v(pp, m))
    v_sends = {r: sum(a.kind in (Kind.SEND_F, Kind.SEND_B) for a in zv.actions[r]) for r in range(pp)}
    assert v_sends == {0: 2 * m, 1: 2 * m}        # ZB-V: two
    h1 = zero_bubble_h1(pp, m)
    computes = sum(a.is_compute for acts in zv.actions.values() for a in acts)
    assert computes == 2 * sum(map(len, h1.actions.values()))     # and twice ZB-H1's actions


def test_interleaved_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match=r"multiple of pp=4, got m=6: use m in 4, 8, 12, .*nearest: 4 or 8"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match=r"got m=3: .*nearest: 4\)"):
        interleaved_1f1b(4, 3, 2)
    with pytest.raises(ValueError, match=r"v >= 2 .* use one_f_one_b\(pp=4, m=8\)"):
        interleaved_1f1b(4, 8, 1)
    with pytest.raises(ValueError, match=r"pp >= 2 .* use schedule=.gpipe. or .1f1b."):
        interleaved_1f1b(1, 8, 2)
    with pytest.raises(ValueError, match="m must be an int >= 1"):
        one_f_one_b(2, 0)


def _edit(schedule, rank, actions):
    return Schedule(schedule.name, schedule.pp, schedule.virtual, schedule.microbatches,
                    {**schedule.actions, rank: actions})


def test_validate_names_what_is_wrong():
    s = one_f_one_b(2, 2)  # 0: 0F0 0F1 0B0 0B1    1: 1F0 1B0 1F1 1B1
    with pytest.raises(ValueError, match="0F1 runs 2 times"):
        validate(_edit(s, 0, [Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.F, 1),
                              Action(0, Kind.B, 0), Action(0, Kind.B, 1)]))
    with pytest.raises(ValueError, match="0B0 runs before 0F0"):
        validate(_edit(s, 0, [Action(0, Kind.B, 0), Action(0, Kind.F, 0), Action(0, Kind.F, 1),
                              Action(0, Kind.B, 1)]))
    with pytest.raises(ValueError, match="belongs to rank 1"):
        validate(_edit(s, 0, s.actions[0] + [Action(1, Kind.F, 0)]))
    with pytest.raises(ValueError, match="deadlocks"):
        validate(_cycle(s))
    lowered = add_communication(s)
    no_recv = [a for a in lowered.actions[1] if a != Action(1, Kind.RECV_F, 0)]
    with pytest.raises(ValueError, match="1F0 runs before 1RECV_F0"):
        validate(_edit(lowered, 1, no_recv))
    # rank 1 receives microbatch 1 before 0: fine on its own, but NCCL would hand over 0's tensor as 1's
    swapped = Schedule.from_text("""# 1f1b pp=2 v=1 m=2
        0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
        1: 1RECV_F1 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1""")
    with pytest.raises(ValueError, match="sends 0SEND_F0 0SEND_F1 but the receives expect 0SEND_F1 0SEND_F0"):
        validate(swapped)


def _cycle(s):
    """Rank 0 runs backward 0 before forward 1; rank 1 forwards 1 before backward 0: each waits on the other."""
    s = _edit(s, 0, [Action(0, Kind.F, 0), Action(0, Kind.B, 0), Action(0, Kind.F, 1), Action(0, Kind.B, 1)])
    return _edit(s, 1, [Action(1, Kind.F, 0), Action(1, Kind.F, 1), Action(1, Kind.B, 0), Action(1, Kind.B, 1)])


def test_costs_must_cover_every_stage():
    with pytest.raises(ValueError, match="one per stage"):
        simulate(interleaved_1f1b(2, 4, 2), Costs.uniform(2, 1, 2))


@pytest.mark.parametrize("gen,pp,m,v", [("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2)])
def test_svg_has_one_row_per_rank(tmp_path, gen, pp, m, v):
    s = add_communication(make(gen, pp, m, v))
    path = tmp_path / "timeline.svg"
    simulate(s, Costs.uniform(s.num_stages, 0.010, 0.020, p2p=0.001)).to_svg(str(path))
    root = ET.parse(path).getroot()  # well-formed XML
    rows = [g for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "rank"]
    assert [g.get("data-rank") for g in rows] == [str(r) for r in range(pp)]
    for r, g in enumerate(rows):
        boxes = [x for x in g if x.tag.endswith("rect")]
        assert len(boxes) == sum(a.is_compute for a in s.actions[r])  # one box per F or B
        assert {x.get("fill") for x in boxes} == {"#4c78a8", "#f58518"}
    assert "time (ms)" in path.read_text() and "rank 0" in path.read_text()


def test_simulator_imports_no_compiler_and_no_torch():
    source = pathlib.Path(__file__).parents[2] / "autoshard" / "ir" / "simulator.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert not any(name.startswith(("autoshard.passes", "passes", "torch")) for name in imported), imported


def test_a_short_batch_runs_the_most_microbatches_that_fit_or_says_why_none_does():
    """An epoch's short last batch: the largest count up to ``microbatches`` that divides its rows and that
    the schedule takes; none for interleaved (3 rows at pp=2: 1 and 3 are not multiples of 2) is a clear
    error naming the way out, not split_batch's list of divisors the schedule refuses."""
    from autoshard.api import _fitting_microbatches
    from autoshard.ir.options import PipelineOptions
    import torch
    rows = lambda n: ((torch.zeros(n, 4, dtype=torch.long),), {})          # noqa: E731
    opts = PipelineOptions(microbatches=4, schedule="1f1b")
    assert _fitting_microbatches(opts, 2, *rows(8)) is opts
    assert _fitting_microbatches(opts, 2, *rows(6)).microbatches == 3
    inter = PipelineOptions(microbatches=4, schedule="interleaved", virtual_stages=2)
    assert _fitting_microbatches(inter, 2, *rows(6)).microbatches == 2
    with pytest.raises(ValueError, match=r"3 rows cannot run schedule='interleaved' at pp=2.*drop_last=True.*4 rows"):
        _fitting_microbatches(inter, 2, *rows(3))


def test_step_clock_times_gpu_work_from_events_read_only_when_asked():
    """On a GPU the executor's marks are CUDA events (a host clock would time when Python issued each
    action): here a stand-in event with a settable clock. Nothing is synchronised until the timeline is
    read; spans, the step time and the busy time (compute only, not a receive's wait) come from the events."""
    import torch

    from autoshard.ir.schedule import Action, Kind
    from autoshard.ir.simulator import Span
    from autoshard.runtime.clock import Recorded, StepClock

    class Event:
        now, made = 0.0, []

        def __init__(self):
            self.t, self.synced = None, False
            Event.made.append(self)

        def record(self):
            self.t = Event.now

        def synchronize(self):
            self.synced = True

        def elapsed_time(self, later):
            return (later.t - self.t) * 1e3

    def at(t):
        Event.now = t
        return clock.mark()

    Event.now = 10.0
    clock = StepClock(torch.device("cpu"), event=Event)
    rec = Recorded("1f1b", 2, 1, clock)
    rec.spans.append(Span(Action(1, Kind.RECV_F, 0), at(10.0), at(10.5)))   # waiting for stage 0
    rec.spans.append(Span(Action(1, Kind.F, 0), at(10.5), at(11.25)))
    rec.spans.append(Span(Action(1, Kind.B, 0), at(11.25), at(12.0)))
    rec.end = at(12.5)
    assert not any(e.synced for e in Event.made)
    tl = rec.timeline()
    assert [(s.start, s.end) for s in tl.spans[1]] == [(0.0, 0.5), (0.5, 1.25), (1.25, 2.0)]
    assert tl.step_time == 2.5 and tl.busy[1] == 1.5
    host = StepClock(torch.device("cpu"))     # on the CPU a mark is already seconds
    assert isinstance(host.mark(), float) and host.seconds(0.25) == 0.25


def test_stage_0_backwards_the_executor_runs_whole_cost_one_action():
    """A stage-0 B followed by its own W runs whole in the executor (``whole_backwards``: nothing waits for
    stage 0's input gradient), so the simulator charges it one action's overhead, not two."""
    import dataclasses
    from autoshard.ir.schedule import whole_backwards
    from autoshard.ir.zero_bubble import zero_bubble_h1
    pp, m, o = 2, 4, Fraction(1, 4)
    s = zero_bubble_h1(pp, m)
    merged = whole_backwards(s.actions[0])
    assert merged and all(stage == 0 for stage, _ in merged)
    t = simulate(s, dataclasses.replace(unit_costs(s), overhead=o))
    assert t.busy[0] == 3 * m + o * (3 * m - len(merged))
    assert t.busy[1] == 3 * m + o * 3 * m
    assert simulate(s, unit_costs(s)).step_time == 3 * m + (pp - 1)     # free of overhead: the closed form
