"""Fill-by-slices: a fresh buffer written slice by slice becomes one ``cat``.

Some models assemble a tensor by allocating it and copying parts into slices of it. DeepSeek's
multi-head latent attention (V2, V3) builds its keys so::

    key = kv.new_empty(b, h, s, d_nope + d_rope)
    key[..., :d_nope].copy_(k_nope)
    key[..., d_nope:].copy_(k_rot)      # k_rot broadcast over the heads

The in-place writes go through views of the buffer. Sharding moves a view and its base through
different collectives, so such writes must become values before planning. Capture's functionalization
(``functionalize.py``) would make each a ``slice_scatter`` into the buffer. But when the slices are
disjoint, cover the buffer along one dimension, and nothing reads the buffer before the last write, the buffer *is* the concatenation of what was copied in (each part
broadcast to its slice's shape and cast to the buffer's dtype, as ``copy_`` does). That ``cat`` is pure,
and the sharding rules know it, with no scatter into an empty buffer; capture leaves these writes to this
pass. Any other write into a slice is functionalized at capture.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autoshard.passes.canonicalize import _emit, written_as
from autoshard.passes.shapes import shape_of, slice_bounds, writes_in_place

aten = torch.ops.aten

ALLOCATIONS = {aten.empty.memory_format, aten.new_empty.default, aten.empty_like.default,
               aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default}


@dataclass(frozen=True)
class SliceWrite:
    """``buffer[start:end along dim].copy_(source)``: one part of the assembled buffer."""
    view: fx.Node
    write: fx.Node
    start: int
    end: int

    @property
    def source(self) -> fx.Node:
        return self.write.args[1]


def _slice_write(buffer: fx.Node, view: fx.Node) -> tuple[int, SliceWrite] | None:
    """The write through ``view``, if ``view`` is a unit-step slice of ``buffer`` whose only use is a
    ``copy_`` into it; with the slice's dimension."""
    if view.target is not aten.slice.Tensor or view.args[0] is not buffer or len(view.users) != 1:
        return None
    write = next(iter(view.users))
    if write.target is not aten.copy_.default or write.args[0] is not view or len(write.users) != 0:
        return None
    bounds = slice_bounds(shape_of(buffer), *(list(view.args) + [0, None, None, 1][len(view.args) - 1:])[1:5])
    if bounds is None:
        return None
    dim, start, end = bounds
    return dim, SliceWrite(view, write, start, end)


def _assembly(buffer: fx.Node, nodes: list, order: dict) -> tuple[int, list[SliceWrite], list[fx.Node]] | None:
    """The slice writes that fill ``buffer`` exactly along one dimension, and the buffer's readers, all
    after the last write, with nothing else written in place from the first write to the last; None when
    ``buffer`` is used any other way."""
    writes, readers, dims = [], [], set()
    for u in buffer.users:
        found = _slice_write(buffer, u)
        if found is None:
            readers.append(u)
        else:
            dims.add(found[0])
            writes.append(found[1])
    if not writes or len(dims) != 1:
        return None
    dim = dims.pop()
    writes.sort(key=lambda w: w.start)
    edge = 0
    for w in writes:
        if w.start != edge or w.end <= w.start:
            return None   # a gap or an overlap: the buffer is not simply the parts side by side
        edge = w.end
    if edge != shape_of(buffer)[dim]:
        return None
    first, last = min(order[w.write] for w in writes), max(order[w.write] for w in writes)
    if any(order[r] < last for r in readers):
        return None   # something reads the buffer half-written
    ours = {w.write for w in writes}
    if any(writes_in_place(n) and n not in ours for n in nodes[first:last + 1]):
        return None   # a source may change between its copy and the cat, which reads it after the last copy
    return dim, writes, readers


def _part(g: fx.Graph, w: SliceWrite, buffer: fx.Node) -> fx.Node:
    """The source as the slice holds it: broadcast to the slice's shape, in the buffer's dtype."""
    return written_as(g, w.source, shape_of(w.view), buffer.meta["val"].dtype, w.write)


def fill_slices_pass(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    g = gm.graph
    for buffer in [n for n in g.nodes if n.op == "call_function" and n.target in ALLOCATIONS]:
        nodes = list(g.nodes)                  # afresh: an earlier rewrite added nodes (a buffer within a buffer)
        order = {n: i for i, n in enumerate(nodes)}
        found = _assembly(buffer, nodes, order)
        if found is None:
            continue
        dim, writes, readers = found
        last = max((w.write for w in writes), key=order.__getitem__)
        with g.inserting_before(last.next):   # after the last write, parts before their cat
            parts = [_part(g, w, buffer) for w in writes]
            whole = _emit(g, aten.cat.default, (parts, dim), buffer)
        for r in readers:
            r.replace_input_with(buffer, whole)
        for w in writes:
            g.erase_node(w.write)
            g.erase_node(w.view)
        g.erase_node(buffer)
    g.lint()
    gm.recompile()
    return gm
