"""The one table the code generator reads: each supported primitive ATen op and its Triton expression.

A fusion group is traced down to these ops (``kernels/trace.py`` decomposes everything else with torch's
own decompositions), and ``kernels/lower.py`` turns each node into one line of the kernel body from its
row here. Adding an op is adding a row: the partitioner asks the table whether a traced group is made of
known ops, so a composite op whose decomposition lands on rows here (``silu``, ``gelu``, ``layer_norm``,
``rms_norm``, ``softmax``) fuses without any code of its own.

Every expression computes in fp32 (loads are upcast, ``kernels/codegen.py`` casts at the store), so the
formulas need no dtype cases. ``tanh`` and ``sigmoid`` are written with ``exp`` because Triton's math
library has no portable ``tanh`` (libdevice is CUDA-only and the interpreter has none).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.kernels.rng import dropout_expr

aten, prims = torch.ops.aten, torch.ops.prims


@dataclass(frozen=True)
class PointwiseRow:
    """``expr`` formats the operands' Triton expressions (``{0}``, ``{1}``...) into the result's."""
    expr: str
    arity: int                  # tensor-or-scalar operands read from args[0..arity-1]
    boolean: bool = False       # the result is a predicate (stays int1, is not upcast)


@dataclass(frozen=True)
class ReductionRow:
    """A reduction over dims: ``combine`` is Triton's reduction, ``identity`` what masked lanes hold, and
    ``finish`` formats the reduced value (``{0}``) and the reduced element count (``{n}``)."""
    combine: str
    identity: str
    finish: str = "{0}"


_SIGMOID = "(1.0 / (1.0 + tl.exp(-({0}))))"
_TANH = "(1.0 - 2.0 / (tl.exp(2.0 * ({0})) + 1.0))"

POINTWISE: dict = {
    aten.add.Tensor: PointwiseRow("({0} + {1})", 2),
    aten.add.Scalar: PointwiseRow("({0} + {1})", 2),
    aten.sub.Tensor: PointwiseRow("({0} - {1})", 2),
    aten.sub.Scalar: PointwiseRow("({0} - {1})", 2),
    aten.rsub.Scalar: PointwiseRow("({1} - {0})", 2),
    aten.mul.Tensor: PointwiseRow("({0} * {1})", 2),
    aten.mul.Scalar: PointwiseRow("({0} * {1})", 2),
    aten.div.Tensor: PointwiseRow("({0} / {1})", 2),
    aten.div.Scalar: PointwiseRow("({0} / {1})", 2),
    # NaN propagates, as in torch (Triton's default drops it on a GPU)
    aten.maximum.default: PointwiseRow("tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)", 2),
    aten.minimum.default: PointwiseRow("tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)", 2),
    aten.neg.default: PointwiseRow("(-({0}))", 1),
    aten.abs.default: PointwiseRow("tl.abs({0})", 1),
    aten.reciprocal.default: PointwiseRow("(1.0 / ({0}))", 1),
    aten.exp.default: PointwiseRow("tl.exp({0})", 1),
    aten.log.default: PointwiseRow("tl.log({0})", 1),
    aten.sqrt.default: PointwiseRow("tl.sqrt({0})", 1),
    aten.rsqrt.default: PointwiseRow("(1.0 / tl.sqrt({0}))", 1),
    aten.erf.default: PointwiseRow("tl.math.erf({0})", 1),
    aten.tanh.default: PointwiseRow(_TANH, 1),
    aten.sigmoid.default: PointwiseRow(_SIGMOID, 1),
    aten.relu.default: PointwiseRow("tl.where({0} < 0, 0.0, {0})", 1),     # relu(NaN) is NaN
    aten.where.self: PointwiseRow("tl.where({0}, {1}, {2})", 3),
    aten.gt.Scalar: PointwiseRow("({0} > {1})", 2, boolean=True),
    aten.gt.Tensor: PointwiseRow("({0} > {1})", 2, boolean=True),
    aten.ge.Scalar: PointwiseRow("({0} >= {1})", 2, boolean=True),
    aten.ge.Tensor: PointwiseRow("({0} >= {1})", 2, boolean=True),
    aten.lt.Scalar: PointwiseRow("({0} < {1})", 2, boolean=True),
    aten.lt.Tensor: PointwiseRow("({0} < {1})", 2, boolean=True),
    aten.le.Scalar: PointwiseRow("({0} <= {1})", 2, boolean=True),
    aten.le.Tensor: PointwiseRow("({0} <= {1})", 2, boolean=True),
    aten.eq.Scalar: PointwiseRow("({0} == {1})", 2, boolean=True),
    aten.eq.Tensor: PointwiseRow("({0} == {1})", 2, boolean=True),
    aten.ne.Scalar: PointwiseRow("({0} != {1})", 2, boolean=True),
    aten.ne.Tensor: PointwiseRow("({0} != {1})", 2, boolean=True),
    aten.logical_not.default: PointwiseRow("({0} == 0)", 1, boolean=True),
    aten.logical_and.default: PointwiseRow("(({0} != 0) & ({1} != 0))", 2, boolean=True),
    aten.bitwise_not.default: PointwiseRow("({0} == 0)", 1, boolean=True),   # on bool masks only
    # copies and casts: fp32 math already, the store casts to the output's dtype
    aten.clone.default: PointwiseRow("{0}", 1),
    aten.alias.default: PointwiseRow("{0}", 1),
    aten.detach.default: PointwiseRow("{0}", 1),
    aten._to_copy.default: PointwiseRow("{0}", 1),
    prims.convert_element_type.default: PointwiseRow("{0}", 1),
    # the prims a few decompositions (rms_norm's) leave behind
    prims.add.default: PointwiseRow("({0} + {1})", 2),
    prims.sub.default: PointwiseRow("({0} - {1})", 2),
    prims.mul.default: PointwiseRow("({0} * {1})", 2),
    prims.div.default: PointwiseRow("({0} / {1})", 2),
    prims.neg.default: PointwiseRow("(-({0}))", 1),
    prims.exp.default: PointwiseRow("tl.exp({0})", 1),
    prims.rsqrt.default: PointwiseRow("(1.0 / tl.sqrt({0}))", 1),
    prims.sqrt.default: PointwiseRow("tl.sqrt({0})", 1),
    prims.where.default: PointwiseRow("tl.where({0}, {1}, {2})", 3),
}

# pow with a small integer or half exponent: exact products, no exp/log round trip
POW_EXPONENTS = {0.5: "tl.sqrt({0})", -0.5: "(1.0 / tl.sqrt({0}))", 1: "{0}", 2: "({0} * {0})",
                 3: "({0} * {0} * {0})", -1: "(1.0 / ({0}))", -2: "(1.0 / ({0} * {0}))"}

REDUCTIONS: dict = {
    aten.sum.dim_IntList: ReductionRow("tl.sum", "0.0"),
    aten.mean.dim: ReductionRow("tl.sum", "0.0", "({0} / {n})"),
    aten.amax.default: ReductionRow("tl.max", "float('-inf')"),
    aten.amin.default: ReductionRow("tl.min", "float('inf')"),
}

# ops that only relabel a value's shape (the value keeps its place in the [rows, cols] iteration space)
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
         prims.broadcast_in_dim.default}

# creation of a constant (a 0-d tensor, or a tensor filled with one value): the value, from the node's args
CONSTANTS = {
    aten.scalar_tensor.default: lambda args: args[0],
    aten.lift_fresh_copy.default: lambda args: args[0],
    aten.full.default: lambda args: args[1],
    aten.full_like.default: lambda args: args[1],
    aten.zeros_like.default: lambda args: 0.0,
    aten.ones_like.default: lambda args: 1.0,
    # uninitialised memory: decompositions fill it (full_like) before reading it
    aten.empty_permuted.default: lambda args: 0.0,
    aten.empty_like.default: lambda args: 0.0,
    aten.empty.memory_format: lambda args: 0.0,
}


# a dropout mask recomputable from (seed, stream, element index): kernels/rng.py
RANDOM = {torch.ops.autoshard.dropout_keep.default: dropout_expr}


def supported(target) -> bool:
    """Whether the code generator can emit ``target`` (a primitive, after decomposition)."""
    return (target in POINTWISE or target in REDUCTIONS or target in VIEWS or target in CONSTANTS
            or target in RANDOM or target is aten.pow.Tensor_Scalar)
