"""Tensor-parallel rewrite: make the planned graph local to one rank.

Walks the planned graph once and builds a new one in which

- every value has its *local* shape (``node.meta["local_shape"]``) and literal sizes say so
  (``view``/``reshape``/``expand`` sizes, ``split`` sizes of a blocked q|k|v shard);
- wherever a consumer needs another placement than its producer gives, a ``Redistribute`` module
  runs the collective (one per producer and target placement, shared by all consumers);
- a replicated value entering ops whose output is sharded goes through one ``CopyToTP`` (Megatron's f),
  so its gradient is all-reduced once however many column-parallel consumers it has (q, k and v);
- the two vocab-parallel ops are lowered to their modules.

The result is a per-rank program: rank-specific constants (vocab ranges) are baked in.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autoshard.passes.plan import partial_grad_use
from autoshard.passes.rules import VIEW_OPS, _split_sizes
from autoshard.passes.shapes import shape_of, val
from autoshard.passes.spec import Replicate, Shard, local_shape, local_size, shard_range
from autoshard.runtime import tp_modules as M

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


def _vocab_range(n, comm):
    """The vocab rows ``[start, start + valid)`` this rank holds of a padded vocab-sharded dim."""
    (start, stop), = shard_range(n, comm.size, comm.rank)
    return start, stop - start


def tp_rewrite_pass(gm: fx.GraphModule, comm) -> fx.GraphModule:
    t = comm.size
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
        src = u.meta["placement"]
        if src == placement:
            return env[u]
        if not isinstance(val(u), torch.Tensor):
            raise AssertionError(f"internal error: plan moves list-valued {u.name} from {src!r} to {placement!r}")
        name = add_module("redistribute", M.Redistribute(comm, src, placement, shape_of(u)))
        node = g.call_module(name, (env[u],))
        node.meta.update(placement=placement, local_shape=local_shape(shape_of(u), placement, t),
                         requires_grad=u.meta.get("requires_grad", False),
                         val=_local_val(u, placement, t), source=u.name)
        cache[u, placement] = node
        return node

    def with_f(u):
        if (u, "f") not in cache:
            name = add_module("f", M.CopyToTP(comm, shape_of(u)))
            node = g.call_module(name, (in_placement(u, Replicate()),))
            node.meta.update(placement=Replicate(), local_shape=shape_of(u), val=_local_val(u, Replicate(), t),
                             source=u.name)
            cache[u, "f"] = node
        return cache[u, "f"]

    for n in gm.graph.nodes:
        s = n.meta["tp_strategy"]
        if n.op == "placeholder":
            new = g.placeholder(n.name)
        elif n.op == "output":
            new = g.output(fx.node.map_arg(n.args[0], lambda u: in_placement(u, Replicate())))
            continue
        else:
            mapping = {}
            for pos, u in enumerate(n.all_input_nodes):
                if u.meta.get("requires_grad") and partial_grad_use(s, pos):
                    mapping[u] = with_f(u)
                else:
                    mapping[u] = in_placement(u, s.ins[pos])
            args = fx.node.map_arg(n.args, lambda u: mapping[u])
            kwargs = fx.node.map_arg(n.kwargs, lambda u: mapping[u])
            new = _lower(g, n, s, args, kwargs, comm, add_module)
        if new.name != n.name:
            new._rename(n.name)
        new.meta.update({k: v for k, v in n.meta.items() if k not in ("val",)})
        new.meta["val"] = _local_val(n, s.out, t)
        v = val(n)
        new.meta["local_shape"] = (local_shape(v.shape, s.out, t) if isinstance(v, torch.Tensor) else None)
        new.meta["global_shape"] = shape_of(n)
        env[n] = new
    g.lint()
    out = fx.GraphModule(root, g)
    return out


def _sole_reader(u):
    """Whether the loss may overwrite its logits: they come from a fresh op result through views that
    nothing else reads (not a graph input, not returned, not saved by a view's other users)."""
    while True:
        if len(u.users) != 1 or u.op != "call_function":
            return False
        if getattr(u.target, "overloadpacket", None) not in VIEW_OPS | {aten.alias}:
            return getattr(u.target, "overloadpacket", None) in (aten.linear, aten.mm, aten.matmul, aten.addmm)
        u = u.args[0]


def _lower(g, n, s, args, kwargs, comm, add_module):
    t = comm.size
    packet = getattr(n.target, "overloadpacket", None)
    if s.lowering == "vocab_parallel_embedding":
        start, valid = _vocab_range(shape_of(n.args[0])[0], comm)
        pad = args[2] if len(args) > 2 else -1
        local_pad = pad - start if pad is not None and pad >= 0 and start <= pad < start + valid else None
        name = add_module("vocab_embedding", M.VocabParallelEmbedding(start, valid, local_pad))
        return g.call_module(name, args[:2])
    if s.lowering == "vocab_parallel_cross_entropy":
        start, valid = _vocab_range(shape_of(n.args[0])[1], comm)
        reduction = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
        ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
        mod = M.VocabParallelCrossEntropy(comm, start, valid, ignore, reduction, inplace=_sole_reader(n.args[0]))
        name = add_module("vocab_cross_entropy", mod)
        return g.call_module(name, args[:2])
    if packet in VIEW_OPS:
        args = (args[0], list(local_shape(shape_of(n), s.out, t))) + tuple(args[2:])
        if packet is not aten.expand:
            # A local value's strides may differ from the traced ones (after a gather, or sdpa's layout):
            # reshape is still a view wherever the strides allow one.
            return g.call_function(aten.reshape.default, args, dict(kwargs))
    elif packet in (aten.split, aten.split_with_sizes):
        src = s.ins[0]
        sizes, dim = _split_sizes(n)
        if isinstance(src, Shard) and src.dim == dim:
            local = [x // t for x in sizes]
            args = (args[0], local[0] if packet is aten.split else local) + tuple(args[2:])
    return g.call_function(n.target, tuple(args), dict(kwargs))


def fuse_bias_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Fold ``add(linear(x, W), b)`` back into ``linear(x, W, b)`` (and ``mm`` + bias into ``addmm``).

    Undoes ``decompose_bias_pass`` wherever the bias add stayed local to the matmul, i.e. everywhere but
    after a row-parallel all-reduce: one fused kernel instead of a matmul plus an elementwise pass.
    """
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not aten.add.Tensor or len(n.args) != 2 or n.kwargs:
            continue  # (add with alpha scales the bias: not foldable)
        mm, b = n.args
        if not isinstance(mm, fx.Node) or not isinstance(b, fx.Node) or len(mm.users) != 1:
            continue
        if b.op != "placeholder" or len(b.meta.get("local_shape") or ()) != 1:
            continue
        if mm.target is aten.linear.default and len(mm.args) == 2:
            with g.inserting_before(n):
                fused = g.call_function(aten.linear.default, (mm.args[0], mm.args[1], b))
        elif mm.target is aten.mm.default:
            with g.inserting_before(n):
                fused = g.call_function(aten.addmm.default, (b, mm.args[0], mm.args[1]))
        else:
            continue
        fused.meta = dict(n.meta)
        n.replace_all_uses_with(fused)
        g.erase_node(n)
        g.erase_node(mm)
        fused.name = n.name
    g.lint()
    gm.recompile()
    return gm


def check_local_shapes_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Run the local program on meta tensors and check every value's shape against the plan.

    Catches a wrong literal size or a wrong collective in a compile-only run, before any process starts.
    """
    inputs = [_meta(n.meta["local_shape"], n.meta["val"]) for n in gm.graph.nodes if n.op == "placeholder"]

    class Checker(fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if "device" in kwargs:  # keep everything on meta (HF moves embeddings with .to(device))
                kwargs = {**kwargs, "device": torch.device("meta")}
            return super().call_function(target, args, kwargs)

        def run_node(self, node):
            out = super().run_node(node)
            if isinstance(out, torch.Tensor) and not out.is_meta:  # creation ops (arange) default to cpu
                out = out.to("meta")
            want = node.meta.get("local_shape")
            if isinstance(out, torch.Tensor) and want is not None and tuple(out.shape) != tuple(want):
                raise AssertionError(f"local shape of {node.name} ({node.format_node()}) is {tuple(out.shape)}, "
                                     f"the plan says {tuple(want)}")
            return out

    Checker(gm).run(*inputs)
    return gm
