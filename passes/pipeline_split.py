"""Pipeline stage cuts: where the residual stream crosses, balanced by a cost model.

A cut between two nodes is legal when exactly one *activation* is live across it: a value computed from
both the parameters and the batch. That value is the residual stream, and it is what a stage sends.
Small activations may cross beside it (``Candidate.carried``): an MoE router's logits, which HF keeps
from every layer until the auxiliary loss at the end, or a running scalar. They are sent with the
stream in one packed transfer (``passes/stages.py``); without them no cut would be legal after the
first router.
Values that depend only on the inputs and buffers (positions, masks, rotary tables) or only on the
parameters are not activations: every stage that needs them recomputes them (``passes/stages.py``), and
the dump lists them. No module names are involved in finding the cuts.

Each stretch of graph between two candidate cuts is priced for one microbatch (``passes/stage_prices.py``):
time (a matmul by its flops, anything else by the bytes it moves, whichever is slower), the bytes its
parameters hold with their gradients and AdamW state, and the activation bytes its forward keeps. The embedding and the LM
head with its loss are priced like everything else, so a big vocabulary makes its stages short. A
dynamic programme chooses the ``pp * v`` chunks that minimise the slowest chunk's time (the pipeline's
step time is set by its slowest stage), subject to an optional memory limit per rank where a stage's
activations count once per microbatch the schedule keeps in flight on its rank (``p - r`` under 1F1B).

``pipeline_cuts=[k, ...]`` overrides the balancer: stage i+1 starts at layer ``cuts[i]``, a layer being an
index into the model's longest repeated ``ModuleList`` (this mapping is the one place module paths are
read, because a user's layer index is one).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir.options import CostModel, scatter_gather_on
from autoshard.ir.pipeline import STAGE_PLAN, StageCost, StagePlan
from autoshard.ir.schedule import SPLIT_SCHEDULES, make_schedule, validate
from autoshard.passes.shapes import val
from autoshard.passes.schedule_auto import choose_schedule, choose_virtual, price_schedule, tries_the_v
from autoshard.passes.activation_share import activation_share
from autoshard.passes.chunk_loss import heads_with_the_loss
from autoshard.passes.plan import sequence_split_problem
from autoshard.passes.stage_prices import (PerRankRecompute, Segments, _nbytes, boundary_link, kept_for_w, layer_of,
                                           layer_prefix, predict, price, simulation_costs)
from autoshard.ir.errors import warn_user

class PipelineSplitError(ValueError):
    """The model cannot be cut as asked; the message says how it can be."""


def activations(gm: fx.GraphModule) -> set:
    """Nodes computed from both a parameter and a user input: what cannot be recomputed on another stage."""
    from_param, from_input = set(), set()
    for n in gm.graph.nodes:
        kind = M.KIND.get(n, None) if n.op == "placeholder" else None
        if kind == "parameter" or any(i in from_param for i in n.all_input_nodes):
            from_param.add(n)
        if kind == "input" or any(i in from_input for i in n.all_input_nodes):
            from_input.add(n)
    return from_param & from_input


# A value crossing a cut beside the residual stream is at most this fraction of the stream's bytes: an
# MoE router's logits, kept to the end for the auxiliary loss ([tokens, experts] beside [tokens, hidden]),
# or a running scalar. Anything larger (a layer's half-computed attention or MLP) is no place to cut.
CARRIED_FRACTION = 1 / 4


@dataclass(frozen=True)
class Candidate:
    """A legal cut: after node ``position`` the residual stream ``boundary`` is live, and beside it only
    the small activations ``carried`` (sent with it, in graph order)."""
    position: int
    boundary: fx.Node
    carried: tuple = ()

    @property
    def values(self) -> tuple:
        return (self.boundary,) + self.carried

    @property
    def nbytes(self) -> int:
        """What a cut here sends per microbatch (global shapes)."""
        return sum(_nbytes(val(v)) for v in self.values)


def _floating(v) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def candidates(gm: fx.GraphModule, act: set) -> list:
    """Every place to cut, in graph order: where one activation is live (the residual stream; a float
    tensor of rank >= 2), or the residual stream and small float values carried beside it. A residual
    stream with company must have a shape the stream has alone somewhere (after the embedding, say), so
    a layer's wide MLP intermediate, live beside the stream it will be added to, is no cut. Of
    consecutive places with the same residual stream, the one that carries least."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((pos[u] for u in n.users), default=pos[n]) for n in act}
    places, live = [], set()
    for i, n in enumerate(nodes):
        if n in act:
            live.add(n)
        live = {a for a in live if last_use[a] > i}
        if live and n.op != "output":
            b = max(live, key=lambda a: (_nbytes(val(a)), -pos[a]))
            if _floating(val(b)) and val(b).dim() >= 2:
                places.append(Candidate(i, b, tuple(sorted(live - {b}, key=pos.__getitem__))))
    stream_shapes = {tuple(val(c.boundary).shape) for c in places if not c.carried}
    out = []
    for cand in places:
        stream = val(cand.boundary)
        if cand.carried and (tuple(stream.shape) not in stream_shapes or not all(
                _floating(val(a)) and _nbytes(val(a)) <= CARRIED_FRACTION * _nbytes(stream) for a in cand.carried)):
            continue
        if out and out[-1].boundary is cand.boundary:
            if cand.nbytes < out[-1].nbytes:
                out[-1] = cand
            continue
        out.append(cand)
    return out


def _fits(cost: StageCost, rank_in_flight: float, limit) -> bool:
    """Within the memory limit, and holding a parameter: a stage without one (the loss alone, say) would
    leave its rank with nothing to optimise (``torch.optim`` refuses an empty parameter list)."""
    return cost.param_bytes > 0 and (limit is None or cost.param_bytes + cost.activation_bytes * rank_in_flight <= limit)


def balance(seg: Segments, stages: int, pp: int, in_flight: dict, v: int, tp: int, limit=None, send=None,
            rank_of=None) -> list:
    """Cut indices (into the candidate list) minimising the slowest chunk, each chunk within ``limit``
    bytes of memory (a rank's limit shared by its v chunks; ``rank_of(chunk)``, the schedule's placement,
    says whose: round-robin by default, ZB-V's V otherwise). Dynamic programme over (chunk, end).
    ``send[j]`` is the time to send the boundary that ends stretch j - 1: a chunk pays for what it sends, so
    a cut through a wide tensor (the logits) is priced as such."""
    send = send or [0.0] * (len(seg.seconds) + 1)
    n = len(seg.seconds)              # stretches; chunk k covers stretches [i, j)
    if stages > n:
        raise PipelineSplitError(f"the model offers {n - 1} places to cut (where the residual stream crosses "
                                 f"with at most small values beside it), so at most {n} stages; asked for pp x v = {stages}")
    share = None if limit is None else limit / v
    # best[k][j]: (slowest chunk, sum of squared chunk times) over the first j stretches in k chunks. The
    # slowest chunk sets the step time; the squares break ties towards balancing the others too.
    worst_case = (float("inf"), float("inf"))
    best = [[worst_case] * (n + 1) for _ in range(stages + 1)]
    back = [[-1] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    costs = {}
    for k in range(1, stages + 1):
        flight = in_flight.get(rank_of(k - 1) if rank_of is not None else (k - 1) % pp, 1) / v
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == worst_case:
                    continue
                which = seg.priced_as(k - 1, rank_of)
                c = costs.get((i, j, id(which))) or costs.setdefault((i, j, id(which)), which.chunk(i, j, tp))
                if not _fits(c, flight, share):
                    continue
                # forward + backward is 3 forwards, and a recompute one more: priced in forwards
                t = c.forward_seconds + c.recompute_seconds / 3 + (send[j] if j < n else 0.0)
                option = (max(best[k - 1][i][0], t), best[k - 1][i][1] + t * t)
                if option < best[k][j]:
                    best[k][j], back[k][j] = option, i
    if best[stages][n] == worst_case and limit is None:
        raise PipelineSplitError(f"no {stages}-stage split gives every stage a parameter (the model's cut points "
                                 "between its parameters are too few): use fewer stages (pp x v)")
    if best[stages][n] == worst_case:
        least = seg.chunk(0, n, tp).param_bytes / stages
        raise PipelineSplitError(f"no {stages}-stage split fits memory_limit={limit:.3g} bytes per rank (the "
                                 f"parameters alone need about {least:.3g} per stage): raise the limit, use more "
                                 "stages or tensor parallelism, or fewer microbatches in flight (schedule='1f1b')")
    cuts, j = [], n
    for k in range(stages, 0, -1):
        i = back[k][j]
        cuts.append(i)
        j = i
    return sorted(cuts)[1:]           # stretch indices where chunks 1.. start


def manual_cuts(gm: fx.GraphModule, cands: list, layers: tuple, prefix, count: int) -> list:
    """Stretch indices for ``pipeline_cuts``: stage i+1 starts at layer ``layers[i]``."""
    if prefix is None:
        raise PipelineSplitError("pipeline_cuts names layers, but the model has no repeated ModuleList of layers; "
                                 "leave pipeline_cuts out to let the cost model cut")
    if list(layers) != sorted(set(layers)) or not all(0 < c < count for c in layers):
        raise PipelineSplitError(f"pipeline_cuts={list(layers)} must be increasing layer indices in 1..{count - 1} "
                                 f"(the model's '{prefix}' has {count} layers)")
    first = {}
    for i, n in enumerate(gm.graph.nodes):
        layer = layer_of(n, prefix)
        if layer is not None:
            first.setdefault(layer, i)
    out = []
    for c in layers:
        k = max((k for k, cand in enumerate(cands) if cand.position < first[c]), default=None)
        if k is None or (out and k + 1 <= out[-1]):
            raise PipelineSplitError(f"pipeline_cuts: no cut point between layer {c - 1} and layer {c} "
                                     "(more than the residual stream and small values beside it cross there)")
        out.append(k + 1)
    return out


def uniform_cuts(count: int, stages: int) -> tuple:
    """Layer indices that give every stage the same number of layers (torchtitan's default split)."""
    return tuple(round(i * count / stages) for i in range(1, stages))


def pipeline_split_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    opts = ctx.options.pipeline
    if opts is None:
        return gm
    pp, tp, cm = ctx.mesh.pp, ctx.mesh.tp, ctx.options.cost_model
    if cm == CostModel() and not torch.cuda.is_available():
        cm = CostModel.cpu()        # the machine the stages will run on, unless the user priced it
    act = activations(gm)
    cands = candidates(gm, act)
    prefix = layer_prefix(gm)
    count = len({layer_of(n, prefix) for n in gm.graph.nodes} - {None})
    # where the stream cannot split along the sequence (plan_pass warns), the boundaries travel whole
    sp = ctx.options.sequence_parallel if tp > 1 and not sequence_split_problem(gm, tp) else False
    share = activation_share(gm, cands, tp, sp, selective=False)
    in_b = frozenset(heads_with_the_loss(gm, ctx.options.loss_chunk_rows, tp))    # their dW comes with the loss
    seg = whole = price(gm, act, cands, cm, prefix, share, in_b)
    if ctx.options.recompute == "selective":
        seg = price(gm, act, cands, cm, prefix, activation_share(gm, cands, tp, sp, selective=True), in_b)
    elif ctx.options.recompute is True:
        seg = whole.with_recompute(cands, share)
    cm = boundary_link(cm, tp, sp, scatter_gather_on(opts.scatter_gather))

    def staged(name: str, v: int) -> StagePlan:
        return _stage_plan(gm, ctx, cm, name, v, cands, prefix, count, seg, whole)
    v_too = tries_the_v(opts, pp, len(cands) + 1, ctx.options.codegen)
    try:
        plan = staged(opts.schedule, opts.virtual_stages)
    except PipelineSplitError as e:         # memory: the V may still fit
        if not v_too:
            raise
        plan, first_error = None, e
    if v_too:
        try:
            vee = staged("zb-v", 2)
        except PipelineSplitError as e:     # fewer places to cut than 2p stages need, or memory
            if plan is None:
                raise first_error from e
            plan.schedule_choice += f" zb-v (2 stages a rank, in a V): not possible here ({str(e).split(':')[0]})."
            vee = None
        if vee is not None and plan is None:
            vee.schedule_choice = (f"schedule='auto' chose zb-v: on one stage a rank nothing fits ({first_error}). "
                                   + vee.schedule_choice)
            plan = vee
        elif vee is not None:
            plan = choose_virtual(plan, vee, opts.memory_limit)
    for c in plan.stretches:
        for value in cands[c - 1].values:
            M.CUT.set(value, value.name)
    gm.meta[STAGE_PLAN] = plan
    return gm


def _stage_plan(gm, ctx, cm, name: str, v: int, cands, prefix, count, seg, whole) -> StagePlan:
    """Schedule ``name`` with ``v`` stages a rank: the cuts (balanced, or given), each stage's cost, the
    schedule generated or chosen on them (``schedule="auto"``), and the simulated step and peak."""
    opts, pp, tp, m = ctx.options.pipeline, ctx.mesh.pp, ctx.mesh.tp, ctx.options.pipeline.microbatches
    stages = pp * v
    schedule = make_schedule(name, pp, m, v)
    if seg is not whole and ctx.options.recompute_stages is not None:     # only these pipeline ranks recompute
        seg = PerRankRecompute(seg, whole, frozenset(ctx.options.recompute_stages), schedule.rank_of)
    if opts.stretches is not None:       # another program's cuts (the eval program takes its training one's)
        if len(opts.stretches) != stages - 1 or not all(0 < c < len(seg.seconds) for c in opts.stretches):
            raise PipelineSplitError(f"this program offers {len(cands)} cut points, and cannot be cut where its "
                                     f"training program was ({list(opts.stretches)})")
        cuts, how = list(opts.stretches), "as the training program"
    elif opts.cuts is not None:
        if len(opts.cuts) != stages - 1:
            raise PipelineSplitError(f"pipeline_cuts has {len(opts.cuts)} entries; pp x v = {stages} stages need "
                                     f"{stages - 1} (the layer index where each stage after the first starts)")
        cuts, how = manual_cuts(gm, cands, opts.cuts, prefix, count), "pipeline_cuts"
    elif stages == 1:
        cuts, how = [], "one stage"
    else:
        send = [0.0] + [cm.p2p_latency + c.nbytes / cm.p2p_bandwidth for c in cands] + [0.0]
        in_flight = validate(schedule)
        cuts, how = balance(seg, stages, pp, in_flight, v, tp, None, send, schedule.rank_of), "balanced"
    costs, step, peak = predict(seg, cuts, schedule, tp, cm, cands)
    if how == "balanced" and opts.memory_limit is not None and max(peak.values()) > opts.memory_limit:
        # the balancer gives each of a rank's v chunks an equal share of the limit: where the cuts it
        # finds without one fit as the simulator replays them, they stand (a V's heavy head chunk and a
        # light neighbour on one rank), else it cuts again within the shares
        cuts = balance(seg, stages, pp, in_flight, v, tp, opts.memory_limit, send, schedule.rank_of)
        costs, step, peak = predict(seg, cuts, schedule, tp, cm, cands)
    choice = ""
    if name == "auto" or name in SPLIT_SCHEDULES:   # generated or chosen on these stages' costs
        kept = kept_for_w(whole, [0] + list(cuts) + [len(seg.seconds)], tp)

        def priced(c, s):
            return predict(seg, c, s, tp, cm, cands, whole)
    if name == "auto":
        best, choice = choose_schedule(priced, cuts, pp, m, costs, opts.memory_limit, ctx.options.codegen, kept)
        schedule, costs, step, peak = best.schedule, best.costs, best.step, best.peak
    elif name in SPLIT_SCHEDULES:
        mine = price_schedule(name, priced, cuts, pp, m, costs, opts.memory_limit, kept, v)
        schedule, costs, step, peak = mine.schedule, mine.costs, mine.step, mine.peak
        against = "interleaved" if v > 1 else "1f1b"        # the unsplit schedule on the same stages
        try:
            base = price_schedule(against, priced, cuts, pp, m, costs, opts.memory_limit, v=v).step
        except ValueError:       # interleaved 1F1B needs m % pp == 0
            base = None
        if base is not None:
            choice = f"{name} predicts {step * 1e3:.3f} ms a step, {against} {base * 1e3:.3f} ms on the same cuts."
        if base is not None and step > base * 1.001 and opts.schedule == name:
            warn_user(f"schedule={name!r} is predicted slower than {against} on these stages ({step * 1e3:.3f} "
                      f"against {base * 1e3:.3f} ms: its split backward costs more than the bubble it fills, "
                      "or uneven stages leave W little room); schedule='auto' picks the faster")
    plan = StagePlan(stages, [cands[c - 1].boundary.name for c in cuts], costs, how, len(cands), count, step, peak,
                     stretches=list(cuts), carried=[tuple(a.name for a in cands[c - 1].carried) for c in cuts],
                     schedule=schedule, schedule_choice=choice,
                     simulation=simulation_costs(seg, cuts, schedule, tp, cm, cands, costs, whole))
    if stages > 1 and count >= stages:
        ucuts = uniform_cuts(count, stages)
        try:
            _, ustep, upeak = predict(seg, manual_cuts(gm, cands, ucuts, prefix, count), schedule, tp, cm, cands,
                                      whole)
            plan.uniform = {"cuts": ucuts, "step": ustep, "peak": upeak}
        except PipelineSplitError:
            plan.uniform = None
    return plan
