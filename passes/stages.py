"""Cut one rank's final local graph into its pipeline stages (chunks), at the planned boundaries.

The whole model is planned and rewritten for tensor parallelism first, as one graph, so a boundary
value has one placement that both stages agree on by construction, and a tied weight has one
placement on every stage that uses it. Then each chunk k is the part of the graph its output needs:
walking back from its outputs (the residual stream ``boundaries[k]`` and the values carried beside it,
or the loss for the last chunk), a walk stops at the previous boundary's values (which become the
chunk's first input) and at placeholders (parameters, buffers and user inputs the chunk reads).
Input-only and parameter-only values met on the way are recomputed in the chunk; any other activation of
an earlier chunk met on the way would cross the cut unsent, and is an error (the split pass proposes
only cuts where everything live is sent).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir import ops
from autoshard.ir.pipeline import Chunk, ChunkInput, StagePlan
from autoshard.ir.placement import DistSpec, Replicate
from autoshard.passes.lower import param_records
from autoshard.passes.pipeline_split import PipelineSplitError, activations
from autoshard.passes.shapes import module_path, writes_in_place
from autoshard.passes.walk import upstream

aten = torch.ops.aten


def _output_value(gm: fx.GraphModule) -> fx.Node:
    """The loss the last stage returns (``microbatch_loss.loss_node``: other scalar outputs feed it)."""
    from autoshard.passes.microbatch_loss import LossError, loss_node
    try:
        return loss_node(gm)
    except LossError as e:
        raise PipelineSplitError(f"the last stage must return one loss: {e}") from None


def _members(ends: tuple, starts: tuple, pos: dict, act: set, earliest: int) -> tuple:
    """The nodes chunk ``(starts, ends]`` computes and the placeholders it reads."""
    members, reads = set(), set()
    for n in upstream(ends, stop=starts):
        if n.op == "placeholder":
            reads.add(n)
            continue
        if n in act and pos[n] <= earliest:
            raise PipelineSplitError(f"'{n.name}' of an earlier stage is read after the cut at "
                                     f"'{starts[0].name if starts else '(start)'}': more than the residual "
                                     "stream and the values carried beside it cross there")
        members.add(n)
    return members, reads


def _local_shape(n: fx.Node) -> tuple:
    return tuple(M.LOCAL_SHAPE.get(n, None) or n.meta["val"].shape)


def _transfer(values: tuple) -> tuple:
    """``(local shape, dtype)`` of what a cut sends: the value itself, or several packed into one 1-D
    tensor of the widest of their dtypes (each converts to it and back exactly)."""
    if len(values) == 1:
        return _local_shape(values[0]), values[0].meta["val"].dtype
    dtype = values[0].meta["val"].dtype
    for v in values[1:]:
        dtype = torch.promote_types(dtype, v.meta["val"].dtype)
    return (sum(math.prod(_local_shape(v)) for v in values),), dtype


def _replicated(values: tuple) -> bool:
    """Whether every value a cut sends is whole and the same on each tp rank (placed Replicate on tp, not
    a sequence shard): what the runtime's scatter/gather may send as t slices and gather again."""
    return all(isinstance(M.SPEC.get(v, None), DistSpec) and isinstance(M.SPEC.get(v).on("tp"), Replicate)
               for v in values)     # a value without a placement is never sliced


def _unpack(g: fx.Graph, ph: fx.Node, values: tuple, dtype: torch.dtype, env: dict) -> None:
    """Split the received 1-D tensor back into the values sent, in their local shapes and dtypes."""
    sizes = [math.prod(_local_shape(v)) for v in values]
    parts = g.call_function(aten.split_with_sizes.default, (ph, sizes))
    for i, v in enumerate(values):
        x = g.call_function(aten.view.default, (g.call_function(operator.getitem, (parts, i)), list(_local_shape(v))))
        if v.meta["val"].dtype != dtype:
            x = g.call_function(aten._to_copy.default, (x,), {"dtype": v.meta["val"].dtype})
        env[v] = x


def _pack(g: fx.Graph, values: tuple, env: dict, dtype: torch.dtype) -> fx.Node:
    """One 1-D tensor of everything a stage sends, so a boundary stays one transfer of known shape."""
    flat = []
    for v in values:
        x = g.call_function(aten.reshape.default, (env[v], [-1]))
        flat.append(x if v.meta["val"].dtype == dtype else g.call_function(aten._to_copy.default, (x,), {"dtype": dtype}))
    return g.call_function(aten.cat.default, (flat,))


def _sent_value(gm: fx.GraphModule, n: fx.Node) -> fx.Node:
    """What a cut sends for the carried value ``n``: ``n``, or the placement change the tp rewrite put
    after it when that is all that reads it (an MoE gate planned row-parallel: its partial logits are
    all-reduced once, then both stages read the sum). Sending the result keeps the collective on one stage."""
    while len(n.users) == 1:
        (u,) = n.users
        if u.op != "call_module" or not isinstance(gm.get_submodule(u.target), ops.Redistribute):
            break
        n = u
    return n


def split_chunks(gm: fx.GraphModule, plan: StagePlan) -> tuple:
    """``([Chunk], {chunk: [recomputed input-only node names]})`` for every stage, from the final local graph.

    A boundary of one value (the residual stream) is sent as it is. With values carried beside it, the
    sender packs them into one 1-D tensor (``reshape``, ``cat``) and the receiver splits it back into views,
    so the executor still sends one tensor of a shape known at compile time, and autograd routes each
    part's gradient back."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    tagged = {}
    for n in nodes:   # a cut value's tag's last holder (the bias add after its matmul, both copied the meta)
        if M.CUT.has(n):
            tagged[M.CUT.get(n)] = n
    for name, n in tagged.items():
        named = by_name.get(name)
        if named is None or M.CUT.get(named, None) != name:   # renamed, or its name given to a helper
            by_name[name] = n
    sent = [plan.sent(k) for k in range(len(plan.boundaries))]
    missing = [b for names in sent for b in names if b not in by_name]
    if missing:
        raise PipelineSplitError(f"internal: the boundary values {missing} did not survive the rewrite passes")
    bounds = [(by_name[names[0]],) + tuple(_sent_value(gm, by_name[b]) for b in names[1:]) for names in sent]
    act = activations(gm)
    from_data = set()    # computed from a user input or a buffer: recomputing these is worth listing
    for n in nodes:
        if (n.op == "placeholder" and M.KIND.get(n, None) in ("input", "buffer")) or \
                any(i in from_data for i in n.all_input_nodes):
            from_data.add(n)
    chunks, recomputed, placed = [], {}, set()
    order = {"boundary": 0, "parameter": 1, "buffer": 2, "input": 3}
    for k in range(plan.num_stages):
        last = k == plan.num_stages - 1
        ends = (_output_value(gm),) if last else bounds[k]
        starts = bounds[k - 1] if k else ()
        members, reads = _members(ends, starts, pos, act, pos[starts[0]] if starts else -1)
        placed |= members
        g, env, inputs = fx.Graph(), {}, []
        in_shape = in_dtype = None
        if starts:
            ph = g.placeholder("boundary")
            M.KIND.set(ph, "boundary")
            M.NAME.set(ph, starts[0].name)
            inputs.append(ChunkInput("boundary", starts[0].name))
            in_shape, in_dtype = _transfer(starts)
            if len(starts) == 1:
                ph.meta.update(starts[0].meta)
                env[starts[0]] = ph
            else:
                _unpack(g, ph, starts, in_dtype, env)
        for p in sorted(reads, key=lambda p: (order.get(M.KIND.get(p), 9), pos[p])):
            env[p] = g.node_copy(p)
            inputs.append(ChunkInput(M.KIND.get(p), M.NAME.get(p)))
        for n in sorted(members, key=pos.__getitem__):
            env[n] = g.node_copy(n, lambda u: env[u])
        out_shape, out_dtype = _transfer(ends)
        g.output(env[ends[0]] if len(ends) == 1 else _pack(g, ends, env, out_dtype))
        chunk_gm = fx.GraphModule(gm, g)
        recomputed[k] = [n.name for n in sorted(members, key=pos.__getitem__)
                         if n not in act and n.op == "call_function"
                         and n in from_data]
        chunks.append(Chunk(k, chunk_gm, inputs, param_records(chunk_gm), in_shape, in_dtype, out_shape, out_dtype,
                            last, bool(starts) and _replicated(starts), not last and _replicated(ends)))
    _check_writes_kept(nodes, placed)
    return chunks, recomputed


def _check_writes_kept(nodes: list, placed: set) -> None:
    """A write into a view (``x[:, t] = ...``, a linear-attention or RG-LRU scan) has no users, so the walk
    back from a stage's outputs never reaches it, and the stage would read the buffer unwritten: a wrong
    loss with no error. Refuse it, naming the module, until stages keep such writes."""
    dropped = [n for n in nodes if writes_in_place(n) and n not in placed and isinstance(n.args[0], fx.Node)
               and n.args[0].op != "placeholder"]
    if dropped:
        n = dropped[0]
        raise PipelineSplitError(f"'{module_path(n)}' writes in place into a view ({n.target}, {len(dropped)} such "
                                 "writes): pipeline stages are cut along data edges and cannot keep such a write yet. "
                                 "Use pp=1 for this model (tensor and data parallelism), or write the update out of "
                                 "place (torch.cat / torch.stack instead of slice assignment)")
