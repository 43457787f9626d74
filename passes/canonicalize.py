"""Canonicalize: rewrite ops into the smaller set the sharding rules know, and make in-place ops pure.

Export keeps each model's own spelling of an op: GPT-NeoX ``chunk``s its fused q|k|v, GPT-J ``stack``s
and ``flatten``s in its rotary, Falcon transposes its weights with ``numpy_T`` and broadcasts kv heads
with ``broadcast_to``. Each has an exact equivalent among the ops the rules cover. ``REWRITES`` is a
table: one row per op, a function that emits the replacement. An op is supported by adding a row.

Slices that tile a tensor along one dim (Phi-3's ``qkv[..., :q]``, ``qkv[..., q:q+kv]``, ``qkv[..., q+kv:]``)
become one ``split_with_sizes``: the spelling in which the planner finds a fused projection
(``hints.block_hints``), as it does for GPT-2's ``c_attn.split``.

In-place ops (Falcon's ``mlp_out += attn_out``, eager attention's ``scores /= ...``) become their
out-of-place form when the value they write is an op result that no view aliases; later reads of it
read the new node. Without this, a sharded collective output could be written in place.

Under ``mixed_precision`` the program is traced in bf16; the losses in ``FP32_OPS`` get their input
cast to fp32 first, as autocast does (and as Megatron computes its loss), so the loss is an fp32 number.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autoshard.passes.shapes import module_path, shape_of

aten = torch.ops.aten


def _meta(x):
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    if isinstance(v, torch.Tensor):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(a) for a in x)
    return x


def val_dtype(x):
    """The dtype of an fx node's recorded value, or of a Python scalar (its torch default)."""
    v = x.meta.get("val") if isinstance(x, fx.Node) else torch.tensor(x)
    return v.dtype


def _emit(g, target, args, like: fx.Node):
    """A new node computing ``target(*args)``, with its ``val`` from a meta run and ``like``'s module stack."""
    node = g.call_function(target, tuple(args))
    out = target(*[_meta(a) for a in args])
    node.meta = {k: v for k, v in like.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")}
    node.meta["val"] = out
    return node


def _chunk(g, n):
    x, chunks = n.args[0], n.args[1]
    dim = n.args[2] if len(n.args) > 2 else 0
    size = -(-shape_of(x)[dim] // chunks)
    return _emit(g, aten.split.Tensor, (x, size, dim), n)


def _stack(g, n):
    tensors = n.args[0]
    dim = n.args[1] if len(n.args) > 1 else 0
    dim = dim % (len(shape_of(tensors[0])) + 1)
    parts = [_emit(g, aten.unsqueeze.default, (t, dim), n) for t in tensors]
    return _emit(g, aten.cat.default, (parts, dim), n)


def _flatten(g, n):
    return _emit(g, aten.reshape.default, (n.args[0], list(shape_of(n))), n)


def _numpy_t(g, n):
    nd = len(shape_of(n.args[0]))
    return _emit(g, aten.permute.default, (n.args[0], list(range(nd - 1, -1, -1))), n)


def _broadcast_to(g, n):
    return _emit(g, aten.expand.default, (n.args[0], list(shape_of(n))), n)


def _copy(g, n):
    """Functional ``copy(self, src)`` (what functionalization makes of ``x[...] = src``) has no
    derivative: it is ``src`` cast to ``self``'s dtype and broadcast to its shape. Into a view, the base
    still flows through the scatter that follows; into a whole tensor, see ``_overwrite``."""
    if not _may_alias(n.args[0]):
        return _overwrite(g, n)
    return _part(g, n)


def _cast(g, x, dtype, like):
    """``x`` as ``dtype`` (``_to_copy``), with ``like``'s module stack."""
    out = _emit(g, aten._to_copy.default, (x,), like)
    out.kwargs = {"dtype": dtype}
    out.meta["val"] = out.meta["val"].to(dtype)
    return out


def written_as(g, src, shape, dtype, like):
    """``src`` as ``copy_`` writes it into a tensor of ``shape`` and ``dtype``: cast and broadcast, each
    only when needed (``src`` itself when neither is)."""
    out = src if val_dtype(src) == dtype else _cast(g, src, dtype, like)
    return out if shape_of(out) == tuple(shape) else _emit(g, aten.expand.default, (out, list(shape)), like)


def _part(g, n):
    """``copy(x, src)``'s value: ``src`` in ``x``'s dtype and shape (a new tensor, as the copy is)."""
    x, src = n.args[0], n.args[1]
    out = written_as(g, src, shape_of(x), val_dtype(x), n)
    return out if out is not src else _emit(g, aten.clone.default, (src,), n)


def _overwrite(g, n):
    """``x.copy_(src)`` made pure: ``src`` scattered over all of ``x``, so ``x`` stays in the autograd graph
    with a zero gradient, as eager's in-place copy leaves it (a parameter that fed only ``x`` gets zeros,
    not None: an optimizer still decays it)."""
    x, part = n.args[0], _part(g, n)
    if shape_of(x):
        return _emit(g, aten.slice_scatter.default, (x, part), n)
    flat = [_emit(g, aten.reshape.default, (v, [1]), n) for v in (x, part)]   # a 0-d x: no x * 0 (inf * 0)
    return _emit(g, aten.reshape.default, (_emit(g, aten.slice_scatter.default, tuple(flat), n), []), n)


REWRITES = {
    aten.copy.default: _copy,
    aten.chunk.default: _chunk,
    aten.unsafe_chunk.default: _chunk,
    aten.stack.default: _stack,
    aten.flatten.using_ints: _flatten,
    aten.unflatten.int: _flatten,     # nn.MultiheadAttention's packed q|k|v: a reshape either way
    aten.numpy_T.default: _numpy_t,
    aten.broadcast_to.default: _broadcast_to,
}

def _may_alias(node) -> bool:
    """Whether ``node``'s value may share storage with an input: a view, or an op that may return its
    input itself (``contiguous`` of a contiguous tensor). Read from the op's schema (a return with alias
    info, ``Tensor(a)``), through ``getitem`` of a multi-output view such as ``split``."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and _may_alias(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _out_of_place(node):
    """The functional twin of an in-place ATen op (``add_.Tensor`` -> ``add.Tensor``), or None."""
    packet = getattr(node.target, "overloadpacket", None)
    name = getattr(packet, "__name__", "")
    if not name.endswith("_") or name.startswith("_"):
        return None
    twin = getattr(aten, name[:-1], None)
    return getattr(twin, node.target._overloadname, None) if twin is not None else None


def _functionalize(g, n) -> bool:
    target = _out_of_place(n)
    x = n.args[0] if n.args else None
    if target is None or not isinstance(x, fx.Node) or x.op != "call_function":
        return False
    if _may_alias(x) or any(_may_alias(u) for u in x.users if u is not n):
        return False  # a view shares x's storage: the write would show through it
    order = {m: i for i, m in enumerate(g.nodes)}
    with g.inserting_before(n):
        pure = g.call_function(target, n.args, dict(n.kwargs))
        pure.meta = dict(n.meta)
        if target is aten.copy.default:
            twin, pure = pure, _overwrite(g, pure)
            g.erase_node(twin)
        dtype = x.meta["val"].dtype
        if target(*[_meta(a) for a in n.args], **n.kwargs).dtype != dtype:
            # the in-place op keeps x's dtype; its pure twin type-promotes: cast back as the write did
            pure = _cast(g, pure, dtype, n)
    for u in list(x.users):
        if u is not n and order.get(u, -1) > order[n]:   # (nodes made here are not in `order`)
            u.replace_input_with(x, pure)   # later reads see the written value
    n.replace_all_uses_with(pure)
    g.erase_node(n)
    return True


def _mask_unread(n) -> bool:
    return all(u.target is operator.getitem and u.args[1] == 0 for u in n.users)


def _plain_dropout(g, n):
    """Functionalization spells ``dropout`` as ``native_dropout`` (output and mask); when only the output
    is read, it is ``dropout`` again, the op the rules, the tp dropout warning and the per-rank RNG
    rewrite know."""
    train = n.args[2] if len(n.args) > 2 and n.args[2] is not None else True
    with g.inserting_before(n):
        plain = _emit(g, aten.dropout.default, (n.args[0], n.args[1], train), n)
    for u in list(n.users):
        u.replace_all_uses_with(plain)
        g.erase_node(u)
    g.erase_node(n)


FP32_OPS = {aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.log_softmax, aten._log_softmax,
            aten.logsumexp, aten.mse_loss}


def _loss_in_fp32(g, n):
    x = n.args[0]
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(v, torch.Tensor) or v.dtype not in (torch.bfloat16, torch.float16):
        return
    with g.inserting_before(n):
        up = _cast(g, x, torch.float32, n)
    n.replace_input_with(x, up)
    n.meta["val"] = n.target(*[_meta(a) for a in n.args], **n.kwargs)


def _slice_range(n) -> tuple | None:
    """``(dim, start, end)`` of a step-1 ``aten.slice``, clamped as slicing clamps; None otherwise."""
    x = n.args[0]
    shape = shape_of(x) if isinstance(x, fx.Node) else None
    args = list(n.args[1:]) + [None] * (4 - len(n.args[1:]))
    dim, start, end, step = (args[0] or 0), args[1], args[2], (args[3] or 1)
    if not shape or step != 1 or not all(isinstance(v, (int, type(None))) for v in (start, end)):
        return None
    size = shape[dim % len(shape)]
    if not isinstance(size, int):
        return None

    def clamp(v, default):
        v = default if v is None else (v + size if v < 0 else v)
        return min(max(v, 0), size)
    return dim % len(shape), clamp(start, 0), clamp(end, size)


def _tiling_slices_as_split(g) -> None:
    """Replace slices of one tensor that tile a dim exactly (no gap, no overlap, none empty, two or more
    pieces) by ``getitem``s of one ``split_with_sizes``. Two slices of the same range read the same piece."""
    groups = {}
    for n in g.nodes:
        if n.op == "call_function" and n.target is aten.slice.Tensor and isinstance(n.args[0], fx.Node):
            r = _slice_range(n)
            if r is not None:
                groups.setdefault((n.args[0], r[0]), {}).setdefault(r[1:], []).append(n)
    order = {n: i for i, n in enumerate(g.nodes)}
    for (_, dim), by_range in groups.items():
        ranges = sorted(by_range)
        x = by_range[ranges[0]][0].args[0]   # now: an earlier tiling may have replaced the slice it was
        ends = [0] + [e for _, e in ranges]
        if len(ranges) < 2 or any(s != ends[i] or e <= s for i, (s, e) in enumerate(ranges)) \
                or ends[-1] != shape_of(x)[dim]:
            continue
        first = min((n for r in ranges for n in by_range[r]), key=order.__getitem__)
        with g.inserting_before(first):
            split = _emit(g, aten.split_with_sizes.default, (x, [e - s for s, e in ranges], dim), first)
            pieces = [g.call_function(operator.getitem, (split, i)) for i in range(len(ranges))]
        for piece, r in zip(pieces, ranges):
            piece.meta = dict(by_range[r][0].meta)
            for n in by_range[r]:
                n.replace_all_uses_with(piece)
                g.erase_node(n)


def canonicalize_pass(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    g = gm.graph
    _tiling_slices_as_split(g)
    mixed = ctx is not None and ctx.options.mixed_precision
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if mixed and getattr(n.target, "overloadpacket", None) in FP32_OPS:
            _loss_in_fp32(g, n)
        if n.target is aten.native_dropout.default and _mask_unread(n):
            _plain_dropout(g, n)
            continue
        if n.target in REWRITES:
            with g.inserting_before(n):
                new = REWRITES[n.target](g, n)
            n.replace_all_uses_with(new)
            g.erase_node(n)
        elif _out_of_place(n) is not None and not _functionalize(g, n) and ctx is not None and ctx.mesh.tp > 1:
            # The written value has views (or is one). Sharding moves a view and its base through different
            # collectives, so the write would not reach the view: a silent wrong result. Say so instead.
            raise NotImplementedError(
                f"'{module_path(n)}' writes in place ({n.target}) to a tensor that has views: tensor parallelism cannot "
                f"keep that aliasing across shards. Write it out of place (for example `h = h * 2` instead of "
                f"`h.mul_(2)`), or run with tp=1")
    g.lint()
    gm.recompile()
    return gm
