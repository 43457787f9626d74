"""Shard planning: choose one strategy per node so that the whole step costs least.

The problem is Alpa's intra-op ILP restricted to one mesh axis. Each node ``n`` picks one strategy
``x[n, i]`` (binary); each graph edge ``u -> v`` pays the collectives that move ``u``'s output placement to
the placement ``v``'s strategy needs (``cost.transition``); and each replicated tensor that feeds a
sharded op pays one backward all-reduce of its gradient (Megatron's ``f``), once however many sharded
consumers it has (``z[u]``). Edge variables ``y[e, a, r]`` are the marginals of the pair (producer's
output placement ``a``, consumer's required placement ``r``): a transportation polytope between two
one-hot vectors, so they can stay continuous and the LP relaxation is tight.

Results land in ``node.meta["tp_strategy"]`` and ``node.meta["placement"]``.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from autoshard.passes.cost import CostModel, collectives_time, flops, transition, volume
from autoshard.passes.rules import RuleContext, Strategy, block_hints, shard_options, strategies_for
from autoshard.passes.shapes import shape_of, val
from autoshard.passes.spec import R, Partial, Replicate, Shard, shardable


FORBIDDEN = 1e9  # seconds: a choice the ILP must never take


class PlanError(ValueError):
    """The plan cannot be built (a pinned placement is impossible, the ILP is infeasible)."""


@dataclass
class PlanInfo:
    t: int
    solve_seconds: float = 0.0
    objective: float = 0.0
    variables: int = 0
    unruled: list = field(default_factory=list)        # nodes replicated for want of a rule
    replicated_weights: list = field(default_factory=list)


def itemsize(node):
    v = val(node)
    return v.element_size() if isinstance(v, torch.Tensor) else 4


def nbytes(node):
    s = shape_of(node)
    return (int(np.prod(s)) if s else 1) * itemsize(node)


def requires_grad(gm):
    """Which nodes carry a gradient: floating tensors downstream of a parameter."""
    rg = {}
    for n in gm.graph.nodes:
        v = val(n)
        floating = isinstance(v, torch.Tensor) and v.is_floating_point()
        if n.op == "placeholder":
            rg[n] = n.meta.get("autoshard_kind") == "parameter" or n.meta.get("autoshard_requires_grad", False)
        elif isinstance(v, (list, tuple)):
            rg[n] = any(rg.get(i, False) for i in n.all_input_nodes)
        else:
            rg[n] = floating and any(rg.get(i, False) for i in n.all_input_nodes)
    return rg


def partial_grad_use(strategy: Strategy, pos: int) -> bool:
    """A replicated input of an op whose output is not replicated gets a partial gradient (needs ``f``)."""
    return isinstance(strategy.ins[pos], Replicate) and not isinstance(strategy.out, Replicate)


def param_strategies(node, ctx, pins):
    shape = shape_of(node)
    name = node.meta.get("autoshard_name")
    opts = [R] + shard_options(node, shape, ctx, allow_pad=False)
    if shape and len(shape) >= 1 and not shardable(shape[0], ctx.t) and shardable(shape[0], ctx.t, allow_pad=True):
        opts.append(Shard(0))  # padded rows (vocab): consumers that accept it mask the tail
    if name in pins:
        want = pins[name]
        if want not in opts:
            raise PlanError(f"cannot pin parameter '{name}' (shape {tuple(shape)}) to {want!r} at tp={ctx.t}: "
                            f"possible placements are {opts}")
        opts = [want]
    return [Strategy(p, ()) for p in opts]


def strategy_cost(node, s: Strategy, t, cm: CostModel, shape_fn=shape_of):
    """Seconds one step spends in this node under strategy ``s`` (forward + backward ~ 3x forward)."""
    if node.op == "placeholder":
        if isinstance(s.out, Replicate) and shape_of(node) and len(shape_of(node)) >= 2 and t > 1:
            return cm.replicated_weight_factor * nbytes(node) / cm.bandwidth
        return 0.0
    c = 3 * flops(node, shape_fn) / cm.flops / (t if s.sharded else 1)
    for kind, n in s.comm:
        c += cm.latency + volume(kind, 4 * n, t) / cm.bandwidth
    return c


def plan_pass(gm, t: int, cost_model: CostModel | None = None, pins: dict | None = None, info: PlanInfo | None = None):
    cm = cost_model or CostModel()
    pins = pins or {}
    info = info if info is not None else PlanInfo(t)
    ctx = RuleContext(t, hints=block_hints(gm, t))
    rg = requires_grad(gm)

    strategies = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            strategies[n] = (param_strategies(n, ctx, pins) if n.meta.get("autoshard_kind") == "parameter"
                             else [Strategy(R, ())])
        elif n.op == "call_function":
            strategies[n] = strategies_for(n, ctx)
        elif n.op == "output":
            strategies[n] = [Strategy(R, tuple(R for _ in n.all_input_nodes))]
    unknown_pins = set(pins) - {n.meta.get("autoshard_name") for n in gm.graph.nodes}
    if unknown_pins:
        raise PlanError(f"pinned parameter(s) {sorted(unknown_pins)} are not parameters of the model")
    info.unruled = list(ctx.unruled)

    # --- variables ----------------------------------------------------------------------------------
    planned = [n for n in strategies if len(strategies[n]) > 1]
    xidx = {}
    costs = []
    for n in planned:
        for i, s in enumerate(strategies[n]):
            xidx[n, i] = len(costs)
            costs.append(strategy_cost(n, s, t, cm))
    nx = len(costs)
    const = 0.0
    rows, cols, vals, lo, hi = [], [], [], [], []
    nrow = 0

    def add_row(entries, lb, ub):
        nonlocal nrow
        for c, v in entries:
            rows.append(nrow); cols.append(c); vals.append(v)
        lo.append(lb); hi.append(ub)
        nrow += 1

    for n in planned:
        add_row([(xidx[n, i], 1.0) for i in range(len(strategies[n]))], 1.0, 1.0)

    fixed_choice = {n: 0 for n in strategies if len(strategies[n]) == 1}
    forbidden = []  # variables that must be 0 (a list changing placement)
    fuse_uses = defaultdict(list)  # u -> [(v, i)] strategies that use u replicated with a partial gradient
    for v, svs in strategies.items():
        for pos, u in enumerate(v.all_input_nodes):
            if u not in strategies:
                continue
            nb, grad = nbytes(u), rg.get(u, False)
            sus = strategies[u]
            # Moving a weight (an all-gather each step) is ZeRO-3, not tensor parallelism: priced like
            # replicating it, so weights are consumed where they live.
            scale = cm.replicated_weight_factor if u.meta.get("autoshard_kind") == "parameter" else 1.0
            shape = shape_of(u)
            def price(a, r, nb=nb, grad=grad, shape=shape, scale=scale):
                extra = nb / cm.bandwidth if isinstance(a, Replicate) and isinstance(r, Partial) else 0.0
                # (R->P writes a zeros tensor on all ranks but one: cheap, but not free -- adding a
                # row-parallel bias after the all-reduce, as Megatron does, avoids it)
                return scale * collectives_time(transition(a, r, grad, shape, t), nb, t, cm) + extra
            is_list = isinstance(val(u), (list, tuple))  # a split's list cannot be redistributed, only its items
            if is_list:
                price = lambda a, r: 0.0 if a == r else FORBIDDEN
            if grad:
                for j, sv in enumerate(svs):
                    if partial_grad_use(sv, pos):
                        fuse_uses[u].append((v, j))
            if u in fixed_choice and v in fixed_choice:
                const += price(sus[0].out, svs[0].ins[pos])
            elif u in fixed_choice:
                for j, sv in enumerate(svs):
                    costs[xidx[v, j]] += price(sus[0].out, sv.ins[pos])
            elif v in fixed_choice:
                for i, su in enumerate(sus):
                    costs[xidx[u, i]] += price(su.out, svs[0].ins[pos])
            else:
                outs = sorted({s.out for s in sus}, key=repr)
                reqs = sorted({s.ins[pos] for s in svs}, key=repr)
                yid = {}
                for a in outs:
                    for r in reqs:
                        yid[a, r] = len(costs)
                        costs.append(price(a, r))
                        if is_list and a != r:
                            forbidden.append(yid[a, r])
                for a in outs:
                    add_row([(yid[a, r], 1.0) for r in reqs]
                            + [(xidx[u, i], -1.0) for i, s in enumerate(sus) if s.out == a], 0.0, 0.0)
                for r in reqs:
                    add_row([(yid[a, r], 1.0) for a in outs]
                            + [(xidx[v, j], -1.0) for j, s in enumerate(svs) if s.ins[pos] == r], 0.0, 0.0)

    for u, uses in fuse_uses.items():
        price = cm.latency + volume("all_reduce", nbytes(u), t) / cm.bandwidth if t > 1 else 0.0
        if any(v in fixed_choice for v, _ in uses):
            const += price
            continue
        z = len(costs)
        costs.append(price)
        for v, j in uses:
            add_row([(xidx[v, j], 1.0), (z, -1.0)], -np.inf, 0.0)

    nvar = len(costs)
    info.variables = nvar
    integrality = np.zeros(nvar)
    integrality[:nx] = 1
    upper = np.ones(nvar)
    upper[forbidden] = 0.0
    start = time.perf_counter()
    if nvar:
        A = coo_matrix((vals, (rows, cols)), shape=(nrow, nvar)).tocsr()
        # In microseconds, with no MIP gap: tie-breaks worth nanoseconds (where a bias is added) must not
        # fall under HiGHS's default absolute gap (1e-6), and a proven optimum is the same on every rank.
        res = milp(1e6 * np.asarray(costs), integrality=integrality, bounds=Bounds(np.zeros(nvar), upper),
                   constraints=LinearConstraint(A, lo, hi), options={"time_limit": 300, "mip_rel_gap": 0.0})
        # Only a proven optimum is the same on every rank; a time-limited incumbent may not be.
        if res.status != 0 or res.x is None:
            raise PlanError(f"shard planning did not find a proven optimal plan at tp={t} "
                            f"({res.message}); {nvar} variables")
        x = res.x
        info.objective = float(res.fun) / 1e6 + const
    info.solve_seconds = time.perf_counter() - start

    for n, ss in strategies.items():
        if n in fixed_choice:
            choice = ss[0]
        else:
            choice = ss[int(np.argmax([x[xidx[n, i]] for i in range(len(ss))]))]
        n.meta["tp_strategy"] = choice
        n.meta["placement"] = choice.out
        n.meta["requires_grad"] = rg.get(n, False)
        if (n.meta.get("autoshard_kind") == "parameter" and isinstance(choice.out, Replicate)
                and len(shape_of(n) or ()) >= 2 and t > 1):
            info.replicated_weights.append(n.meta.get("autoshard_name"))
    return gm
