"""Trace a fusion group, and its vector-Jacobian product, down to the primitive ops of ``optable``.

The forward is ``make_fx`` over the group's own nodes; the backward is ``make_fx`` over
``torch.func.vjp`` of the same nodes, so autograd's derivative formulas (not a hand-written
backward per pattern) give the backward graph, and the backward re-runs the forward's cheap pointwise
work instead of saving it: a group's backward reads only the group's inputs and its output gradients.
Both traces run on meta tensors: nothing is computed.

torch's decompositions lower composite ops to primitives. Two are replaced: torch's ``native_layer_norm``
lowers to ``prims.var`` (a one-pass variance the table has no row for), so ours is the two-pass
mean/centred-sum form, which is also what the row template computes best. ``functionalize`` removes the
in-place ops some decompositions emit (``rms_norm``'s ``add_``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._decomp import decomposition_table
from torch.fx.experimental.proxy_tensor import make_fx

from autoshard.kernels import optable

aten = torch.ops.aten


def _layer_norm(x, normalized_shape, weight, bias, eps):
    if len(normalized_shape) != 1:
        return NotImplemented
    n = x.shape[-1]
    mean = aten.sum.dim_IntList(x, [-1], True) / n
    xc = x - mean
    rstd = aten.rsqrt.default(aten.sum.dim_IntList(xc * xc, [-1], True) / n + eps)
    y = xc * rstd
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y, mean, rstd


def _in_place(op) -> bool:
    packet = getattr(op, "overloadpacket", None)
    return packet is not None and packet.__name__.endswith("_")


def decompositions() -> dict:
    """torch's decompositions for every op the table lacks, with our layer norm."""
    # in-place ops are left to functionalize (their decompositions write back with copy_)
    table = {op: fn for op, fn in decomposition_table.items()
             if not optable.supported(op) and not _in_place(op)}
    table[aten.native_layer_norm.default] = _layer_norm
    return table


@dataclass
class GroupTrace:
    """A group as primitive graphs. ``backward`` takes ``(*inputs, *output_grads)`` and returns one
    gradient per entry of ``grad_inputs`` (indices into the inputs: the floating-point ones)."""
    forward: fx.GraphModule
    backward: fx.GraphModule | None
    grad_inputs: tuple


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def trace_group(fn, inputs: list, backward: bool = True, grad_inputs: tuple | None = None) -> GroupTrace:
    """``fn(*inputs)`` returns a tuple of tensors; ``inputs`` are tensors (meta or real) or scalars.

    ``grad_inputs`` are the inputs that need a gradient (default: every floating-point one). Leaving out
    the ones that carry none (a rotary table, a mask) keeps their reductions out of the backward."""
    metas = [_meta(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    dec = decompositions()
    fwd = make_fx(torch.func.functionalize(fn, remove="mutations"), decomposition_table=dec)(*metas)
    _clean(fwd)
    if not backward:
        return GroupTrace(fwd, None, ())
    diff = _differentiable(metas) if grad_inputs is None else tuple(grad_inputs)
    if not diff:
        return GroupTrace(fwd, None, ())
    with torch.no_grad():
        outs = fn(*metas)
    grads = [_meta(o) for o in outs]
    bwd = make_fx(torch.func.functionalize(_vjp(fn, len(metas), diff), remove="mutations"),
                  decomposition_table=dec)(*metas, *grads)
    return GroupTrace(fwd, _clean(bwd), diff)


def eager_backward_graph(fn, inputs: list) -> fx.GraphModule:
    """The backward as eager autograd runs it (``native_layer_norm_backward``, ``gelu_backward``...), not
    decomposed: what the fusion report counts as the unfused backward's traffic."""
    metas = [_meta(x) for x in inputs]
    with torch.no_grad():
        outs = fn(*metas)
    return _clean(make_fx(_vjp(fn, len(metas), _differentiable(metas)))(*metas, *[_meta(o) for o in outs]))


def _differentiable(metas) -> tuple:
    return tuple(i for i, x in enumerate(metas) if isinstance(x, torch.Tensor) and x.is_floating_point())


def _vjp(fn, n_inputs: int, diff: tuple):
    """``(*inputs, *output_grads) -> gradients of the inputs in diff``, through ``torch.func.vjp``."""
    def vjp(*args):
        ins, grads = list(args[:n_inputs]), args[n_inputs:]

        def of_diff(*xs):
            full = list(ins)
            for i, x in zip(diff, xs):
                full[i] = x
            return tuple(fn(*full))

        _, pullback = torch.func.vjp(of_diff, *[ins[i] for i in diff])
        return tuple(pullback(tuple(grads)))
    return vjp


def _clean(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop what the outputs do not need (the traced backward re-runs the whole forward)."""
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
