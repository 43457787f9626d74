"""Shard planning: choose one strategy per node so that the whole step costs least.

The problem is Alpa's intra-op ILP on one mesh axis (tp; the other axes are set by rule, see
``dp_placement``). Each node ``n`` picks one strategy ``x[n, i]`` (binary); each graph edge ``u -> v``
pays the collectives that move ``u``'s output placement to the placement ``v``'s strategy needs (priced
from ``ir.redistribute.plan_redistribute``); and each replicated tensor that feeds a sharded op pays one
backward all-reduce of its gradient (Megatron's ``f``), once however many sharded consumers it has
(``z[u]``). Edge variables ``y[e, a, r]`` are the marginals of the pair (producer's output placement
``a``, consumer's required placement ``r``): a transportation polytope between two one-hot vectors, so
they can stay continuous and the LP relaxation is tight.

Three steps, each returning a value: ``build_problem`` (strategies and the sparse ILP), ``solve`` (HiGHS,
proven optimal) and ``apply_solution`` (writes ``STRATEGY``, ``SPEC`` and ``REQUIRES_GRAD`` on every node
and returns the ``PlanReport``).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from autoshard.ir import meta as M
from autoshard.ir.options import CostModel
from autoshard.ir.placement import DistSpec, P, Partial, R, Replicate, Shard, shardable
from autoshard.ir.program import PlanReport
from autoshard.ir.redistribute import volume
from autoshard.passes.attention import attention_layouts, replicated_by_design
from autoshard.passes.block_fold import fold_map
from autoshard.passes.cost import (collectives_time, flops, replica_price, residual_stream_bytes, residual_stream_shape,
                                  transition)
from autoshard.passes.hints import block_hints, inherit_hints, offer_blocked_outputs
from autoshard.passes.rules import RuleContext, Strategy, shard_options, strategies_for
from autoshard.passes.shapes import module_path, shape_of, val
from autoshard.ir.errors import warn_user

FORBIDDEN = 1e9  # seconds: a choice the ILP must never take


class PlanError(ValueError):
    """The plan cannot be built (a pinned placement is impossible, the ILP is infeasible)."""


def itemsize(node):
    v = val(node)
    return v.element_size() if isinstance(v, torch.Tensor) else 4


def nbytes(node):
    s = shape_of(node)
    return (int(np.prod(s)) if s else 1) * itemsize(node)


def requires_grad(gm) -> dict:
    """Which nodes carry a gradient: floating tensors downstream of a parameter or a grad-requiring input."""
    rg = {}
    for n in gm.graph.nodes:
        v = val(n)
        floating = isinstance(v, torch.Tensor) and v.is_floating_point()
        if n.op == "placeholder":
            rg[n] = bool(M.REQUIRES_GRAD.get(n, False))
        elif isinstance(v, (list, tuple)):
            rg[n] = any(rg.get(i, False) for i in n.all_input_nodes)
        else:
            rg[n] = floating and any(rg.get(i, False) for i in n.all_input_nodes)
    return rg


def batch_dependent(gm) -> set:
    """Nodes computed from a user input: what a data-parallel replica holds its own slice of."""
    dep = set()
    for n in gm.graph.nodes:
        if (n.op == "placeholder" and M.KIND.get(n, None) == "input") or any(i in dep for i in n.all_input_nodes):
            dep.add(n)
    return dep


def dp_placement(node, dependent: set):
    """dp is set by rule, not planned: a value computed from the batch is ``Shard(0)`` (each replica holds
    its own rows; a scalar is a ``Partial`` sum over replicas), everything else ``Replicate``."""
    if node not in dependent or not isinstance(val(node), torch.Tensor):
        return R
    return Shard(0) if val(node).dim() > 0 else P


def partial_grad_use(strategy: Strategy, pos: int) -> bool:
    """A replicated input of an op whose output is not replicated gets a partial gradient (needs ``f``)."""
    return isinstance(strategy.ins[pos], Replicate) and not isinstance(strategy.out, Replicate)


def param_strategies(node, ctx, pins, replicated=frozenset()):
    shape = shape_of(node)
    name = M.NAME.get(node, None)
    if name in replicated and name not in pins:
        return [Strategy(R, ())]  # by design (attention.replicated_by_design): not priced as a lapse
    opts = [R] + shard_options(node, shape, ctx, allow_pad=False)
    if shape and not shardable(shape[0], ctx.t) and shardable(shape[0], ctx.t, allow_pad=True):
        opts.append(Shard(0))  # padded rows (vocab): consumers that accept it mask the tail
    if name in pins:
        want = pins[name]
        if want not in opts:
            raise PlanError(f"cannot pin parameter '{name}' (shape {tuple(shape)}) to {want!r} at {ctx.axis}={ctx.t}: "
                            f"possible placements are {opts}")
        opts = [want]
    return [Strategy(p, ()) for p in opts]


def strategy_cost(node, s: Strategy, t, cm: CostModel):
    """Seconds one step spends in this node under strategy ``s`` (forward + backward ~ 3x forward)."""
    if node.op == "placeholder":
        if isinstance(s.out, Replicate) and shape_of(node) and len(shape_of(node)) >= 2 and t > 1:
            return cm.replicated_weight_factor * nbytes(node) / cm.bandwidth
        return 0.0
    c = 3 * flops(node, shape_of) / cm.flops / (t if s.sharded else 1)
    for step in s.comm:
        c += cm.latency + volume(step.kind, 4 * step.numel, t) / cm.bandwidth
    return c


@dataclass
class Problem:
    """The ILP in sparse form, and how its columns map back to strategies."""
    strategies: dict                      # node -> [Strategy]
    fixed: set                            # nodes with one strategy (no variable)
    xidx: dict                            # (node, i) -> column of x[n, i]
    costs: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    cols: list = field(default_factory=list)
    vals: list = field(default_factory=list)
    lo: list = field(default_factory=list)
    hi: list = field(default_factory=list)
    forbidden: list = field(default_factory=list)   # columns that must be 0
    const: float = 0.0
    n_integer: int = 0                    # the first n_integer columns are the binary x's
    unruled: list = field(default_factory=list)
    fold: dict = field(default_factory=dict)     # node of a folded block -> its representative
    edges: dict = field(default_factory=dict)    # (u, v, pos) folded -> its edge variables {(a, r): column}

    def add_row(self, entries, lb, ub):
        r = len(self.lo)
        for c, v in entries:
            self.rows.append(r)
            self.cols.append(c)
            self.vals.append(v)
        self.lo.append(lb)
        self.hi.append(ub)

    def new_column(self, cost) -> int:
        self.costs.append(cost)
        return len(self.costs) - 1


@dataclass
class Solution:
    choice: dict                          # node -> Strategy
    objective: float
    seconds: float
    variables: int


def build_problem(gm, ctx: RuleContext, cm: CostModel, pins: dict, rg: dict, replicated=frozenset(),
                  outs: dict | None = None) -> Problem:
    """``outs``: nodes whose output placement is decided already (sequence parallelism's stream)."""
    strategies = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            strategies[n] = (param_strategies(n, ctx, pins, replicated) if M.KIND.get(n, None) == "parameter"
                             else [Strategy(R, ())])
        elif n.op == "call_function":
            inherit_hints(n, ctx)
            strategies[n] = strategies_for(n, ctx)
            offer_blocked_outputs(n, strategies[n], ctx)
        elif n.op == "output":
            strategies[n] = [Strategy(R, tuple(R for _ in n.all_input_nodes))]
    for n, want in (outs or {}).items():
        strategies[n] = [s for s in strategies[n] if s.out == want] or strategies[n]
    unknown_pins = set(pins) - {M.NAME.get(n, None) for n in gm.graph.nodes}
    if unknown_pins:
        raise PlanError(f"pinned parameter(s) {sorted(unknown_pins)} are not parameters of the model")

    fixed = {n for n, ss in strategies.items() if len(ss) == 1}
    # identical middle blocks share their representative's variables (passes/block_fold.py)
    fold = {n: r for n, r in fold_map(gm).items() if strategies.get(n) == strategies.get(r)}
    prob = Problem(strategies, fixed, {}, unruled=[f"`{n.name}` (`{n.target}`) in `{module_path(n)}`"
                                                   for n in ctx.unruled], fold=fold)
    for n, ss in strategies.items():
        if n not in fixed and n not in fold:
            for i, s in enumerate(ss):
                prob.xidx[n, i] = prob.new_column(strategy_cost(n, s, ctx.t, cm))
    for n, rep in fold.items():
        if n not in fixed:
            for i, s in enumerate(strategies[n]):
                prob.xidx[n, i] = prob.xidx[rep, i]
                prob.costs[prob.xidx[n, i]] += strategy_cost(n, s, ctx.t, cm)
    prob.n_integer = len(prob.costs)
    for n, ss in strategies.items():
        if n not in fixed and n not in fold:
            prob.add_row([(prob.xidx[n, i], 1.0) for i in range(len(ss))], 1.0, 1.0)

    fuse_uses = defaultdict(list)  # u -> [(v, j)]: strategies that use u replicated with a partial gradient
    stream = residual_stream_bytes(gm)
    for v, svs in strategies.items():
        for pos, u in enumerate(v.all_input_nodes):
            if u in strategies:
                _add_edge(prob, ctx, cm, u, v, pos, rg.get(u, False), fuse_uses, stream)
    zs = {}     # one z per representative: a folded block's f all-reduce prices the same z again
    for u, uses in fuse_uses.items():
        price = cm.latency + volume("all_reduce", nbytes(u), ctx.t) / cm.bandwidth if ctx.t > 1 else 0.0
        if any(v in fixed for v, _ in uses):
            prob.const += price
            continue
        key = (fold.get(u, u), tuple(sorted((fold.get(v, v).name, j) for v, j in uses)))
        if key in zs:
            prob.costs[zs[key]] += price
            continue
        z = zs[key] = prob.new_column(price)
        for v, j in uses:
            prob.add_row([(prob.xidx[v, j], 1.0), (z, -1.0)], -np.inf, 0.0)
    return prob


def _add_edge(prob: Problem, ctx, cm, u, v, pos, grad, fuse_uses, stream_bytes=0):
    """Price edge ``u -> v`` (input ``pos`` of ``v``) for every pair of placements the two may choose."""
    t, nb, shape = ctx.t, nbytes(u), shape_of(u)
    sus, svs = prob.strategies[u], prob.strategies[v]
    # Moving a weight (an all-gather each step) is ZeRO-3, not tensor parallelism: priced like
    # replicating it, so weights are consumed where they live.
    scale = cm.replicated_weight_factor if M.KIND.get(u, None) == "parameter" else 1.0
    is_list = isinstance(val(u), (list, tuple))  # a split's list cannot be redistributed, only its items

    def price(a, r):
        if is_list:
            return 0.0 if a == r else FORBIDDEN
        # (R->P writes a zeros tensor on all ranks but one: cheap, but not free -- adding a row-parallel
        # bias after the all-reduce, as Megatron does, avoids it. S->P writes one of the full size around
        # each rank's chunk, in memory and not over a link: a residual or bias added after the reduction
        # avoids it, and a full-size tensor wider than the stream is priced as the replica a gather would
        # make, so it is no way around the memory price (BitNet's MLP went S -> P -> reduce-scatter, four
        # collectives where one gather had been)
        extra = nb / cm.bandwidth if isinstance(a, Replicate) and isinstance(r, Partial) else 0.0
        if isinstance(a, Shard) and isinstance(r, Partial):
            extra = nb / cm.memory_bandwidth + replica_price(nb, stream_bytes, cm)
        return scale * collectives_time(transition(a, r, grad, shape, ctx.axis, t), nb, t, cm, stream_bytes) + extra

    if grad:
        fuse_uses[u].extend((v, j) for j, sv in enumerate(svs) if partial_grad_use(sv, pos))
    if u in prob.fixed and v in prob.fixed:
        prob.const += price(sus[0].out, svs[0].ins[pos])
    elif u in prob.fixed:
        for j, sv in enumerate(svs):
            prob.costs[prob.xidx[v, j]] += price(sus[0].out, sv.ins[pos])
    elif v in prob.fixed:
        for i, su in enumerate(sus):
            prob.costs[prob.xidx[u, i]] += price(su.out, svs[0].ins[pos])
    else:
        key = (prob.fold.get(u, u), prob.fold.get(v, v), pos)
        if key in prob.edges:      # an edge of a folded block: its costs go on the representative's edge
            for (a, r), c in prob.edges[key].items():
                prob.costs[c] += price(a, r)
            return
        outs = sorted({s.out for s in sus}, key=repr)
        reqs = sorted({s.ins[pos] for s in svs}, key=repr)
        yid = prob.edges[key] = {(a, r): prob.new_column(price(a, r)) for a in outs for r in reqs}
        prob.forbidden += [c for (a, r), c in yid.items() if is_list and a != r]
        for a in outs:
            prob.add_row([(yid[a, r], 1.0) for r in reqs]
                         + [(prob.xidx[u, i], -1.0) for i, s in enumerate(sus) if s.out == a], 0.0, 0.0)
        for r in reqs:
            prob.add_row([(yid[a, r], 1.0) for a in outs]
                         + [(prob.xidx[v, j], -1.0) for j, s in enumerate(svs) if s.ins[pos] == r], 0.0, 0.0)


def solve(prob: Problem, what: str) -> Solution:
    """Solve to proven optimality (only a proven optimum is the same on every rank)."""
    nvar = len(prob.costs)
    start = time.perf_counter()
    x, objective = np.zeros(nvar), prob.const
    if nvar:
        integrality = np.zeros(nvar)
        integrality[:prob.n_integer] = 1
        upper = np.ones(nvar)
        upper[prob.forbidden] = 0.0
        A = coo_matrix((prob.vals, (prob.rows, prob.cols)), shape=(len(prob.lo), nvar)).tocsr()
        # In microseconds, with no MIP gap: tie-breaks worth nanoseconds (where a bias is added) must not
        # fall under HiGHS's default absolute gap (1e-6), and a proven optimum is the same on every rank.
        res = milp(1e6 * np.asarray(prob.costs), integrality=integrality, bounds=Bounds(np.zeros(nvar), upper),
                   constraints=LinearConstraint(A, prob.lo, prob.hi), options={"time_limit": 300, "mip_rel_gap": 0.0})
        if res.status != 0 or res.x is None:
            raise PlanError(f"shard planning did not find a proven optimal plan at {what} ({res.message}); "
                            f"{nvar} variables")
        x, objective = res.x, float(res.fun) / 1e6 + prob.const
    choice = {}
    for n, ss in prob.strategies.items():
        choice[n] = ss[0] if n in prob.fixed else ss[int(np.argmax([x[prob.xidx[n, i]] for i in range(len(ss))]))]
    return Solution(choice, objective, time.perf_counter() - start, nvar)


def apply_solution(gm, sol: Solution, ctx: RuleContext, rg: dict, unruled: list, replicated=frozenset()) -> PlanReport:
    """Annotate every node with its strategy and spec; report what stayed replicated."""
    report = PlanReport(ctx.axis, ctx.t, sol.seconds, sol.objective, sol.variables, list(unruled))
    dependent = batch_dependent(gm)
    for n, choice in sol.choice.items():
        M.STRATEGY.set(n, choice)
        M.SPEC.set(n, DistSpec(dp=dp_placement(n, dependent)).with_axis(ctx.axis, choice.out))
        M.REQUIRES_GRAD.set(n, rg.get(n, False))
        if (M.KIND.get(n, None) == "parameter" and isinstance(choice.out, Replicate)
                and len(shape_of(n) or ()) >= 2 and ctx.t > 1 and M.NAME.get(n) not in replicated):
            report.replicated_weights.append(M.NAME.get(n))
    return report


def sequence_shards(gm, choice: dict, strategies: dict, t: int) -> dict:
    """Sequence parallelism (Korthikanti et al.): where the plan replicates the residual stream (the norms,
    dropouts and residual adds between a row-parallel output and the next column-parallel input, every
    rank computing the same ``[b, s, h]``), shard it along the sequence instead. The ILP is solved again
    with those nodes' outputs fixed to ``Shard(1)``: the row-parallel outputs' all-reduces become
    reduce-scatters, the column-parallel inputs gather the sequence back, and a norm weight's gradient,
    partial on each rank, is summed over tp by the same rule as any replicated tensor feeding a sharded
    op."""
    stream = residual_stream_shape(gm)
    out = {}
    for n, s in choice.items():
        if (n.op == "call_function" and isinstance(s.out, Replicate) and stream is not None
                and tuple(shape_of(n) or ()) == stream and stream[1] % t == 0):
            if any(o.out == Shard(1) for o in strategies[n]):
                out[n] = Shard(1)
    return out


def sequence_split_problem(gm, t: int) -> str | None:
    """Why the residual stream cannot be sharded along the sequence over ``t`` ranks, known before the
    plan (the stage balancer prices boundaries by it): no stream, or a sequence that does not split."""
    stream = residual_stream_shape(gm)
    if stream is None or len(stream) < 3:
        return "no [batch, sequence, hidden] residual stream was found (no embedding's output)"
    if stream[1] % t:
        up = -(-stream[1] // t) * t
        return (f"the sequence ({stream[1]} tokens) does not split evenly over tp={t}; pad the batch to "
                f"{up} tokens (labels -100 on the padding)")
    return None


def no_sequence_shards(gm, t: int) -> str:
    """Why ``sequence_shards`` found nothing to shard, and the fix where there is one."""
    return sequence_split_problem(gm, t) or (
        f"no tensor of the stream's shape {tuple(residual_stream_shape(gm))} sits replicated between a row-parallel "
        "output and the next column-parallel input (an embedding narrower than the layers, as OPT-350m's, or "
        "tokens added to the stream after the embedding)")


def plan_pass(gm, ctx):
    """Placements for every node on the tp axis, from the op rules and the ILP (``ctx``: the pass context)."""
    rctx = RuleContext(ctx.mesh, "tp", hints=block_hints(gm, ctx.mesh.tp))
    rg = requires_grad(gm)
    layouts = attention_layouts(gm, rctx.t)
    replicated = replicated_by_design(layouts, rctx.t)
    prob = build_problem(gm, rctx, ctx.options.cost_model, ctx.options.pins, rg, replicated)
    sol = solve(prob, f"tp={rctx.t}")
    if ctx.options.sequence_parallel and rctx.t > 1:
        stream = sequence_shards(gm, sol.choice, prob.strategies, rctx.t)
        if stream:
            rctx.unruled.clear()          # the second build lists them again
            prob = build_problem(gm, rctx, ctx.options.cost_model, ctx.options.pins, rg, replicated, outs=stream)
            sol = solve(prob, f"tp={rctx.t}, sequence parallel")
        else:
            warn_user(f"autoshard: sequence_parallel was asked for, but {no_sequence_shards(gm, rctx.t)}: "
                      "the model runs as plain tensor parallelism (all-reduces, the stream whole on every "
                      "rank)")
    report = apply_solution(gm, sol, rctx, rg, prob.unruled, replicated)
    report.attention = [lay.describe(rctx.t) for lay in layouts]
    gm.meta[M.PLAN_REPORT] = report
    return gm
