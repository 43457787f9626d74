"""Run the recompute plan: each tagged region of a bound graph as one ``torch.utils.checkpoint`` call.

``passes/recompute.py`` tags the nodes of each layer with ``RECOMPUTE``. ``checkpoint_regions`` cuts the
bound graph into submodules with torch's ``split_module``, one per tagged region and one per stretch
between them (contiguous in graph order, so the submodules form a chain without cycles), and wraps each
tagged one in ``Recompute``. Under ``no_grad`` (evaluation) a region simply runs.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from autoshard.ir.meta import RECOMPUTE


class Recompute(nn.Module):
    """A region whose forward keeps only its inputs; backward runs it again (non-reentrant checkpoint,
    with the RNG state restored so that dropout draws the same masks)."""

    def __init__(self, region: fx.GraphModule, index: int):
        super().__init__()
        self.region, self.index = region, index

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.region(*args)
        # the generated ``forward`` itself, not the module's call: non-reentrant checkpoint stops the
        # recompute early by raising, and a GraphModule's call turns every exception that passes through
        # it into a stack summary first (file reads included), once per region and step
        return checkpoint(self.region.forward, *args, use_reentrant=False, preserve_rng_state=True)

    def extra_repr(self):
        return f"region {self.index}"


def checkpoint_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its tagged regions run under checkpoint (``gm`` itself when none is tagged)."""
    tagged = [n for n in gm.graph.nodes if RECOMPUTE.has(n) and n.op not in ("placeholder", "output")]
    if not tagged:
        return gm
    part, previous, current = {}, object(), -1
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        key = RECOMPUTE.get(n, None)     # (a pipeline stage's received boundary is a placeholder here)
        if key != previous:
            current += 1
            previous = key
        part[n] = current
    region_of = {part[n]: RECOMPUTE.get(n) for n in tagged}
    split = split_module(gm, gm, lambda n: part[n], keep_original_order=True)
    for name, sub in list(split.named_children()):
        k = int(name.removeprefix("submod_")) if name.startswith("submod_") else None
        if k in region_of:
            setattr(split, name, Recompute(sub, region_of[k]))
    return split
