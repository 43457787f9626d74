"""Cut one rank's final local graph into its pipeline stages (chunks), at the planned boundaries.

The whole model is planned and rewritten for tensor parallelism first, as one graph, so a boundary
value has one placement that both stages agree on by construction, and a tied weight has one
placement on every stage that uses it. Then each chunk k is the part of the graph its output needs:
walking back from its output (the boundary value ``boundaries[k]``, or the loss for the last chunk), a
walk stops at the previous boundary (which becomes the chunk's first input) and at placeholders
(parameters, buffers and user inputs the chunk reads). Input-only and parameter-only values met on the
way are recomputed in the chunk; an activation of an earlier chunk met on the way would be a second
value crossing the cut, and is an error (the split pass only proposes cuts where one crosses).
"""
from __future__ import annotations

import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir.pipeline import Chunk, ChunkInput, StagePlan
from autoshard.passes.lower import param_records
from autoshard.passes.pipeline_split import PipelineSplitError, activations


def _output_value(gm: fx.GraphModule) -> fx.Node:
    """The loss the last stage returns (``microbatch_loss.loss_node``: other scalar outputs feed it)."""
    from autoshard.passes.microbatch_loss import LossError, loss_node
    try:
        return loss_node(gm)
    except LossError as e:
        raise PipelineSplitError(f"the last stage must return one loss: {e}") from None


def _members(end: fx.Node, start: fx.Node | None, pos: dict, act: set, earliest: int) -> tuple:
    """The nodes chunk ``(start, end]`` computes and the placeholders it reads."""
    members, reads, stack, seen = set(), set(), [end], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n is start:
            continue
        if n.op == "placeholder":
            reads.add(n)
            continue
        if n in act and pos[n] <= earliest:
            raise PipelineSplitError(f"'{n.name}' of an earlier stage is read after the cut at "
                                     f"'{start.name if start is not None else '(start)'}': more than the residual "
                                     "stream crosses there")
        members.add(n)
        stack.extend(n.all_input_nodes)
    return members, reads


def split_chunks(gm: fx.GraphModule, plan: StagePlan) -> tuple:
    """``([Chunk], {chunk: [recomputed input-only node names]})`` for every stage, from the final local graph."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    missing = [b for b in plan.boundaries if b not in by_name]
    if missing:
        raise PipelineSplitError(f"internal: the boundary values {missing} did not survive the rewrite passes")
    bounds = [by_name[b] for b in plan.boundaries]
    act = activations(gm)
    from_data = set()    # computed from a user input or a buffer: recomputing these is worth listing
    for n in nodes:
        if (n.op == "placeholder" and M.KIND.get(n, None) in ("input", "buffer")) or \
                any(i in from_data for i in n.all_input_nodes):
            from_data.add(n)
    chunks, recomputed = [], {}
    order = {"boundary": 0, "parameter": 1, "buffer": 2, "input": 3}
    for k in range(plan.num_stages):
        last = k == plan.num_stages - 1
        end = _output_value(gm) if last else bounds[k]
        start = bounds[k - 1] if k else None
        members, reads = _members(end, start, pos, act, pos[start] if start is not None else -1)
        g, env, inputs = fx.Graph(), {}, []
        if start is not None:
            ph = g.placeholder("boundary")
            ph.meta.update(start.meta)
            M.KIND.set(ph, "boundary")
            M.NAME.set(ph, start.name)
            env[start] = ph
            inputs.append(ChunkInput("boundary", start.name))
        for p in sorted(reads, key=lambda p: (order.get(M.KIND.get(p), 9), pos[p])):
            env[p] = g.node_copy(p)
            inputs.append(ChunkInput(M.KIND.get(p), M.NAME.get(p)))
        for n in sorted(members, key=pos.__getitem__):
            env[n] = g.node_copy(n, lambda u: env[u])
        g.output(env[end])
        chunk_gm = fx.GraphModule(gm, g)
        recomputed[k] = [n.name for n in sorted(members, key=pos.__getitem__)
                         if n not in act and n.op == "call_function"
                         and n in from_data]
        in_val = start.meta.get("val") if start is not None else None
        out_val = end.meta["val"]
        chunks.append(Chunk(k, chunk_gm, inputs, param_records(chunk_gm),
                            tuple(M.LOCAL_SHAPE.get(start)) if start is not None else None,
                            in_val.dtype if in_val is not None else None,
                            tuple(M.LOCAL_SHAPE.get(end, None) or out_val.shape), out_val.dtype, last))
    return chunks, recomputed

