"""ZeRO stage 1: the optimizer state sharded over the data-parallel group.

Every dp replica holds the same parameters and, after ``pm.step``, the same summed gradients. Each dp
rank is made the *owner* of a share of the parameters (whole tensors, balanced by size, the same
assignment on every rank); its inner optimizer (any ``torch.optim`` class) holds state for those only,
and steps only those. Then each owner broadcasts its updated parameters to the other replicas, one
flattened buffer per owner. AdamW's two moments, twice the parameters' bytes in fp32, shrink to about
``1/dp`` per rank; parameters and gradients stay whole (that would be ZeRO-2 and 3).

The whole-tensor partition is ``torch.distributed.optim.ZeroRedundancyOptimizer``'s; that class itself
does not take DTensor parameters, which these are on a tensor-parallel mesh. Each tensor-parallel rank
partitions its own local shards the same way, so owners are per (pp, tp) coordinate.

Tied weights need no care here: ``pm.step`` has summed the copies' gradients over their pipeline ranks
(after the dp sum) before any optimizer runs, so each copy's owner updates it identically.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def partition(sizes: dict, ranks: int) -> dict:
    """``{name: owner}``: largest first, each to the least loaded rank (ties: lower rank, then name)."""
    loads, owner = [0] * ranks, {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(ranks), key=lambda k: (loads[k], k))
        owner[name] = r
        loads[r] += sizes[name]
    return owner


def group_names(groups, params: dict, model_names: dict | None = None) -> list:
    """``[(names, options)]`` of ``pm.optimizer(..., params=[{"params": [...], **options}, ...])``: each
    group's parameters given by name or as ``pm``'s parameters; a parameter in no group is not stepped.
    A name of the model's (``model_names``: each to the name ``pm`` gives it, a tied weight's other
    names included) that another pipeline stage holds is skipped, so every rank can build its groups from
    the whole model's names."""
    by_id = {id(p): n for n, p in params.items()}
    model_names = model_names or {}
    out, seen = [], set()
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"optimizer param group {i} is {type(group).__name__}: give a dict with 'params' (names "
                            "or pm's parameters) and its options, as torch.optim takes")
        names = []
        for x in ([group["params"]] if isinstance(group["params"], (str, torch.Tensor)) else group["params"]):
            name = model_names.get(x, x) if isinstance(x, str) else by_id.get(id(x))
            if name in model_names and name not in params:
                continue                     # held by another pipeline stage: its rank steps it
            if name not in params:
                what = f"'{x}'" if isinstance(x, str) else "a tensor"
                raise ValueError(f"optimizer param group {i} holds {what} that is not a parameter of this pm: "
                                 "give the model's parameter names (pm.named_parameters() lists this rank's; a name "
                                 "another pipeline stage holds is skipped) or pm's own parameters, not the "
                                 "single-device model's tensors")
            if name in names:                # a tied weight named twice (its embedding and head names)
                continue
            if name in seen:
                raise ValueError(f"parameter {name} is in more than one optimizer param group")
            seen.add(name)
            names.append(name)
        out.append((names, {k: v for k, v in group.items() if k != "params"}))
    return out


class ZeroOptimizer(torch.optim.Optimizer):
    """``pm.optimizer(torch.optim.AdamW, zero=1, lr=...)``: a ``torch.optim.Optimizer`` (so LR schedulers,
    hooks and ``param_groups`` work as with any), holding state for this rank's share only. Param groups
    (``params=[{"params": names, "weight_decay": 0.0}, ...]``) are split by owner; every rank keeps every
    group, empty ones holding a zero-size placeholder, so group indices and hyper-parameter changes agree.
    It does not call ``Optimizer.__init__``: the parameters it steps are the inner optimizer's."""

    def __init__(self, pm, optimizer_class, params=None, **defaults):
        self.pm = pm
        self.params = dict(pm.local_parameters())
        dp = pm.comms["dp"]
        self.dp = dp

        def nbytes(n, p):  # the same on every tp rank (padded local shape), so all agree on the owners
            rec = pm.records.get(n)
            numel = math.prod(rec.local_shape) if rec is not None else _local(p).numel()
            return numel * _local(p).element_size()
        self.owner = partition({n: nbytes(n, p) for n, p in self.params.items()}, dp.size)
        groups = group_names(params, self.params, pm.model_parameter_names()) if params is not None else \
            [(list(self.params), {})]
        inner_groups, self.owns_nothing = [], True
        for names, options in groups:
            mine = [self.params[n] for n in names if self.owner[n] == dp.rank]
            self.owns_nothing &= not mine
            # a rank that owns nothing of a group still keeps it (a zero-size placeholder), so that
            # hyper-parameter changes through param_groups behave the same on every rank
            inner_groups.append({"params": mine or [torch.zeros(0, requires_grad=True)], **options})
        self.inner = optimizer_class(inner_groups, **defaults)
        self.defaults = self.inner.defaults
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                      "load_state_dict_post"):
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())
        ranks = pm.program.mesh.group_ranks(pm.program.rank, "dp")
        self.src = [ranks[r] for r in range(dp.size)]

    def add_param_group(self, param_group):
        raise NotImplementedError("a ZeRO-1 optimizer's groups are fixed when it is made: pass them all as "
                                  "pm.optimizer(cls, zero=1, params=[{...}, ...])")

    def __repr__(self):
        return f"ZeroOptimizer({self.inner!r}, dp={self.dp.size}, owns {sum(o == self.dp.rank for o in self.owner.values())} tensors)"

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params.values():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:   # on every rank (it may run pm.step, whose collectives span dp)
            with torch.enable_grad():
                loss = closure()
        else:
            loss = None
        if not self.owns_nothing:
            self.inner.step()
        if self.dp.size > 1:
            for r in range(self.dp.size):
                mine = [_local(p) for n, p in self.params.items() if self.owner[n] == r]
                if not mine:
                    continue
                flat = _flatten_dense_tensors(mine)
                dist.broadcast(flat, src=self.src[r], group=self.dp.group)
                if r != self.dp.rank:
                    for t, new in zip(mine, _unflatten_dense_tensors(flat, mine)):
                        t.copy_(new)
        return loss

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (what ZeRO-1 divides by dp)."""
        return sum(_local(v).numel() * _local(v).element_size() for s in self.inner.state.values()
                   for v in s.values() if torch.is_tensor(v) and v.dim() > 0)

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "owner": dict(self.owner)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("owner") != self.owner:
            raise ValueError("this ZeRO-1 optimizer state was saved with another partition of the parameters "
                             "(another dp size or model): load it on the same mesh")
        self.inner.load_state_dict(state["inner"])
