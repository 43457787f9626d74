"""Tensor-parallel rewrite: make the planned graph local to one rank.

Walks the planned graph once and builds a new one in which

- every value has its *local* shape (``meta.LOCAL_SHAPE``) and literal sizes say so
  (``view``/``reshape``/``expand`` sizes, ``split`` sizes of a blocked q|k|v shard);
- wherever a consumer needs another placement than its producer gives, an ``ir.ops.Redistribute``
  record names the axis and the planned steps (one per producer and target placement, shared by all
  consumers);
- a replicated value entering ops whose output is sharded goes through one ``CopyToParallel`` (Megatron's
  f), so its gradient is all-reduced once however many column-parallel consumers it has (q, k and v);
  under sequence parallelism one ``SequenceGather``, which the value's replicated readers share too
  (``GatheredReplica``: GQA's k and v where tp splits no kv head);
- the two vocab-parallel ops are lowered to their records.

The result is a per-rank program: rank-specific constants (vocab ranges) are baked in. Its parallel ops
are data; the runtime binds them to process groups (``autoshard.runtime.bind``).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir import ops
from autoshard.ir.partial_grads import TP_PARTIAL_GRADS, PartialGrads
from autoshard.ir.placement import Replicate, Shard, local_shape, shard_range
from autoshard.ir.redistribute import evenly_blocked
from autoshard.passes.plan import partial_grad_use
from autoshard.passes.rules import VIEW_OPS, split_sizes
from autoshard.passes.rules_vocab import cross_entropy_args, logsumexp_dims
from autoshard.passes.shapes import module_path, shape_of, squeezed_dims, val

aten = torch.ops.aten


def _meta(shape, like):
    return torch.empty(shape, dtype=like.dtype, device="meta")


def _local_val(node, placement, t):
    v = val(node)
    if isinstance(v, torch.Tensor):
        return _meta(local_shape(v.shape, placement, t), v)
    if isinstance(v, (list, tuple)):
        return [(_meta(local_shape(e.shape, placement, t), e) if isinstance(e, torch.Tensor) else e) for e in v]
    return v


def _vocab_range(n, t, rank):
    """The vocab rows ``[start, start + valid)`` this rank holds of a padded vocab-sharded dim."""
    (start, stop), = shard_range(n, t, rank)
    return start, stop - start


def _gathers_evenly(src, shape, t: int) -> bool:
    """A shard one all-gather makes whole: one dim of equal blocks (or none), no padding."""
    return isinstance(src, Shard) and evenly_blocked(src, shape, t)


def tp_rewrite_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """A new, local graph for this rank (``ctx.mesh`` and ``ctx.coords`` say which); ``gm`` is untouched."""
    t, rank = ctx.mesh.tp, ctx.coords["tp"]
    sequence_parallel = getattr(ctx.options, "sequence_parallel", False)
    root = torch.nn.Module()
    g = fx.Graph()
    env, cache, counter = {}, {}, {}

    def add_module(prefix, mod):
        i = counter.get(prefix, 0)
        counter[prefix] = i + 1
        name = f"{prefix}_{i}"
        root.add_module(name, mod)
        return name

    def in_placement(u, placement):
        """u's value in ``placement``, inserting (and caching) the collective that makes it."""
        if (u, placement) in cache:
            return cache[u, placement]
        src = M.SPEC.get(u).tp
        if src == placement:
            return env[u]
        if not isinstance(val(u), torch.Tensor):
            raise AssertionError(f"internal error: plan moves list-valued {u.name} from {src!r} to {placement!r}")
        grad = M.REQUIRES_GRAD.get(u, False)
        if (sequence_parallel and grad and isinstance(placement, Replicate) and _gathers_evenly(src, shape_of(u), t)
                and u not in reads and _partial_grad_reader(u)):
            # the sequence gather its column-parallel readers need serves the replicated ones too
            name = add_module("gathered_replica", ops.GatheredReplica("tp", t, shape_of(u)))
            node = g.call_module(name, (with_f(u),))
        else:
            name = add_module("redistribute", ops.Redistribute("tp", t, src, placement, shape_of(u), grad))
            node = g.call_module(name, (env[u],))
        node.meta["val"] = _local_val(u, placement, t)
        _annotate(node, M.SPEC.get(u).with_axis("tp", placement), shape_of(u), t, grad, source=u.name)
        cache[u, placement] = node
        return node

    def with_f(u):
        """u replicated for ops that make its gradient partial: f (all-reduce backward) on its replica, or,
        under sequence parallelism, one gather of its even shard whose backward reduce-scatters."""
        if (u, "f") not in cache:
            src = M.SPEC.get(u).tp
            if sequence_parallel and _gathers_evenly(src, shape_of(u), t):
                name = add_module("sequence_gather", ops.SequenceGather("tp", t, shape_of(u), src.dim, src.blocks))
                node = g.call_module(name, (env[u],))
            else:
                name = add_module("f", ops.CopyToParallel("tp", t, shape_of(u)))
                node = g.call_module(name, (in_placement(u, Replicate()),))
            node.meta["val"] = _local_val(u, Replicate(), t)
            _annotate(node, M.SPEC.get(u).with_axis("tp", Replicate()), shape_of(u), t, True, source=u.name)
            cache[u, "f"] = node
        return cache[u, "f"]

    deferred, reads = _partial_only_parameters(gm) if t > 1 else ({}, set())
    for n in gm.graph.nodes:
        s = M.STRATEGY.get(n)
        if n.op == "placeholder":
            new = g.placeholder(n.name)
        elif n.op == "output":
            new = g.output(fx.node.map_arg(n.args[0], lambda u: in_placement(u, Replicate())))
            continue
        else:
            mapping = {}
            for pos, u in enumerate(n.all_input_nodes):
                if u in reads:        # its gradient's tp shares are summed after backward (ir/partial_grads)
                    mapping[u] = env[u]
                elif M.REQUIRES_GRAD.get(u, False) and partial_grad_use(s, pos):
                    mapping[u] = with_f(u)
                else:
                    mapping[u] = in_placement(u, s.ins[pos])
            args = fx.node.map_arg(n.args, lambda u: mapping[u])
            kwargs = fx.node.map_arg(n.kwargs, lambda u: mapping[u])
            new = _lower(g, n, s, args, kwargs, t, rank, add_module)
        if new.name != n.name:
            new._rename(n.name)
        if new.name != n.name:   # a helper made first took the name: the value keeps it (stage cuts name it)
            holder = next((x for x in g.nodes if x.name == n.name and x is not new), None)
            if holder is not None:
                holder._rename(f"{n.name}_{holder.op}")
            new.name = n.name
        new.meta.update({k: v for k, v in n.meta.items() if k != "val"})
        new.meta["val"] = _local_val(n, s.out, t)
        M.GLOBAL_SHAPE.set(new, shape_of(n))
        M.LOCAL_SHAPE.set(new, local_shape(shape_of(n), s.out, t) if shape_of(n) is not None else None)
        env[n] = new
    g.lint()
    out = fx.GraphModule(root, g)
    if deferred:
        numel = sum(math.prod(local_shape(shape_of(u), Replicate(), t)) for u in deferred)
        # the sum runs on the parameters' gradients: fp32 under mixed precision, whatever the compute dtype
        itemsize = 4 if ctx.options.mixed_precision else val(next(iter(deferred))).element_size()
        out.meta[TP_PARTIAL_GRADS] = PartialGrads(tuple(deferred.values()), numel, itemsize)
    return out


def _partial_grad_reader(u) -> bool:
    """Whether some op reads ``u`` replicated with a partial gradient (a column-parallel matmul)."""
    for n in u.users:
        strategy = M.STRATEGY.get(n, None)
        if strategy is not None and any(partial_grad_use(strategy, pos) for pos, x in enumerate(n.all_input_nodes)
                                        if x is u):
            return True
    return False


# ops a parameter may be read through that change only its dtype or its view: its gradient flows back
# through them linearly, so the sum of the tp shares after backward is the sum of what each rank passed back
_READS_THROUGH = {aten._to_copy, aten.to, aten.alias, aten.view, aten.reshape, aten._unsafe_view}


def _partial_only_parameters(gm) -> tuple:
    """``({placeholder: name}, reads)``: the replicated parameters that need grad and every use of which
    leaves their gradient partial over tp (a sequence-sharded norm's weight and bias), and ``reads``, those
    parameters with the nodes that read them through dtype and view changes only (Cohere's norm multiplies
    by ``weight.to(float32)``). Their f is left out and the gradients are summed after backward,
    in one call. A parameter also read where its gradient is whole keeps its f: summing after backward
    would count that part t times."""
    params, reads = {}, set()
    for u in gm.graph.nodes:
        if u.op != "placeholder" or M.KIND.get(u, None) != "parameter" or not M.REQUIRES_GRAD.get(u, False):
            continue
        if not isinstance(M.SPEC.get(u).tp, Replicate) or not u.users:
            continue
        chain = _partial_reads(u)
        if chain is not None:
            params[u] = M.NAME.get(u)
            reads |= chain
    return params, reads


def _partial_reads(u) -> set | None:
    """``u`` and the nodes reading it through ``_READS_THROUGH`` (replicated), if every other use of them
    leaves the gradient partial; else None."""
    seen, todo = {u}, [u]
    while todo:
        v = todo.pop()
        for n in v.users:
            packet = getattr(n.target, "overloadpacket", None) if n.op == "call_function" else None
            if (packet in _READS_THROUGH and n.args[0] is v and len(n.all_input_nodes) == 1
                    and M.SPEC.has(n) and isinstance(M.SPEC.get(n).tp, Replicate)):
                seen.add(n)
                todo.append(n)
                continue
            strategy = M.STRATEGY.get(n, None)
            if strategy is None or not all(partial_grad_use(strategy, pos)
                                           for pos, x in enumerate(n.all_input_nodes) if x is v):
                return None
    return seen


def _annotate(node, spec, shape, t, grad, source):
    M.SPEC.set(node, spec)
    M.REQUIRES_GRAD.set(node, grad)
    M.GLOBAL_SHAPE.set(node, tuple(shape))
    M.LOCAL_SHAPE.set(node, local_shape(shape, spec.tp, t))
    M.SOURCE.set(node, source)


def _sole_reader(u):
    """Whether the loss may overwrite its logits: they come from a fresh op result through views that
    nothing else reads (not a graph input, not returned, not saved by a view's other users)."""
    while True:
        if len(u.users) != 1 or u.op != "call_function":
            return False
        if getattr(u.target, "overloadpacket", None) not in VIEW_OPS | {aten.alias}:
            return getattr(u.target, "overloadpacket", None) in (aten.linear, aten.mm, aten.matmul, aten.addmm,
                                                                 aten._to_copy)  # a fresh tensor either way
        u = u.args[0]


def _lower(g, n, s, args, kwargs, t, rank, add_module):
    packet = getattr(n.target, "overloadpacket", None)
    if s.lowering == "vocab_parallel_embedding":
        rows = shape_of(n.args[0])[0]
        start, valid = _vocab_range(rows, t, rank)
        pad = args[2] if len(args) > 2 else -1
        local_pad = pad - start if pad is not None and pad >= 0 and start <= pad < start + valid else None
        name = add_module("vocab_embedding", ops.VocabParallelEmbedding("tp", t, start, valid, local_pad, rows,
                                                                            module_path(n)))
        return g.call_module(name, args[:2])
    if s.lowering == "vocab_parallel_cross_entropy":
        rows, vocab = shape_of(n.args[0])
        start, valid = _vocab_range(vocab, t, rank)
        a = cross_entropy_args(n)
        mod = ops.VocabParallelCrossEntropy("tp", t, rows, start, valid, a["ignore_index"], a["reduction"],
                                            inplace=_sole_reader(n.args[0]),
                                            label_smoothing=a["label_smoothing"], vocab=vocab)
        name = add_module("vocab_cross_entropy", mod)
        return g.call_module(name, args[:2])
    if s.lowering == "vocab_parallel_logsumexp":
        dims, keepdim = logsumexp_dims(n)
        dim = s.ins[0].dim
        _, valid = _vocab_range(shape_of(n.args[0])[dim], t, rank)
        mod = ops.VocabParallelLogsumexp("tp", t, shape_of(n), dims, keepdim, dim, valid)
        return g.call_module(add_module("vocab_logsumexp", mod), (args[0],))
    if s.lowering == "depthwise_channels":   # one filter per channel: as many groups as local channels
        return g.call_function(n.target, tuple(args[:6]), dict(kwargs, groups=shape_of(n.args[0])[1] // t))
    if packet is aten.squeeze:   # only the dims of size 1 in the whole tensor: a shard may be 1 locally
        return g.call_function(aten.squeeze.dims, (args[0], squeezed_dims(n)))
    if packet in VIEW_OPS:
        args = (args[0], list(local_shape(shape_of(n), s.out, t))) + tuple(args[2:])
        if packet is not aten.expand:
            # A local value's strides may differ from the traced ones (after a gather, or sdpa's layout):
            # reshape is still a view wherever the strides allow one.
            return g.call_function(aten.reshape.default, args, dict(kwargs))
    elif packet in (aten.split, aten.split_with_sizes):
        src = s.ins[0]
        sizes, dim = split_sizes(n)
        if isinstance(src, Shard) and src.dim == dim:
            local = [x // t for x in sizes]
            args = (args[0], local[0] if packet is aten.split else local) + tuple(args[2:])
    return g.call_function(n.target, tuple(args), dict(kwargs))
