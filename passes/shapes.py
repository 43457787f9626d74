"""Shape helpers shared by the sharding rules and the rewrite: how a view/reshape maps dims."""
from __future__ import annotations

import torch


def val(node):
    """The FakeTensor (or list of them) that ``torch.export`` recorded for a node, or None."""
    return node.meta.get("val") if hasattr(node, "meta") else None


def module_path(node) -> str:
    """The module a node comes from (``transformer.h.3.attn``), from export's ``nn_module_stack``; what
    every error message and dump names (an ATen node name alone tells a user nothing)."""
    stack = (node.meta.get("nn_module_stack") or {}) if hasattr(node, "meta") else {}
    return (next(reversed(stack.values()))[0] if stack else "") or "the top module"


def shape_of(node):
    v = val(node)
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def slice_bounds(shape, dim, start, end, step) -> tuple[int, int, int] | None:
    """``(dim, start, end)`` of ``slice(dim, start, end, step)`` on a tensor of ``shape``: the dim and
    bounds made non-negative and clipped, as Python slicing does; None for a step other than 1."""
    if step != 1:
        return None
    dim = dim % len(shape)
    full = shape[dim]
    start = 0 if start is None else (start + full if start < 0 else start)
    end = full if end is None else (end + full if end < 0 else end)
    return dim, max(0, min(start, full)), max(0, min(end, full))


def squeezed_dims(node) -> list[int]:
    """The dims ``squeeze`` removes: of those it names (all, by default), the ones of size 1 in the whole
    tensor (a shard may be 1 wide locally where the tensor is not)."""
    shape = shape_of(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else range(len(shape))
    dims = {d % len(shape) for d in ([dims] if isinstance(dims, int) else dims)} if shape else set()
    return sorted(d for d in dims if shape[d] == 1)


def view_groups(in_shape, out_shape):
    """Pair up dims of a contiguous reshape: ``[(in_dims, out_dims), ...]`` with equal products.

    ``(2, 16, 192) -> (32, 192)`` gives ``[((0, 1), (0,)), ((2,), (1,))]``. Size-1 dims join the group
    on their left so they never carry a shard.
    """
    groups, i, j = [], 0, 0
    ni, no = len(in_shape), len(out_shape)
    while i < ni or j < no:
        gi, gj = [], []
        pi = pj = 1
        if i < ni:
            gi.append(i); pi *= in_shape[i]; i += 1
        if j < no:
            gj.append(j); pj *= out_shape[j]; j += 1
        while pi != pj:
            if pi < pj and i < ni:
                gi.append(i); pi *= in_shape[i]; i += 1
            elif j < no:
                gj.append(j); pj *= out_shape[j]; j += 1
            else:
                return None
        while i < ni and in_shape[i] == 1 and (j >= no or out_shape[j] != 1):
            gi.append(i); i += 1
        while j < no and out_shape[j] == 1 and (i >= ni or in_shape[i] != 1):
            gj.append(j); j += 1
        groups.append((tuple(gi), tuple(gj)))
    return groups


def map_shard_through_view(in_shape, out_shape, dim, blocks, t):
    """Where a shard on input ``dim`` lands after a reshape, or None when it cannot stay local:
    ``(out_dim, out_blocks)``.

    A dim that survives unchanged keeps its shard as it is (padded or blocked alike). Otherwise the
    shard is followed as a digit of the flat index: input ``dim`` of length n is ``(blocks, t, c)`` in
    mixed radix, rank r holding digit value r. A reshape keeps the flat index, so the shard stays local
    when that digit falls whole inside one output dim, which is then ``(outer, t, inner)``:
    ``Shard(out_dim, blocks=outer)``. So ``h -> (nh, hs)`` shards the heads, a fused ``3h -> (3, nh, hs)``
    the heads of each block, and ``(B, E) -> (B*nh, hs)`` (batch and heads merged, as BLOOM and
    ``nn.MultiheadAttention`` do) gives every batch element's block of heads: ``blocks=B``.
    """
    groups = view_groups(in_shape, out_shape)
    if groups is None:
        return None
    for gi, gj in groups:
        if dim in gi:
            real_i = [d for d in gi if in_shape[d] != 1]
            real_j = [d for d in gj if out_shape[d] != 1]
            if real_i == [dim] and len(real_j) == 1:
                return (real_j[0], blocks)
            if t < 2:
                return _unit_axis(real_i, real_j, out_shape, dim, blocks)
            break
    if isinstance(blocks, tuple) or in_shape[dim] % (blocks * t):
        return None
    digit = in_shape[dim] // (blocks * t)          # the flat stride of the rank digit
    for d in in_shape[dim + 1:]:
        digit *= d
    stride = 1
    for j in reversed(range(len(out_shape))):
        lo, hi = stride, stride * out_shape[j]
        if lo <= digit and digit * t <= hi:
            if digit % lo or hi % (digit * t):
                return None
            inner = digit // lo
            return (j, out_shape[j] // (inner * t))
        stride = hi
    return None


def _unit_axis(real_i, real_j, out_shape, dim, blocks):
    """At tp=1 nothing is cut, so any mapping is exact; these (the leading dim of a merge or a split, a
    block count's next dim) keep the plans the tp=1 programs have always had."""
    if not real_i or dim != real_i[0]:
        return None
    if len(real_j) == 1:
        return (real_j[0], 1) if blocks == 1 else None
    if len(real_i) == 1:
        if blocks == 1:
            return (real_j[0], 1)
        return (real_j[1], 1) if out_shape[real_j[0]] == blocks else None
    return None


def writes_in_place(n) -> bool:
    """An ATen op that writes into one of its operands (``mul_``, ``copy_``, ``index_put_``), read from
    its schema (an argument marked ``Tensor(a!)``)."""
    schema = getattr(n.target, "_schema", None)
    return n.op == "call_function" and schema is not None and any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
