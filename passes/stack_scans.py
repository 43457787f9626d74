"""Stack scans: a buffer filled one position at a time becomes one ``cat`` of what was written.

Capture functionalizes a scan's writes into views (``functionalize.py``): RecurrentGemma's RG-LRU
``out[:, t] = h_t``, a delta rule's ``out[:, :, i] = o_i``. Each write is then a ``select_scatter`` (or
``slice_scatter``) that copies the whole buffer to change one position: exact, but ``steps`` copies of
the buffer where eager wrote in place.

When the scatters form a chain (each buffer version read by nothing but the next scatter), all along
one dim, and their positions cover that dim exactly once, no intermediate version can be observed and
the first buffer's values are all overwritten. The last version is then exactly the written parts side
by side: ``cat`` of the parts (a ``select`` part gets its dim back with ``unsqueeze``), which the rules
shard on every other dim. A first buffer that may carry a gradient stays, under one ``slice_scatter`` of
the ``cat``: one copy instead of one per step. Runs after ``canonicalize``, which turned each functional ``copy`` into the
part itself, and after dropping the views that only fed those copies' shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autoshard.passes.canonicalize import _emit, written_as
from autoshard.passes.shapes import shape_of, slice_bounds

aten = torch.ops.aten
SCATTERS = (aten.select_scatter.default, aten.slice_scatter.default)
# Buffers made from nothing that carries a gradient: overwritten whole, they are dropped for the cat. Any
# other first buffer (a learned initial state broadcast and cloned) stays under one slice_scatter, so
# what made it gets zeros, as eager gives it, rather than no gradient.
FRESH = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.empty.memory_format,
         aten.empty_like.default, aten.new_empty.default, aten.full.default, aten.full_like.default,
         aten.new_full.default, aten.ones_like.default, aten.new_ones.default}


@dataclass(frozen=True)
class Write:
    """One scatter of the chain: ``part`` written at ``[start, end)`` along the chain's dim."""
    scatter: fx.Node
    start: int
    end: int

    @property
    def part(self) -> fx.Node:
        return self.scatter.args[1]


def _write(n: fx.Node) -> tuple[int, Write] | None:
    """``(dim, Write)`` of scatter ``n``, or None for a strided slice."""
    size = shape_of(n)
    if n.target is aten.select_scatter.default:
        dim, index = n.args[2] % len(size), n.args[3]
        index = index + size[dim] if index < 0 else index
        return dim, Write(n, index, index + 1)
    bounds = slice_bounds(size, *(list(n.args) + [0, None, None, 1][len(n.args) - 2:])[2:6])
    if bounds is None:
        return None
    dim, start, end = bounds
    return dim, Write(n, start, end)


def _chain(first: fx.Node) -> tuple[int, list[Write]] | None:
    """The scatters from ``first`` on, each the only reader of the one before, along one dim; None when
    their positions do not tile that dim exactly (a gap, an overlap, or another reader of a version)."""
    found = _write(first)
    if found is None:
        return None
    dim, writes, n = found[0], [found[1]], first
    while len(n.users) == 1:
        (u,) = n.users
        if u.target not in SCATTERS or u.args[0] is not n:
            break
        nxt = _write(u)
        if nxt is None or nxt[0] != dim:
            return None
        writes.append(nxt[1])
        n = u
    edge = 0
    for w in sorted(writes, key=lambda w: w.start):
        if w.start != edge or w.end <= w.start:
            return None
        edge = w.end
    return (dim, writes) if edge == shape_of(first)[dim] else None


def _part(g: fx.Graph, w: Write, dim: int, dtype) -> fx.Node:
    """The written part as the buffer holds it: with the selected dim back, in the buffer's dtype."""
    part = w.part
    if w.scatter.target is aten.select_scatter.default:
        part = _emit(g, aten.unsqueeze.default, (part, dim), w.scatter)
    return written_as(g, part, shape_of(part), dtype, w.scatter)


def stack_scans_pass(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    g = gm.graph
    if not any(n.target in SCATTERS for n in g.nodes):
        return gm
    g.eliminate_dead_code()        # the views that fed only the functional copies' shapes
    erased = set()
    for n in list(g.nodes):
        if n in erased or n.target not in SCATTERS:
            continue
        base = n.args[0]
        if isinstance(base, fx.Node) and base.target in SCATTERS and len(base.users) == 1:
            continue               # not the first of its chain
        found = _chain(n)
        if found is None or len(found[1]) < 2:
            continue
        dim, writes = found
        last = writes[-1].scatter
        with g.inserting_before(last):
            parts = [_part(g, w, dim, last.meta["val"].dtype) for w in sorted(writes, key=lambda w: w.start)]
            whole = _emit(g, aten.cat.default, (parts, dim), last)
            if n.args[0].target not in FRESH:    # a base with a history: its gradient is zeros, not None
                whole = _emit(g, aten.slice_scatter.default, (n.args[0], whole, dim), last)
        last.replace_all_uses_with(whole)
        for w in reversed(writes):
            g.erase_node(w.scatter)
            erased.add(w.scatter)
    g.eliminate_dead_code()        # the first buffer, now unread
    g.lint()
    gm.recompile()
    return gm
