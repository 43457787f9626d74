"""Per-op sharding rules: for one ATen op, every way it can run locally on one tensor-parallel axis.

A rule returns ``Strategy`` objects: the placement of the output and the placement each input must
arrive in. The planner (``plan.py``) picks one strategy per node; the rewrite (``tp_rewrite.py``) makes the
graph local. A rule lists only strategies whose *local* computation is exact, so anything the rules do
not cover runs replicated — never a silent wrong result. The rules know ops, not modules: Megatron's
plan falls out of the costs, not out of names like ``c_fc``.

Op-specific lowerings (``Strategy.lowering``) name the few cases where the local program is not the
same op on local shards: the vocab-parallel embedding (mask out-of-range ids) and the vocab-parallel
cross-entropy (all-reduce the max, the target logit and the sum of exps; never gather the logits).
"""
from __future__ import annotations

import operator

import torch

from autoshard.ir.placement import P, R, Shard, block_sizes, shardable
from autoshard.passes.rules_einsum import einsum
from autoshard.passes.rules_experts import grouped_mm, is_grouped_mm
from autoshard.passes.rules_reduce import REDUCE_RULES, along_dim, elementwise
from autoshard.passes.rules_vocab import cross_entropy, embedding, logsumexp
from autoshard.passes.shapes import map_shard_through_view, shape_of, squeezed_dims, val
from autoshard.passes.strategy import RuleContext, Strategy, _ins, _replicated, blocks_order, op_argument, shard_options

__all__ = ["RULES", "POINTWISE", "VIEW_OPS", "RuleContext", "Strategy", "strategies_for", "shard_options"]

aten = torch.ops.aten


# --- pointwise ----------------------------------------------------------------------------------------
POINTWISE = {
    aten.add, aten.sub, aten.mul, aten.div, aten.gelu, aten.tanh, aten.pow, aten.relu, aten.silu,
    aten.sigmoid, aten.exp, aten.neg, aten.dropout, aten.to, aten._to_copy, aten.alias, aten.clone,
    aten.contiguous, aten.where, aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.masked_fill,
    aten.rsqrt, aten.sqrt, aten.abs, aten.erf, aten.type_as, aten.detach, aten.reciprocal, aten.rsub,
    aten.logical_and, aten.logical_or, aten.bitwise_and, aten.__and__, aten.__or__, aten.softplus,
    aten.cos, aten.sin, aten.log, aten.exp2, aten.log1p, aten.expm1, aten.square, aten.maximum, aten.minimum,
    aten.clamp, aten.clamp_min, aten.clamp_max, aten.logical_not, aten.bitwise_not, aten.bitwise_or,
    aten.sign, aten.floor, aten.ceil, aten.round, aten.trunc, aten.fill, aten.zeros_like, aten.ones_like,
    aten.full_like, aten.empty_like, aten.hardtanh, aten.leaky_relu, aten.elu, aten.mish, aten.hardswish,
    aten.floor_divide,
}
LINEAR_UNARY = {aten.neg, aten.alias, aten.clone, aten.contiguous, aten.to, aten._to_copy, aten.detach,
                aten.type_as}


def _is_identity_dropout(node):
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return p == 0.0 or not train


def _float_result(node):
    v = val(node)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def pointwise(node, ctx):
    out = shape_of(node)
    tensors = node.all_input_nodes
    strategies = _replicated(node)
    for s in shard_options(node, out, ctx, allow_pad=True):
        m = {}
        for inp in tensors:
            ishape = shape_of(inp) or ()
            d = s.dim - (len(out) - len(ishape))
            m[inp] = Shard(d, s.blocks) if d >= 0 and ishape[d] == out[s.dim] else R
        strategies.append(Strategy(s, _ins(node, m), sharded=True))
    # Partial passes through ops that are linear in the partial operand -- and only in it: y * y of a
    # Partial y is not the sum of the ranks' squares, and a cast to an integer type is not linear.
    packet = node.target.overloadpacket
    tensor_args = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if len(set(tensor_args)) != len(tensor_args) or not _float_result(node):
        return strategies
    if packet is aten.div and node.kwargs.get("rounding_mode") is not None:
        return strategies
    if packet in (aten.add, aten.sub) and len(tensor_args) == 2 and "alpha" not in node.kwargs:
        strategies.append(Strategy(P, _ins(node, {n: P for n in tensors})))
    elif packet in (aten.mul, aten.div) and tensor_args:
        first = tensor_args[0]  # x * y, x / y: partial in x, y replicated (or a scalar)
        strategies.append(Strategy(P, _ins(node, {first: P})))
        if packet is aten.mul and len(tensor_args) == 2:
            strategies.append(Strategy(P, _ins(node, {tensor_args[1]: P})))
    elif packet in LINEAR_UNARY or (packet is aten.dropout and _is_identity_dropout(node)):
        strategies.append(Strategy(P, _ins(node, {tensors[0]: P})))
    return strategies


# --- layout ops ---------------------------------------------------------------------------------------
def view(node, ctx):
    src = node.args[0]
    ishape, oshape = shape_of(src), shape_of(node)
    strategies = _replicated(node) + [Strategy(P, _ins(node, {src: P}))]
    for s in shard_options(src, ishape, ctx, allow_pad=True):
        mapped = map_shard_through_view(ishape, oshape, s.dim, s.blocks, ctx.t)
        if mapped and shardable(oshape[mapped[0]], ctx.t, mapped[1], allow_pad=True):
            strategies.append(Strategy(Shard(*mapped), _ins(node, {src: s}), sharded=True))
    return strategies


def _permuting(node, ctx, perm):
    """Ops that only reorder dims: ``perm[out_dim] = in_dim``."""
    src = node.args[0]
    strategies = _replicated(node) + [Strategy(P, _ins(node, {src: P}))]
    for s in shard_options(src, shape_of(src), ctx, allow_pad=True):
        if s.dim in perm:
            strategies.append(Strategy(Shard(perm.index(s.dim), s.blocks), _ins(node, {src: s}), sharded=True))
    return strategies


def permutation(node) -> list:
    """``perm[out_dim] = in_dim`` of a ``transpose``, ``permute`` or ``t`` (of a vector: itself)."""
    nd = len(shape_of(node))
    packet = node.target.overloadpacket
    if packet is aten.permute:
        return [d % nd for d in node.args[1]]
    if packet is aten.t:
        return [1, 0] if nd == 2 else [0]
    d0, d1 = (a % nd for a in node.args[1:3])
    perm = list(range(nd))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return perm


def reorder(node, ctx):
    return _permuting(node, ctx, permutation(node))


def unsqueeze(node, ctx):
    nd = len(shape_of(node))
    d = node.args[1] % nd
    return _permuting(node, ctx, [i if i < d else (i - 1 if i > d else -1) for i in range(nd)])


def squeeze(node, ctx):
    """``squeeze`` (all size-1 dims, one, or a list): the kept dims keep their shards."""
    gone = squeezed_dims(node)
    return _permuting(node, ctx, [d for d in range(len(shape_of(node.args[0]))) if d not in gone])


def expand(node, ctx):
    """Dims that keep their size keep their shards. A broadcast dim (size 1, or new) can also be cut from a
    replicated input: each rank expands it to its own part, and the input's gradient (each rank's sum over
    its part) is all-reduced by Megatron's f. Multi-query k and v expanded to the query heads so stay as
    small as one head until each rank's heads, instead of being expanded whole and sliced (whose backward
    all-gathers the expanded gradient)."""
    src = node.args[0]
    ishape, oshape = shape_of(src), shape_of(node)
    off = len(oshape) - len(ishape)
    perm = [i - off if i >= off and ishape[i - off] == oshape[i] else -1 for i in range(len(oshape))]
    strategies = _permuting(node, ctx, perm)
    for d in range(len(oshape)):
        broadcast = d < off or (ishape[d - off] == 1 and oshape[d] > 1)
        if broadcast and shardable(oshape[d], ctx.t):
            strategies.append(Strategy(Shard(d), _ins(node, {src: R}), sharded=True))
    return strategies


def complex_view(node, ctx):
    """``view_as_complex`` ([..., n, 2] -> [..., n]) and ``view_as_real`` (back): every dim but the
    (real, imaginary) pair keeps its index, so its shard; a sum of complex parts is the sum of their real
    pairs, so Partial passes too. torchtitan's rotary embedding turns q and k complex, rotates them by a
    complex table and turns them back: with this rule the heads stay sharded through it."""
    keep = min(len(shape_of(node.args[0])), len(shape_of(node)))
    return _permuting(node, ctx, [d if d < keep else -1 for d in range(len(shape_of(node)))])


def repeat_interleave(node, ctx):
    """``repeat_interleave(x, r, dim)`` (grouped-query k/v repeated to the query heads): an even shard of
    ``dim`` holds whole groups, so rank i's n/t inputs become its n r / t outputs (kv head j stays beside
    query heads j r .. j r + r - 1); other dims keep their shards. A padded shard of ``dim`` would not line
    up, and a repeats tensor or no ``dim`` (a flattening repeat) stays replicated."""
    src, repeats = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None or not isinstance(repeats, int):
        return _replicated(node)
    ishape = shape_of(src)
    dim %= len(ishape)
    strategies = _replicated(node) + [Strategy(P, _ins(node, {src: P}))]
    for s in shard_options(src, ishape, ctx, allow_pad=True):
        if s.dim != dim or (s.blocks == 1 and ishape[dim] % ctx.t == 0):
            strategies.append(Strategy(Shard(s.dim, s.blocks), _ins(node, {src: s}), sharded=True))
    return strategies


def split_sizes(node):
    src = node.args[0]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    n = shape_of(src)[dim % len(shape_of(src))]
    if node.target.overloadpacket is aten.split_with_sizes:
        return list(node.args[1]), dim % len(shape_of(src))
    size = node.args[1]
    return [min(size, n - i) for i in range(0, n, size)], dim % len(shape_of(src))


def split(node, ctx):
    src = node.args[0]
    sizes, dim = split_sizes(node)
    strategies = _replicated(node) + [Strategy(P, _ins(node, {src: P}))]
    for s in shard_options(src, shape_of(src), ctx):
        if s.dim != dim:
            strategies.append(Strategy(s, _ins(node, {src: s}), sharded=True))
        elif block_sizes(shape_of(src)[dim], s.blocks) == tuple(sizes):  # fused q|k|v: each piece by heads
            strategies.append(Strategy(Shard(dim), _ins(node, {src: s}), sharded=True))
    return strategies


def getitem(node, ctx):
    src = node.args[0]
    opts = [R, P] + shard_options(node, shape_of(node), ctx)
    return [Strategy(p, _ins(node, {src: p}), sharded=isinstance(p, Shard)) for p in opts]


def slice_like(node, ctx):
    """slice/select/narrow along ``dim``: any other dim keeps its shard."""
    src = node.args[0]
    nd_in = len(shape_of(src))
    dim = (node.args[1] if len(node.args) > 1 else 0) % nd_in
    drops = node.target.overloadpacket is aten.select
    strategies = _replicated(node) + [Strategy(P, _ins(node, {src: P}))]
    for s in shard_options(src, shape_of(src), ctx):
        if s.dim != dim:
            od = s.dim - 1 if drops and s.dim > dim else s.dim
            strategies.append(Strategy(Shard(od, s.blocks), _ins(node, {src: s}), sharded=True))
    return strategies


def scatter_like(node, ctx):
    """``slice_scatter`` / ``select_scatter`` (what functionalization makes of ``x[:, t] = y``): sharded
    along any dim but the written one, base and part alike; partial sums stay partial (it is linear in
    both)."""
    base, part = node.args[0], node.args[1]
    nd = len(shape_of(base))
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
    drops = node.target.overloadpacket is aten.select_scatter
    strategies = _replicated(node) + [Strategy(P, _ins(node, {base: P, part: P}))]
    for s in shard_options(base, shape_of(base), ctx):
        if s.dim != dim:
            pd = s.dim - 1 if drops and s.dim > dim else s.dim
            strategies.append(Strategy(s, _ins(node, {base: s, part: Shard(pd, s.blocks)}), sharded=True))
    return strategies


def index(node, ctx):
    """``x[..., idx, ...]`` with one 1-D index tensor (``aten.index.Tensor``): dims other than the indexed
    one keep their shard (Falcon's kv-head pick, HF's position gathers)."""
    src, indices = node.args[0], node.args[1]
    tensors = [(k, i) for k, i in enumerate(indices) if i is not None]
    strategies = _replicated(node)
    if len(tensors) != 1 or len(shape_of(tensors[0][1]) or ()) != 1:
        return strategies
    k = tensors[0][0]
    for s in shard_options(src, shape_of(src), ctx):
        if s.dim != k:
            strategies.append(Strategy(s, _ins(node, {src: s}), sharded=True))
    return strategies


def cat(node, ctx):
    tensors = node.all_input_nodes
    nd = len(shape_of(node))
    dim = (node.args[1] if len(node.args) > 1 else 0) % nd
    strategies = _replicated(node) + [Strategy(P, _ins(node, {n: P for n in tensors}))]
    for s in shard_options(node, shape_of(node), ctx):
        if s.dim != dim and s.blocks == 1:
            strategies.append(Strategy(s, _ins(node, {n: s for n in tensors}), sharded=True))
    return strategies


# --- reductions and normalisations --------------------------------------------------------------------
def reduce_sum(node, ctx):
    src = node.args[0]
    ishape = shape_of(src)
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(len(ishape)))
    dims = {d % len(ishape) for d in ([dims] if isinstance(dims, int) else dims)}
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    is_sum = node.target.overloadpacket is aten.sum
    strategies = _replicated(node) + ([Strategy(P, _ins(node, {src: P}))] if is_sum else [])
    for s in shard_options(src, ishape, ctx):
        if s.dim in dims:
            if is_sum and s.blocks == 1:
                strategies.append(Strategy(P, _ins(node, {src: s}), sharded=True))
        else:
            od = s.dim if keep else s.dim - sum(1 for d in dims if d < s.dim)
            strategies.append(Strategy(Shard(od, s.blocks), _ins(node, {src: s}), sharded=True))
    return strategies


def layer_norm(node, ctx):
    """layer_norm and rms_norm: sharded on the dims they do not normalize (the weight replicated, its
    gradient a partial sum that ``tp_rewrite`` completes)."""
    x = node.args[0]
    nd = len(shape_of(x))
    normalized = len(op_argument(node, "normalized_shape"))
    return _replicated(node) + [Strategy(s, _ins(node, {x: s}), sharded=True)
                                for s in shard_options(x, shape_of(x), ctx) if s.dim < nd - normalized]


# --- contractions -------------------------------------------------------------------------------------
def linear(node, ctx):
    """y = x W^T (+ b). Column: W split by output rows. Row: W split by input columns -> Partial."""
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else None
    xs, ws, ys = shape_of(x), shape_of(w), shape_of(node)
    last = len(ys) - 1
    strategies = _replicated(node)
    blocks = {1} | {k for d, k in ctx.hints.get(node, ()) if d == last}
    for k in sorted(blocks, key=blocks_order):
        if shardable(ws[0], ctx.t, k, allow_pad=(k == 1)):
            m = {w: Shard(0, k)} | ({b: Shard(0, k)} if b is not None else {})
            strategies.append(Strategy(Shard(last, k), _ins(node, m), sharded=True))
    if b is None and ws[1] % ctx.t == 0:
        strategies.append(Strategy(P, _ins(node, {x: Shard(len(xs) - 1), w: Shard(1)}), sharded=True))
    for d in range(len(xs) - 1):
        if xs[d] % ctx.t == 0 and xs[d] > 1:
            strategies.append(Strategy(Shard(d), _ins(node, {x: Shard(d)}), sharded=True))
    if b is None:
        strategies.append(Strategy(P, _ins(node, {x: P})))
    return strategies


def _conv_groups(node) -> int:
    return node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)


def depthwise_conv1d(node, ctx):
    """``conv1d`` with one filter per channel (``groups == channels``: the short causal conv of Mamba,
    gated DeltaNet and RG-LRU mixers): channels are independent, so input, weight and bias shard along
    them alike and each rank convolves its own (``groups`` becomes the local channel count, lowering
    ``depthwise_channels``). Batch rows shard too, with the filters whole. Any other conv stays replicated."""
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], torch.fx.Node) else None
    xs, ws = shape_of(x), shape_of(w)
    strategies = _replicated(node)
    if len(xs) != 3 or _conv_groups(node) != xs[1] or ws[0] != xs[1] or ws[1] != 1:
        return strategies
    for s in shard_options(x, xs, ctx):
        if s.dim == 1:
            m = {x: s, w: Shard(0, s.blocks)} | ({b: Shard(0, s.blocks)} if b is not None else {})
            strategies.append(Strategy(s, _ins(node, m), lowering="depthwise_channels", sharded=True))
        elif s.dim == 0:
            strategies.append(Strategy(s, _ins(node, {x: s}), sharded=True))
    return strategies


def mm(node, ctx):
    a, b = node.args[0], node.args[1]
    (m, k), (_, n) = shape_of(a), shape_of(b)
    strategies = _replicated(node) + [Strategy(P, _ins(node, {a: P}))]
    blocks = {1} | {kk for d, kk in ctx.hints.get(node, ()) if d == 1}
    for kk in sorted(blocks, key=blocks_order):
        if shardable(n, ctx.t, kk, allow_pad=(kk == 1)):
            strategies.append(Strategy(Shard(1, kk), _ins(node, {b: Shard(1, kk)}), sharded=True))
    if k % ctx.t == 0:
        strategies.append(Strategy(P, _ins(node, {a: Shard(1), b: Shard(0)}), sharded=True))
    if m % ctx.t == 0:
        strategies.append(Strategy(Shard(0), _ins(node, {a: Shard(0)}), sharded=True))
    return strategies


def _batch_shards(a, ctx):
    """The shards of a batched matmul's batch dim: any the operand can hold, blocked ones too (BLOOM's
    batch*heads dim holds each batch element's block of heads: ``Shard(0, blocks=B)``)."""
    return [s for s in shard_options(a, shape_of(a), ctx) if s.dim == 0 and not s.unequal]


def bmm(node, ctx):
    a, b = node.args[0], node.args[1]
    (_, m, k), (_, _, n) = shape_of(a), shape_of(b)
    t = ctx.t
    strategies = _replicated(node)
    for s in _batch_shards(a, ctx):
        strategies.append(Strategy(s, _ins(node, {a: s, b: s}), sharded=True))
    if m % t == 0:
        strategies.append(Strategy(Shard(1), _ins(node, {a: Shard(1)}), sharded=True))
    if n % t == 0:
        strategies.append(Strategy(Shard(2), _ins(node, {b: Shard(2)}), sharded=True))
    if k % t == 0:
        strategies.append(Strategy(P, _ins(node, {a: Shard(2), b: Shard(1)}), sharded=True))
    return strategies


def baddbmm(node, ctx):
    """``self + a @ b`` batched ([B, m, k] @ [B, k, n]; RG-LRU's per-head gates): the batch, m or n dim
    shards as in ``bmm``, ``self`` with it where it has that dim and whole where it broadcasts."""
    c, a, b = node.args[0], node.args[1], node.args[2]
    (B, m, _), (_, _, n) = shape_of(a), shape_of(b)
    cs = (1,) * (3 - len(shape_of(c))) + tuple(shape_of(c))
    strategies = _replicated(node)
    for s in _batch_shards(a, ctx):
        own = {c: s} if len(shape_of(c)) == 3 and cs[0] == B else {}   # else c broadcasts over the batch
        strategies.append(Strategy(s, _ins(node, {a: s, b: s} | own), sharded=True))
    for d, size, operands in ((1, m, {a: Shard(1)}), (2, n, {b: Shard(2)})):
        if size % ctx.t == 0 and size > 1:
            own = {c: Shard(d - (3 - len(shape_of(c))))} if cs[d] == size else {}
            strategies.append(Strategy(Shard(d), _ins(node, operands | own), sharded=True))
    return strategies


def matmul(node, ctx):
    """N-d ``a @ b`` ([..., m, k] @ [..., k, n], batch dims broadcast): eager attention's QK^T and PV.

    Batch dims (heads, batch) shard both operands alike; m shards a, n shards b; k sharded on both gives
    Partial. Two-d weights (``x @ W``) are the column/row cases of ``mm``.
    """
    a, b = node.args[0], node.args[1]
    sa, sb, so = shape_of(a), shape_of(b), shape_of(node)
    if len(sa) < 2 or len(sb) < 2:
        return _replicated(node)
    t, nd = ctx.t, len(so)
    strategies = _replicated(node) + [Strategy(P, _ins(node, {a: P}))]
    for d in range(nd - 2):  # batch dims, right-aligned
        da, db = d - (nd - len(sa)), d - (nd - len(sb))
        ka = sa[da] if da >= 0 else 1
        kb = sb[db] if db >= 0 else 1
        if so[d] % t or so[d] == 1:
            continue
        m = {}
        if ka == so[d]:
            m[a] = Shard(da)
        if kb == so[d]:
            m[b] = Shard(db)
        strategies.append(Strategy(Shard(d), _ins(node, m), sharded=True))
    if sa[-2] % t == 0:
        strategies.append(Strategy(Shard(nd - 2), _ins(node, {a: Shard(len(sa) - 2)}), sharded=True))
    if sb[-1] % t == 0:
        strategies.append(Strategy(Shard(nd - 1), _ins(node, {b: Shard(len(sb) - 1)}), sharded=True))
    if sa[-1] % t == 0:
        strategies.append(Strategy(P, _ins(node, {a: Shard(len(sa) - 1), b: Shard(len(sb) - 2)}), sharded=True))
    return strategies


def sdpa(node, ctx):
    """Attention is independent per batch row and per head: shard either, q, k, v (and mask) alike."""
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 and isinstance(node.args[3], torch.fx.Node) else None
    qs, ks, vs = shape_of(q), shape_of(k), shape_of(v)
    strategies = _replicated(node)
    # Only dims in front of (L, E) are independent: batch and heads of a (B, nh, L, E) input. A 3-d
    # (B, L, E) input's dim 1 is the sequence. Grouped-query k/v (fewer heads) shard only by batch.
    for d in range(len(qs) - 2):
        if qs[d] % ctx.t == 0 and qs[d] > 1 and ks[d] == vs[d] == qs[d]:
            m = {q: Shard(d), k: Shard(d), v: Shard(d)}
            if mask is not None:
                ms = shape_of(mask)
                md = d - (len(qs) - len(ms))
                m[mask] = Shard(md) if md >= 0 and ms[md] == qs[d] else R
            strategies.append(Strategy(Shard(d), _ins(node, m), sharded=True))
    return strategies


RULES = {
    aten.view: view, aten.reshape: view, aten._unsafe_view: view,
    aten.transpose: reorder, aten.permute: reorder, aten.t: reorder, aten.unsqueeze: unsqueeze, aten.squeeze: squeeze,
    aten.expand: expand, aten.split: split, aten.split_with_sizes: split,
    aten.view_as_complex: complex_view, aten.view_as_real: complex_view, aten.repeat_interleave: repeat_interleave,
    aten.slice: slice_like, aten.select: slice_like, aten.narrow: slice_like, aten.index: index,
    aten.cat: cat, aten.concat: cat, aten.concatenate: cat,
    aten.slice_scatter: scatter_like, aten.select_scatter: scatter_like,
    aten._softmax: along_dim, aten.softmax: along_dim, aten._log_softmax: along_dim, aten.log_softmax: along_dim,
    aten.sum: reduce_sum, aten.mean: reduce_sum,
    aten.layer_norm: layer_norm, aten.rms_norm: layer_norm, aten.linear: linear, aten.mm: mm, aten.bmm: bmm, aten.baddbmm: baddbmm, aten.matmul: matmul,
    aten.scaled_dot_product_attention: sdpa, aten.embedding: embedding, aten.conv1d: depthwise_conv1d,
    aten.cross_entropy_loss: cross_entropy, aten.logsumexp: logsumexp, aten.einsum: einsum,
    **REDUCE_RULES,
}
VIEW_OPS = {aten.view, aten.reshape, aten._unsafe_view, aten.expand}


def strategies_for(node, ctx: RuleContext):
    """The strategies of one call_function node (always at least the all-Replicate one)."""
    if node.target is operator.getitem:
        return getitem(node, ctx)
    packet = getattr(node.target, "overloadpacket", None)
    tensor_args = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if packet in POINTWISE or (packet in (aten.max, aten.min) and elementwise(node)):
        return pointwise(node, ctx)
    if packet in RULES and len(set(tensor_args)) != len(tensor_args):
        return _replicated(node)  # x @ x: one node in two roles, which per-node placements cannot express
    if packet in RULES:
        return RULES[packet](node, ctx)
    if is_grouped_mm(node):
        return grouped_mm(node, ctx)
    if not node.all_input_nodes or not isinstance(val(node), (torch.Tensor, list, tuple)):
        return [Strategy(R, _ins(node, {}))]  # creation ops (arange, full) and side-effect-only ops
    ctx.unruled.append(node)
    return _replicated(node)
