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


class ZeroOptimizer:
    """``pm.optimizer(torch.optim.AdamW, zero=1, lr=...)``: looks like a torch optimizer (``step``,
    ``zero_grad``, ``param_groups``, ``state_dict``), holds state for this rank's share only."""

    def __init__(self, pm, optimizer_class, **defaults):
        self.pm = pm
        self.params = dict(pm.local_parameters())
        dp = pm.comms["dp"]
        self.dp = dp
        self.owner = partition({n: _local(p).numel() * _local(p).element_size() for n, p in self.params.items()},
                               dp.size)
        mine = [p for n, p in self.params.items() if self.owner[n] == dp.rank]
        # a rank that owns nothing still builds its optimizer (on no parameters, with a dummy group) so
        # that hyper-parameter changes through param_groups behave the same on every rank
        self.inner = optimizer_class(mine or [torch.zeros(0, requires_grad=True)], **defaults)
        self.owns_nothing = not mine
        ranks = pm.program.mesh.group_ranks(pm.program.rank, "dp")
        self.src = [ranks[r] for r in range(dp.size)]

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
        loss = None if self.owns_nothing else self.inner.step(closure)
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
