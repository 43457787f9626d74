"""Activation recompute: each transformer layer keeps only its input for backward, and runs again then.

Activations, not weights, fill a GPU when training a long sequence: each layer keeps its attention and
MLP intermediates until backward. Megatron's full recompute (and HF's ``gradient_checkpointing_enable``)
keeps a layer's input instead and recomputes the layer's forward inside backward: about a third more
compute for a fraction of the activation memory.

HF models check their flag in Python, and export traces straight through ``torch.utils.checkpoint``, so
the flag does not survive capture. This pass puts it back: ``parallelize(recompute=True)``, or
``"auto"`` (the default) when the model says ``is_gradient_checkpointing``.

The regions come from the graph, with the same analysis as pipeline stage cuts
(``pipeline_split.candidates``): a stretch of the rank's graph between two points where only the
residual stream is live. Consecutive stretches of one layer (an attention and its MLP) form one region;
the embedding, the final norm and the LM head with its loss are never recomputed (the chunked loss
already computes its gradient in forward). Each node of a region is tagged with ``RECOMPUTE``; the
runtime (``runtime/recompute.py``) runs each region under ``torch.utils.checkpoint`` (non-reentrant,
the RNG state restored, so dropout draws the same mask again). A region's collectives run again in its
recompute, in the same order on every rank of their group, as in Megatron.
"""
from __future__ import annotations


import torch.fx as fx

from autoshard.ir.meta import RECOMPUTE, RECOMPUTE_PLAN
from autoshard.ir.pipeline import STAGE_PLAN
from autoshard.ir.recompute import RecomputePlan, RecomputeRegion
from autoshard.passes.pipeline_split import activations, candidates
from autoshard.passes.stage_prices import layer_of, layer_prefix
from autoshard.passes.shapes import module_path, writes_in_place
from autoshard.ir.errors import warn_user


def _stretches(gm: fx.GraphModule) -> list[tuple[int, int, set]]:
    """``(first, last, layers)`` per stretch between consecutive residual-only cut points."""
    nodes = list(gm.graph.nodes)
    cuts = candidates(gm, activations(gm))
    prefix = layer_prefix(gm)
    out, start = [], 0
    for end in [c.position for c in cuts] + [len(nodes) - 1]:
        layers = {layer_of(n, prefix) for n in nodes[start:end + 1]} - {None}
        out.append((start, end, layers))
        start = end + 1
    return out


def plan_regions(gm: fx.GraphModule) -> list[RecomputeRegion]:
    """One region per layer: the longest run of consecutive stretches that all belong to that layer alone."""
    nodes = list(gm.graph.nodes)
    regions: list[RecomputeRegion] = []
    for first, last, layers in _stretches(gm):
        if len(layers) != 1:
            continue            # the embedding, the head, or a stretch across two layers: not recomputed
        (layer,) = layers
        if regions and regions[-1].layer == layer and regions[-1].last_index + 1 == first:
            prev = regions[-1]
            regions[-1] = RecomputeRegion(layer, prev.first, nodes[last].name, prev.first_index, last)
        else:
            regions.append(RecomputeRegion(layer, nodes[first].name, nodes[last].name, first, last))
    return regions


def stage_of_positions(gm: fx.GraphModule) -> list:
    """The pipeline stage (chunk) of each node position: the stages' cuts (``STAGE_PLAN``) split the graph
    in order. One stage when the program has no cuts."""
    stages = gm.meta.get(STAGE_PLAN)
    nodes = list(gm.graph.nodes)
    sent = set(stages.boundaries) if stages is not None else set()
    out, k = [], 0
    for n in nodes:
        out.append(k)          # a boundary belongs to the stage that sends it
        if n.name in sent:
            k += 1
    return out


def in_recompute_stages(gm: fx.GraphModule, regions: list, stages: tuple | None) -> list:
    """The regions on the pipeline ranks ``stages`` (``CompileOptions.recompute_stages``; None: all): the
    memory limit may ask only the ranks that hold the most microbatches to recompute. A region's chunk
    comes from the cuts, its rank from the schedule (an interleaved rank holds several chunks)."""
    if stages is None:
        return list(regions)
    plan = gm.meta.get(STAGE_PLAN)
    schedule = getattr(plan, "schedule", None)
    ranks = schedule.pp if schedule is not None else (plan.num_stages if plan is not None else 1)
    if any(k >= ranks for k in stages):
        raise ValueError(f"recompute_stages={stages}: this program has {ranks} pipeline rank(s), numbered from 0 "
                         f"to {ranks - 1}")
    rank_of = schedule.rank_of if schedule is not None else (lambda chunk: chunk)
    of = stage_of_positions(gm)
    return [r for r in regions if rank_of(of[r.first_index]) in stages]


def _writer(nodes: list, region: RecomputeRegion) -> fx.Node | None:
    """A node of the region that writes in place (a buffer's running statistic, a counter): running the
    region again would write twice, and checkpoint refuses an input changed under it."""
    return next((n for n in nodes[region.first_index:region.last_index + 1] if writes_in_place(n)), None)


def recompute_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if ctx.options.recompute is not True:      # False, or "auto" that no model resolved (run_passes alone)
        return gm
    nodes = list(gm.graph.nodes)
    regions, skipped = [], []
    for region in in_recompute_stages(gm, plan_regions(gm), ctx.options.recompute_stages):
        writer = _writer(nodes, region)
        if writer is None:
            regions.append(region)
        else:
            skipped.append(f"layer {region.layer} is not recomputed: '{module_path(writer)}' writes in place "
                           f"({writer.target}), which a second run would repeat")
    for index, region in enumerate(regions):
        for n in nodes[region.first_index:region.last_index + 1]:
            if n.op not in ("placeholder", "output"):
                RECOMPUTE.set(n, index)
    reason = "" if regions else ("no layer was found between two points where only the residual stream "
                                 "(and small values beside it) is live" if not skipped else "every layer writes in place") + ": nothing is recomputed"
    plan = gm.meta[RECOMPUTE_PLAN] = RecomputePlan(tuple(regions), reason, tuple(skipped))
    if not regions or skipped:   # asked for, and (partly) not done: say so where the user looks, not only in plan.md
        warn_user(f"autoshard: recompute was asked for, but {plan.reason or '; '.join(skipped)}")
    return gm
