"""Selective recompute: keep the matmul outputs, recompute each attention's core in backward.

Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", 2022) measure that
the attention core (the scores QK^T, their scaling and mask, the softmax, its dropout and the product
with V) holds ``5 a s / (h t)`` of a layer's ``10 + 24/t + 5 a s / (h t)`` bytes per token while costing
a few percent of its flops: recomputing only it removes the term that grows with the sequence, for a
fraction of full recompute's extra time.

``parallelize(recompute="selective")`` runs this pass instead of ``recompute``'s whole layers. Each
attention of the graph (``attention.attentions``: an SDPA call, or a ``q @ k^T`` whose softmax feeds a
product with ``v``) becomes one region, from its first node to its output in graph order, tagged with
``RECOMPUTE`` like a whole layer: the runtime (``runtime/recompute.py``) runs it under non-reentrant
checkpoint with the RNG state restored, so dropout draws the same mask again in backward. A region
holding a forward collective or an in-place write is left out, and ``plan.md`` says so (a slice onto
this rank's kv heads, whose only collective is its gradient's gather, is not a forward collective).
"""
from __future__ import annotations


import torch.fx as fx

from autoshard.ir.meta import RECOMPUTE, RECOMPUTE_PLAN
from autoshard.ir.recompute import RecomputePlan, RecomputeRegion
from autoshard.passes.attention import attentions
from autoshard.passes.stage_prices import layer_of, layer_prefix
from autoshard.passes.recompute import in_recompute_stages
from autoshard.passes.shapes import module_path, writes_in_place
from autoshard.ir.errors import warn_user


def _communicates_forward(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether the module ``node`` calls would communicate when its forward runs again: any but a
    parallel op whose collectives are all in backward (a slice of a replicated k or v onto this rank's
    heads, whose gradient is gathered once, in the one backward a recompute still runs)."""
    steps = getattr(gm.get_submodule(node.target), "steps", None)
    return steps is None or any(step.phase != "bwd" for step in steps())


def attention_core_regions(gm: fx.GraphModule) -> tuple[list, list]:
    """``([RecomputeRegion], [why an attention is not recomputed])``: one region per attention core."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    prefix = layer_prefix(gm)
    regions, skipped = [], []
    for first, out in attentions(gm):
        lo, hi = index[first], index[out]
        inside = nodes[lo:hi + 1]
        where = module_path(first)
        blocker = next((n for n in inside if n.op == "call_module" and _communicates_forward(gm, n)), None)
        if blocker is not None:
            skipped.append(f"`{where}`: its attention core holds `{blocker.name}`, a collective, which a recompute "
                           "would run again on this rank alone")
            continue
        writer = next((n for n in inside if writes_in_place(n)), None)
        if writer is not None:
            skipped.append(f"`{where}`: its attention core writes in place ({writer.target}), which a second run "
                           "would repeat")
            continue
        if regions and regions[-1].last_index >= lo:
            continue            # nested in the previous attention's region (a graph the walk saw twice)
        layer = layer_of(first, prefix)
        regions.append(RecomputeRegion(layer if layer is not None else len(regions), first.name, out.name, lo, hi))
    return regions, skipped


def selective_recompute_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if ctx.options.recompute != "selective":
        return gm
    regions, skipped = attention_core_regions(gm)
    regions = in_recompute_stages(gm, regions, ctx.options.recompute_stages)
    nodes = list(gm.graph.nodes)
    for k, region in enumerate(regions):
        for n in nodes[region.first_index:region.last_index + 1]:
            if n.op not in ("placeholder", "output"):
                RECOMPUTE.set(n, k)
    reason = "" if regions or skipped else ("no attention (an SDPA call, or q @ k^T into a softmax into a "
                                            "product with v) was found")
    plan = gm.meta[RECOMPUTE_PLAN] = RecomputePlan(tuple(regions), reason, tuple(skipped), kind="selective")
    if not regions:
        warn_user(f"autoshard: recompute='selective' was asked for, but {plan.reason or '; '.join(skipped)}: "
                  "nothing is recomputed")
    return gm
