"""Pipeline schedules as data: per rank, the ordered list of actions it runs in one training step.

A schedule is only a list of ``Action``s per rank, so it can be printed, compared, checked and simulated
(``autoshard.ir.simulator``) before any process runs it; the executor walks the same list. As in
torch's ``pipelining/schedules.py``, generators emit *compute-only* schedules (forwards and backwards)
and a lowering pass, ``add_communication``, inserts the boundary transfers.

Placement is Megatron's interleaved one (Narayanan et al., SC'21, §2.2): the model is cut into
``pp * v`` stages (model chunks); rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...``. With ``v = 1``
this is the plain one-stage-per-rank pipeline. Microbatches are ``0 .. m-1``.

Text form, one action: ``<stage><KIND><microbatch>``, e.g. ``2F0`` (stage 2 forwards microbatch 0),
``1B3``, ``0W3`` (stage 0's weight gradients of microbatch 3), ``0SEND_F1`` (stage 0 sends its output for
microbatch 1 to stage 1), ``1RECV_F1`` (stage 1 receives it). A send is named by the sending stage, a
receive by the receiving stage.

A *split* schedule (zero-bubble: Qi et al., ICLR 2024) has a ``W`` for every ``B``: there ``B`` computes
only the gradient of the stage's input, which the previous stage waits for, and ``W`` the weights'
gradients from what ``B`` kept, which nobody waits for, so W fills the bubbles.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum


class Kind(str, Enum):
    F = "F"            # forward of one microbatch through one stage
    B = "B"            # backward: input and weight gradients together, or the input's alone (split)
    W = "W"            # weight gradients from what B kept (split schedules only)
    SEND_F = "SEND_F"  # activation to the next stage
    RECV_F = "RECV_F"  # activation from the previous stage
    SEND_B = "SEND_B"  # input gradient to the previous stage
    RECV_B = "RECV_B"  # output gradient from the next stage


COMPUTE = (Kind.F, Kind.B, Kind.W)
_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)")


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` on global stage ``stage`` for ``microbatch``."""
    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> Action:
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"not an action: {text!r}; expected <stage><KIND><microbatch> such as '2F0', "
                             f"'1B3' or '0SEND_F1' (KIND one of {', '.join(k.value for k in Kind)})")
        return Action(int(match[1]), Kind(match[2]), int(match[3]))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


PLACEMENTS = {"zb-v": "v"}      # schedule name -> its stages' placement, where not round-robin


@dataclass
class Schedule:
    """``actions[r]`` is what rank ``r`` runs, in order, for ``microbatches`` microbatches (m) over
    ``pp`` ranks holding ``virtual`` stages each (v)."""
    name: str
    pp: int
    virtual: int
    microbatches: int
    actions: dict[int, list[Action]] = field(default_factory=dict)
    placement: str = "interleaved"   # "v": two stages a rank in a V (ZB-V): r and 2p - 1 - r

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        """The rank holding ``stage``: Megatron's interleaved placement (round-robin over ranks), or the V
        of ZB-V, where rank r holds stages r and 2p - 1 - r (so the first and the last, the embedding and
        the LM head, share rank 0, and the turn at stage p - 1 -> p stays on the last rank)."""
        if self.placement == "v":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]

    @property
    def split(self) -> bool:
        """Whether backward is split into B (input gradient) and W (weight gradients) actions."""
        return any(a.kind is Kind.W for acts in self.actions.values() for a in acts)

    @property
    def lowered(self) -> bool:
        """Whether ``add_communication`` has run (the schedule names its transfers)."""
        return any(not a.is_compute for acts in self.actions.values() for a in acts)

    def text(self) -> str:
        """A header line, then one line per rank: ``<rank>: 0F0 0F1 ...``."""
        lines = [f"# {self.name} pp={self.pp} v={self.virtual} m={self.microbatches}"]
        lines += [f"{r}: " + " ".join(map(str, self.actions.get(r, []))) for r in range(self.pp)]
        return "\n".join(lines)

    @staticmethod
    def from_text(text: str, name: str = "custom") -> Schedule:
        """Inverse of ``text()``. Without the header line, pp, v and m are read off the actions."""
        header, actions = None, {}
        for line in filter(None, (ln.strip() for ln in text.splitlines())):
            if line.startswith("#"):
                header = re.fullmatch(r"#\s*(\S+)\s+pp=(\d+)\s+v=(\d+)\s+m=(\d+)", line)
                continue
            rank, _, body = line.partition(":")
            actions[int(rank.removeprefix("rank").strip())] = [Action.parse(t) for t in body.split()]
        if header:
            return Schedule(header[1], int(header[2]), int(header[3]), int(header[4]), actions,
                            PLACEMENTS.get(header[1], "interleaved"))
        every = [a for acts in actions.values() for a in acts]
        pp = max(actions, default=0) + 1
        stages = max((a.stage for a in every), default=0) + 1
        m = max((a.microbatch for a in every), default=0) + 1
        return Schedule(name, pp, -(-stages // pp), m, actions)


# ----------------------------------------------------------------------------------------- generators

def gpipe(pp: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards. Every rank holds the
    activations of all m microbatches at the turn, which is what 1F1B fixes."""
    _check_positive(pp=pp, m=m)
    acts = {r: [Action(r, Kind.F, i) for i in range(m)] + [Action(r, Kind.B, i) for i in range(m)]
            for r in range(pp)}
    return Schedule("gpipe", pp, 1, m, acts)


def one_f_one_b(pp: int, m: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): rank r runs ``min(pp - r - 1, m)`` warm-up
    forwards, then alternates one forward and one backward, then drains the remaining backwards.
    Same bubble as GPipe, but at most ``pp - r`` microbatches are in flight on rank r instead of m."""
    _check_positive(pp=pp, m=m)
    acts = {}
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        ops = [Action(r, Kind.F, i) for i in range(warmup)]
        for i in range(m - warmup):                       # steady state
            ops += [Action(r, Kind.F, warmup + i), Action(r, Kind.B, i)]
        ops += [Action(r, Kind.B, i) for i in range(m - warmup, m)]  # cool-down
        acts[r] = ops
    return Schedule("1f1b", pp, 1, m, acts)


def interleaved_warmup(pp: int, m: int, v: int, rank: int) -> int:
    """Warm-up forwards of rank ``rank`` in Megatron's interleaved schedule: the last rank must forward
    all v-1 earlier chunks of a group of pp microbatches before its first backward can return, and each
    rank further up waits two more slots (one forward down, one backward up)."""
    return min(2 * (pp - rank - 1) + (v - 1) * pp, m * v)


def interleaved_1f1b(pp: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. SC'21 §2.2, Megatron's ``forward_backward_pipelining_with_
    interleaving``): each rank holds v chunks; microbatches go through a rank's chunks in groups of pp,
    so the bubble shrinks to ``(p-1)/(v m)`` of the ideal time at the price of v times more p2p
    messages. The k-th forward of every rank is chunk ``(k mod p v) // p`` of microbatch
    ``(k // p v) p + k mod p``; backwards walk the chunks in reverse. Needs ``m % pp == 0`` so that every
    group is full and all ranks agree on that order."""
    if v < 2:
        raise ValueError(f"interleaved_1f1b needs v >= 2 model chunks per rank, got v={v}; "
                         f"for one chunk per rank use one_f_one_b(pp={pp}, m={m})")
    if pp < 2:
        raise ValueError(f"interleaved_1f1b needs pp >= 2 pipeline ranks, got pp={pp}; "
                         f"with one rank there is no bubble to shrink: use schedule='gpipe' or '1f1b' (or pp > 1)")
    _check_positive(m=m)
    if m % pp:
        below, above = m // pp * pp, (m // pp + 1) * pp
        near = f"{below} or {above}" if below else f"{above}"
        raise ValueError(f"interleaved_1f1b needs the number of microbatches m to be a multiple of pp={pp}, "
                         f"got m={m}: use m in {pp}, {2 * pp}, {3 * pp}, ... (nearest: {near})")
    total, group = m * v, pp * v

    def chunk(k: int, forward: bool) -> int:
        c = (k % group) // pp
        return c if forward else v - 1 - c

    def microbatch(k: int) -> int:
        return (k // group) * pp + k % pp

    acts = {}
    for r in range(pp):
        warmup = interleaved_warmup(pp, m, v, r)
        fwd = [Action(chunk(k, True) * pp + r, Kind.F, microbatch(k)) for k in range(total)]
        bwd = [Action(chunk(k, False) * pp + r, Kind.B, microbatch(k)) for k in range(total)]
        ops = fwd[:warmup]
        for k in range(total - warmup):                   # steady state: forward k + warmup, backward k
            ops += [fwd[warmup + k], bwd[k]]
        acts[r] = ops + bwd[total - warmup:]
    return Schedule("interleaved_1f1b", pp, v, m, acts)


# of a microbatch's saved activations, what B keeps for W: each matmul's input and its output's gradient.
# Measured on the built-in GPT (8 layers, h 128, s 64, b 2): 4.19 MB kept against 4.22 MB saved a
# microbatch; the gradients W needs are about as large as the activations B frees
W_MEMORY = 1.0


SPLIT_SCHEDULES = ("zb-h1", "zb-h2", "zb-v")       # backward split into B and W (zero-bubble)


def make_schedule(name: str, pp: int, m: int, v: int, costs=None, resident=0) -> Schedule:
    """The compute-only schedule ``PipelineOptions.schedule`` names. ``costs`` (an ``ir.simulator.Costs``
    of the stages, once they are cut) and ``resident`` (bytes each rank holds whatever the schedule)
    shape the schedules generated by replaying the pipeline (ZB-H1, ZB-H2, ZB-V); the others are fixed patterns."""
    if name == "gpipe":
        return gpipe(pp, m)
    if name in ("1f1b", "auto"):     # "auto": 1F1B until the stages are cut and priced (passes/schedule_auto.py)
        return one_f_one_b(pp, m)
    if name in SPLIT_SCHEDULES:
        from autoshard.ir.zero_bubble import zero_bubble_h1, zero_bubble_h2, zero_bubble_v   # they build on this module
        generate, stages = {"zb-h1": (zero_bubble_h1, pp), "zb-h2": (zero_bubble_h2, pp),
                            "zb-v": (zero_bubble_v, 2 * pp)}[name]
        if costs is None:
            return generate(pp, m)
        w = [costs.w(s) for s in range(stages)]
        return generate(pp, m, f=list(costs.forward), b=[bw - x for bw, x in zip(costs.backward, w)], w=w,
                        activation=[max(a, 1) for a in costs.activation_bytes],
                        kept=[costs.kept(s) for s in range(stages)], resident=resident)
    return interleaved_1f1b(pp, m, v)


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be an int >= 1, got {value!r}")


def whole_backwards(actions: list) -> set:
    """``(stage, microbatch)`` of the split backwards this rank runs whole: stage 0's (its input gradient
    goes nowhere, so nothing waits for B) whose W comes right after its B. Splitting those would change
    nothing in the schedule's timing but add an action and a second pass over cold inputs (0.19 ms and
    2.5% of a backward on a CPU core, ``CostModel.cpu``); elsewhere B sends its input gradient before W runs."""
    out, previous = set(), None
    for a in actions:
        if not a.is_compute:
            continue
        if (a.kind is Kind.W and a.stage == 0 and previous is not None
                and previous == Action(a.stage, Kind.B, a.microbatch)):
            out.add((a.stage, a.microbatch))
        previous = a
    return out



# ------------------------------------------------------------------------------- lowering, checking

def add_communication(schedule: Schedule) -> Schedule:
    """Insert the boundary transfers: a RECV right before the compute that needs it and a SEND right
    after the compute that produced it, wherever neighbouring stages sit on different ranks. Keeping a
    SEND next to the following RECV lets an executor batch them into one ``batch_isend_irecv`` (Megatron's
    ``send_forward_recv_backward``)."""
    if schedule.lowered:
        raise ValueError(f"schedule {schedule.name!r} already has communication actions")
    last, rank_of = schedule.num_stages - 1, schedule.rank_of
    out: dict[int, list[Action]] = {}
    for r, acts in schedule.actions.items():
        ops = []
        for a in acts:
            s, i = a.stage, a.microbatch
            if a.kind is Kind.W:          # local: reads what B kept, sends nothing
                ops.append(a)
                continue
            if a.kind is Kind.F:
                before = s > 0 and rank_of(s - 1) != r
                after = s < last and rank_of(s + 1) != r
                recv, send = Action(s, Kind.RECV_F, i), Action(s, Kind.SEND_F, i)
            else:
                before = s < last and rank_of(s + 1) != r
                after = s > 0 and rank_of(s - 1) != r
                recv, send = Action(s, Kind.RECV_B, i), Action(s, Kind.SEND_B, i)
            if before:
                ops.append(recv)
            ops.append(a)
            if after:
                ops.append(send)
        out[r] = ops
    return Schedule(schedule.name, schedule.pp, schedule.virtual, schedule.microbatches,
                    _receives_in_send_order(out, rank_of), schedule.placement)


def _receives_in_send_order(out: dict, rank_of) -> dict:
    """Each channel (rank pair, one direction) delivers in the order it was sent. Where one channel
    carries forwards and backwards both (ZB-V's rank 0 -> 1 sends stage 0's F and stage 3's B), the
    receiver may need them in another order: it then receives the earlier-sent ones first, ahead of
    their use. No receive moves later, and everything received early was sent before what is needed,
    so none waits longer than it did."""
    sent = {}
    for r, ops in out.items():
        for a in ops:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                peer = rank_of(a.stage + (1 if a.kind is Kind.SEND_F else -1))
                sent.setdefault((r, peer), []).append(a)
    fixed = {}
    for r, ops in out.items():
        taken, at, new = set(), {}, []
        for a in ops:
            if a.kind not in (Kind.RECV_F, Kind.RECV_B):
                new.append(a)
                continue
            if a in taken:
                continue
            send = _matching_send(a)
            order = sent.get((rank_of(send.stage), r), [])
            k = at.get(send_channel := (rank_of(send.stage), r), 0)
            while k < len(order):
                early = _matching_recv(order[k])
                k += 1
                if early not in taken:
                    taken.add(early)
                    new.append(early)
                if early == a:
                    break
            at[send_channel] = k
        fixed[r] = new
    return fixed


def dependencies(schedule: Schedule) -> dict[Action, list[Action]]:
    """For every action, what must have finished (on any rank) before it may start, besides the actions
    before it on its own rank. One definition, read by ``validate`` and by the simulator."""
    last, rank_of, lowered = schedule.num_stages - 1, schedule.rank_of, schedule.lowered
    deps: dict[Action, list[Action]] = {}
    for a in (a for acts in schedule.actions.values() for a in acts):
        s, i = a.stage, a.microbatch
        if a.kind is Kind.F:
            cross = lowered and rank_of(s - 1) != rank_of(s)
            deps[a] = [] if s == 0 else [Action(s, Kind.RECV_F, i) if cross else Action(s - 1, Kind.F, i)]
        elif a.kind is Kind.B:
            cross = lowered and rank_of(s + 1) != rank_of(s)
            deps[a] = [Action(s, Kind.F, i)]
            deps[a] += [] if s == last else [Action(s, Kind.RECV_B, i) if cross else Action(s + 1, Kind.B, i)]
        elif a.kind is Kind.W:
            deps[a] = [Action(s, Kind.B, i)]
        elif a.kind in (Kind.RECV_F, Kind.RECV_B):
            deps[a] = [_matching_send(a)]
        else:  # a send needs the compute that made its value
            deps[a] = [Action(s, Kind.F if a.kind is Kind.SEND_F else Kind.B, i)]
    return deps


def execution_order(schedule: Schedule) -> list[Action]:
    """A global order in which every action's dependencies come first, found by advancing each rank as far
    as it can, round-robin. Raises if no rank can move: the schedule would hang."""
    deps = dependencies(schedule)
    pos = {r: 0 for r in schedule.actions}
    done: set[Action] = set()
    order: list[Action] = []
    total = sum(map(len, schedule.actions.values()))
    while len(order) < total:
        moved = False
        for r, acts in schedule.actions.items():
            while pos[r] < len(acts) and all(d in done for d in deps[acts[pos[r]]]):
                done.add(acts[pos[r]])
                order.append(acts[pos[r]])
                pos[r] += 1
                moved = True
        if not moved:
            stuck = {r: str(acts[pos[r]]) for r, acts in schedule.actions.items() if pos[r] < len(acts)}
            raise ValueError(f"schedule {schedule.name!r} deadlocks: each rank waits on {stuck}")
    return order


def validate(schedule: Schedule) -> dict[int, int]:
    """Check the schedule and return, per rank, the most microbatches in flight (forwards whose backward
    has not yet run): the number of activation sets that rank must hold, i.e. its memory promise."""
    pp, n, m = schedule.pp, schedule.num_stages, schedule.microbatches
    errors: list[str] = []
    seen: dict[Action, int] = {}
    for r, acts in schedule.actions.items():
        for a in acts:
            if not (0 <= a.stage < n and 0 <= a.microbatch < m):
                errors.append(f"rank {r}: {a} is outside {n} stages x {m} microbatches")
            elif schedule.rank_of(a.stage) != r:
                errors.append(f"rank {r}: {a} belongs to rank {schedule.rank_of(a.stage)}")
            seen[a] = seen.get(a, 0) + 1
    kinds = COMPUTE if schedule.split else (Kind.F, Kind.B)
    for s in range(n):
        for i in range(m):
            for kind in kinds:
                if seen.get(Action(s, kind, i), 0) != 1:
                    errors.append(f"{Action(s, kind, i)} runs {seen.get(Action(s, kind, i), 0)} times, not once")
    errors += [f"{a} appears {c} times" for a, c in seen.items() if c > 1 and not a.is_compute]
    if schedule.lowered:
        errors += _check_transfers(schedule)
    deps = dependencies(schedule)
    for r, acts in schedule.actions.items():  # each action after what it needs on its own rank
        index = {a: k for k, a in enumerate(acts)}
        for k, a in enumerate(acts):
            for d in deps[a]:
                if schedule.rank_of(d.stage) == r and index.get(d, len(acts)) > k:
                    errors.append(f"rank {r}: {a} runs before {d}, which it needs")
    if errors:
        raise ValueError(f"invalid schedule {schedule.name!r}:\n  " + "\n  ".join(errors[:20]))
    execution_order(schedule)
    return {r: peak_in_flight(schedule.actions.get(r, []), schedule.split) for r in range(pp)}


def peak_in_flight(actions: list, split: bool) -> int:
    """The most microbatches' activations a rank's actions hold at once: one from a forward to its
    backward; in a split schedule ``W_MEMORY`` of one from B to W (B keeps what W reads), rounded up."""
    live = peak = 0.0
    for a in actions:
        live += {Kind.F: 1.0, Kind.B: (W_MEMORY - 1.0) if split else -1.0, Kind.W: -W_MEMORY}.get(a.kind, 0.0)
        peak = max(peak, live)
    return math.ceil(peak - 1e-9)


def _check_transfers(schedule: Schedule) -> list[str]:
    """On each (sender, receiver) pair of ranks the receives come in the order of the sends. NCCL pairs
    the k-th send with the k-th receive (no tags), so any other order would hand a stage the wrong
    microbatch. (A missing receive shows up as a compute running before what it needs.)"""
    channels: dict[tuple[int, int], tuple[list[Action], list[Action]]] = {}
    for r, acts in schedule.actions.items():
        for a in acts:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                peer = schedule.rank_of(a.stage + (1 if a.kind is Kind.SEND_F else -1))
                channels.setdefault((r, peer), ([], []))[0].append(a)
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                send = _matching_send(a)
                channels.setdefault((schedule.rank_of(send.stage), r), ([], []))[1].append(send)
    return [f"rank {src} -> rank {dst}: sends {' '.join(map(str, sends))} but the receives expect "
            f"{' '.join(map(str, expected))}; the orders must agree"
            for (src, dst), (sends, expected) in channels.items() if sends != expected]


def _matching_recv(send: Action) -> Action:
    if send.kind is Kind.SEND_F:
        return Action(send.stage + 1, Kind.RECV_F, send.microbatch)
    return Action(send.stage - 1, Kind.RECV_B, send.microbatch)


def _matching_send(recv: Action) -> Action:
    if recv.kind is Kind.RECV_F:
        return Action(recv.stage - 1, Kind.SEND_F, recv.microbatch)
    return Action(recv.stage + 1, Kind.SEND_B, recv.microbatch)
