"""Parameters whose gradient each tp rank holds only its share of: summed over tp once, after backward.

Under sequence parallelism a LayerNorm's (or RMSNorm's) weight and bias meet a sequence shard, so each tp
rank's gradient is the sum over its own tokens only. Megatron's f on the parameter (identity forward,
all-reduce backward) makes it whole, but one small all-reduce per parameter inside backward costs its
fixed latency every time: 14 a step for a 2-layer GPT, about 0.9 ms each on gloo. Megatron-LM instead
all-reduces such gradients after the backward, flattened into one call (its ``finalize_model_grads``).

``tp_rewrite`` leaves the f out for a parameter *every* use of which makes its gradient partial (a
parameter read whole anywhere would be counted t times) and lists it here, as graph data
(``gm.meta[TP_PARTIAL_GRADS]``). The runtime sums the listed gradients in one all-reduce:
``pm.step`` once per step, after the dp reduction (sums over dp and tp commute) and before the
gradients reach ``.grad``; ``pm(...)`` + ``backward()`` once per backward, at its end.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.ir.program import CollectiveRecord

TP_PARTIAL_GRADS = "autoshard_tp_partial_grads"   # GraphModule.meta key: PartialGrads (tp_rewrite)


@dataclass(frozen=True)
class PartialGrads:
    """The parameters (by name) whose local gradient is a tp rank's share, and their local sizes."""
    names: tuple
    numel: int             # elements of all of them together: what the one all-reduce sends
    itemsize: int

    def record(self) -> CollectiveRecord:
        """The one all-reduce, for the plan's collective list (dumps and the communication price)."""
        return CollectiveRecord("after backward", None, "tp", "bwd", "all_reduce", (self.numel,), self.itemsize,
                                f"sum the tp shares of {len(self.names)} parameters' gradients (sequence-"
                                "sharded uses), one call for all")


def sum_over_tp(comm, grads: list) -> list:
    """``grads`` (the same list on every tp rank) summed over ``comm``, as new tensors in the same order:
    one all-reduce per dtype, of the gradients flattened together (an autograd gradient may be an
    expanded view, which no sum may be written back into)."""
    by_dtype, out = {}, [None] * len(grads)
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    for same in by_dtype.values():
        flat = comm.all_reduce(torch.cat([grads[i].reshape(-1) for i in same]), "bwd")
        for i, part in zip(same, flat.split([grads[i].numel() for i in same])):
            out[i] = part.view(grads[i].shape)
    return out
