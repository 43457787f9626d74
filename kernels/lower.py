"""Lower a primitive graph (``kernels/trace.py``) to a ``KernelPlan``: the kernel as data.

Every value lives in the anchor's ``[rows, cols]`` iteration space with one of these kinds:

- ``full``: one element per (row, col), a ``[BLOCK_R, BLOCK_C]`` tile;
- ``row``: one per row (a row reduction's result, a ``[..., 1]`` input), ``[BLOCK_R, 1]``;
- ``col``: one per column (a LayerNorm weight, a bias), ``[1, BLOCK_C]``;
- ``scalar``: a constant of the trace;
- ``colsum``: a reduction over every row (a bias or norm weight's gradient). No kernel instance sees
  every row, so each accumulates its rows' partial sums and stores them; the launcher adds the partials.
  It can only be an output.

Kinds propagate through the ops as Triton's broadcasting does, so the plan never guesses a layout from
a shape. A graph the plan cannot express (a reduction over a middle dim, a view that moves the last
dim) raises ``Unfusable`` with the op, and the fusion pass leaves that group unfused and says why.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from autoshard.kernels import optable
from autoshard.kernels.indexing import row_offset, to_triton

FULL, ROW, COL, SCALAR, COLSUM, ALIAS = "full", "row", "col", "scalar", "colsum", "alias"
ROWFLAT = "rowflat"   # a row reduction without keepdim: per row, but eager broadcasts it along the last dim


class Unfusable(Exception):
    """The group cannot be one kernel; the message names the op and the reason."""


@dataclass(frozen=True)
class KernelInput:
    name: str             # the pointer argument
    dtype: torch.dtype
    kind: str
    offset: str           # Triton expression of ``rows`` and ``cols``
    var: str = ""         # the body variable it is loaded into


@dataclass(frozen=True)
class KernelOutput:
    name: str
    dtype: torch.dtype
    kind: str             # full, row, colsum, or alias (an input returned as it is: no store)
    shape: tuple
    value: str            # the body variable stored
    alias: int | None = None   # for an alias: which graph input
    same_as: int | None = None  # for an alias: which earlier output (two gradients of one value)


@dataclass(frozen=True)
class Statement:
    """``var = expr`` in the kernel body (``var += expr`` with ``accumulate``)."""
    var: str
    expr: str
    reads: tuple = ()          # the variables ``expr`` reads: liveness and the inputs loaded come from these
    accumulate: bool = False   # a colsum: ``var += expr`` across the instance's row blocks
    reduces_rows: bool = False  # a row reduction: the kernel needs the row template (whole rows per tile)


@dataclass(frozen=True)
class KernelPlan:
    """Everything codegen needs; its ``key`` names the generated file."""
    template: str          # "pointwise" (tiles over columns) or "row" (whole rows: it reduces them)
    rows: int
    cols: int
    inputs: tuple
    outputs: tuple
    body: tuple
    wide_index: bool       # offsets reach 2**31: index in int64
    compute: str           # "tl.float32", or "tl.float64" when an input is fp64 (gradcheck)
    used: tuple            # which of the graph's inputs the kernel reads (the others are not passed)

    @property
    def key(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:20]


_JOIN = {frozenset({FULL}): FULL, frozenset({ROW}): ROW, frozenset({COL}): COL, frozenset({ROW, COL}): FULL}


def _join(kinds) -> str:
    ks = frozenset(k for k in kinds if k != SCALAR)
    if COLSUM in ks:
        raise Unfusable("a sum over every row is used inside the kernel (it is only complete after it)")
    if ROWFLAT in ks:
        raise Unfusable("a reduction without keepdim meets another value: eager broadcasts it along the last dim")
    if not ks:
        return SCALAR
    return _JOIN.get(ks, FULL)


def _literal(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float) and not math.isfinite(v):
        return "float('nan')" if math.isnan(v) else ("float('inf')" if v > 0 else "float('-inf')")
    if isinstance(v, (int, float)):
        return repr(v)
    raise Unfusable(f"operand {v!r} is neither a tensor nor a number")


def _input(name, t: torch.Tensor, anchor: tuple, kind_hint: str | None) -> KernelInput:
    """Offsets of an operand in the anchor's iteration space, from its own strides."""
    rows = math.prod(anchor[:-1])
    if t.dim() == 0:
        return KernelInput(name, t.dtype, SCALAR, "0")
    if kind_hint == ROW and tuple(t.shape) == tuple(anchor[:-1]):   # a row value kept without its dim
        sizes, strides, col_stride = list(t.shape), list(t.stride()), 0
    else:
        pad = len(anchor) - t.dim()
        if pad < 0:
            raise Unfusable(f"operand of shape {tuple(t.shape)} has more dims than the anchor {anchor}")
        sizes = [1] * pad + list(t.shape)
        strides = [0] * pad + list(t.stride())
        for d, (s, a) in enumerate(zip(sizes, anchor)):
            if s == 1 and a != 1:
                strides[d] = 0
            elif s != a:
                raise Unfusable(f"operand of shape {tuple(t.shape)} does not broadcast to {anchor}")
        col_stride = strides[-1] if sizes[-1] != 1 else 0
        sizes, strides = sizes[:-1], strides[:-1]
    off = row_offset(anchor[:-1], strides, rows)
    has_rows, has_cols = off != 0, col_stride != 0 or (anchor[-1] == 1)
    kind = FULL if has_rows and has_cols else ROW if has_rows else COL if has_cols else SCALAR
    text = " + ".join(p for p in (to_triton(off) if has_rows else "",
                                  ("cols" if col_stride == 1 else f"cols * {col_stride}") if col_stride else "") if p)
    return KernelInput(name, t.dtype, kind, text or "0")


def _val(node: fx.Node) -> torch.Tensor:
    return node.meta["val"]


def canonical_ids(gm: fx.GraphModule, shared: int) -> dict:
    """A structural id per node: equal ids compute equal values. The first ``shared`` placeholders are
    the group's inputs (the same in its forward and backward graphs); the others are distinct."""
    ids: dict = {}
    for i, n in enumerate(x for x in gm.graph.nodes if x.op == "placeholder"):
        ids[n] = f"in{i}" if i < shared else f"own{i}"
    for n in gm.graph.nodes:
        if n.op == "call_function":
            parts = fx.node.map_arg((n.args, n.kwargs), lambda a: ids[a])
            ids[n] = hashlib.sha1(f"{n.target}|{parts!r}".encode()).hexdigest()[:20]
    return ids


@dataclass(frozen=True)
class Value:
    """A value of the kernel body: ``expr`` names a variable (an input ``x3`` or a statement ``t7``) or,
    with ``var`` False, is a literal. ``missing``: an input its caller did not keep (a live statement
    reading it is an internal error)."""
    expr: str
    kind: str
    boolean: bool = False
    var: bool = True
    missing: bool = False


class _Lowering:
    """One graph's lowering: the values of its nodes and the statements made so far. Each op category
    has its method (``_CATEGORIES``); each statement records the variables it reads."""

    def __init__(self, rows: int, cols: int, compute: str):
        self.rows, self.cols, self.compute = rows, cols, compute
        self.values: dict = {}       # node -> Value
        self.body: list = []
        self._seen: dict = {}        # expression -> variable: the traced backward repeats forward work

    def operand(self, a) -> Value:
        if isinstance(a, fx.Node):
            return self.values[a]
        return Value(_literal(a), SCALAR, isinstance(a, bool), var=False)

    def emit(self, n, expr: str, kind: str, reads, boolean=False, accumulate=False, reduces_rows=False):
        reads = tuple(r.expr for r in reads if r.var)
        if not accumulate and expr in reads:         # a cast or copy that changes nothing: the same variable
            self.values[n] = Value(expr, kind, boolean)
            return
        if not accumulate and expr in self._seen:
            self.values[n] = Value(self._seen[expr], kind, boolean)
            return
        name = f"t{len(self.body)}"
        self.body.append(Statement(name, expr, reads, accumulate, reduces_rows))
        self._seen[expr] = name
        self.values[n] = Value(name, kind, boolean)

    # --- one method per op category ----------------------------------------------------------------
    def power(self, n, target):
        base, exp = self.operand(n.args[0]), n.args[1]
        form = optable.POW_EXPONENTS.get(exp)
        if form is None:
            raise Unfusable(f"pow with exponent {exp} (the table has {sorted(optable.POW_EXPONENTS)})")
        self.emit(n, form.format(base.expr), base.kind, [base])

    def pointwise(self, n, target):
        row = optable.POINTWISE[target]
        ops = [self.operand(a) for a in n.args[:row.arity]]
        if row.expr == "{0}" and ops[0].kind == COLSUM:   # a cast of a bias gradient: the store casts
            self.values[n] = ops[0]
            return
        if target is torch.ops.aten.bitwise_not.default and not ops[0].boolean:
            raise Unfusable("bitwise_not of an integer value (the table has it for bool masks)")
        texts = [o.expr for o in ops]
        alpha = n.kwargs.get("alpha", 1)
        if alpha != 1:                        # add/sub(x, y, alpha=a) is x +- a*y
            texts[1] = f"({texts[1]} * {_literal(alpha)})"
        expr, boolean = row.expr.format(*texts), row.boolean
        if row.expr == "{0}" and isinstance(n.args[0], fx.Node):   # a copy or a cast: convert what changes
            src_dt, dst_dt = _val(n.args[0]).dtype, _val(n).dtype
            if dst_dt == torch.bool and src_dt != torch.bool:
                expr, boolean = f"({expr} != 0)", True
            elif dst_dt.is_floating_point and not src_dt.is_floating_point:
                expr = f"{expr}.to({self.compute})"      # a 1-bit or integer value becomes a number
            elif not dst_dt.is_floating_point and dst_dt != torch.bool and src_dt.is_floating_point:
                expr = f"{expr}.to(tl.int64)"       # truncates toward zero, as torch's cast does
            elif dst_dt == torch.bool:
                boolean = True
        self.emit(n, expr, _join(o.kind for o in ops), ops, boolean)

    def reduction(self, n, target):
        row = optable.REDUCTIONS[target]
        src = self.operand(n.args[0])
        rank = _val(n.args[0]).dim()
        dims = sorted({d % rank for d in (n.args[1] if len(n.args) > 1 and n.args[1] is not None else range(rank))})
        if src.kind != FULL:
            raise Unfusable(f"{target} of a {src.kind} value")
        if _val(n.args[0]).numel() != self.rows * self.cols:
            raise Unfusable(f"{target} of a value broadcast into the [{self.rows}, {self.cols}] space")
        keepdim = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False)
        masked = f"tl.where(mask, {src.expr}, {row.identity})"
        if dims == [rank - 1]:
            self.emit(n, row.finish.format(f"{row.combine}({masked}, axis=1)[:, None]", n=self.cols),
                      ROW if keepdim else ROWFLAT, [src], reduces_rows=True)
        elif dims == list(range(rank - 1)) and row.combine == "tl.sum" and row.finish == "{0}":
            self.emit(n, f"tl.sum({masked}, axis=0)", COLSUM, [src], accumulate=True)
        else:
            raise Unfusable(f"{target} over dims {dims} of a rank-{rank} value: only the last dim, or every "
                            "dim but the last (a bias gradient), reduce in a kernel")

    def view(self, n, target):
        src = self.operand(n.args[0])
        kind = _view_kind(src.kind, tuple(_val(n).shape), self.rows, self.cols, target)
        self.values[n] = dataclasses.replace(src, kind=kind)

    def random(self, n, target):
        seed, shape, p, stream = n.args
        if math.prod(shape) != self.rows * self.cols:
            raise Unfusable(f"a dropout mask of shape {list(shape)} in the [{self.rows}, {self.cols}] space")
        seed = self.operand(seed)
        self.emit(n, optable.RANDOM[target](seed.expr, stream, p).format(n=self.cols), FULL, [seed])

    def constant(self, n, target):
        v = optable.CONSTANTS[target](n.args)
        self.values[n] = self.values[v] if isinstance(v, fx.Node) else \
            Value(_literal(v), SCALAR, isinstance(v, bool), var=False)


# which method lowers an op: its category in kernels/optable.py (pow first: its exponent picks the form)
_CATEGORIES = (
    (lambda t: t is torch.ops.aten.pow.Tensor_Scalar, _Lowering.power),
    (lambda t: t in optable.POINTWISE, _Lowering.pointwise),
    (lambda t: t in optable.REDUCTIONS, _Lowering.reduction),
    (lambda t: t in optable.VIEWS, _Lowering.view),
    (lambda t: t in optable.RANDOM, _Lowering.random),
    (lambda t: t in optable.CONSTANTS, _Lowering.constant),
)


def lower(gm: fx.GraphModule, inputs: list, anchor: tuple, input_kinds: list | None = None,
          reuse: dict | None = None, shared: int = 0) -> KernelPlan:
    """The plan for primitive graph ``gm`` run on ``inputs`` (tensors with the strides it will get).

    ``reuse`` maps canonical ids (``canonical_ids``, the first ``shared`` inputs in common) to indices of
    ``inputs`` past the graph's own: values the caller already holds (a group's forward outputs, for
    its backward). A node that computes one of them reads it instead, so the backward of ``y = x + r;
    layer_norm(y)`` reads ``y`` rather than keeping ``x`` and ``r`` to add them again."""
    anchor = tuple(anchor)
    rows, cols = math.prod(anchor[:-1]), anchor[-1]
    compute = "tl.float64" if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in inputs) \
        else "tl.float32"
    low = _Lowering(rows, cols, compute)
    kinds = input_kinds or [None] * len(inputs)
    ins = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(placeholders):
        if n.users and inputs[i] is None:    # not kept by this caller: only dead statements may read it
            low.values[n] = Value(f"m{i}", FULL, missing=True)
        elif n.users:
            ki = _input(f"in{i}", inputs[i], anchor, kinds[i])
            ins.append(dataclasses.replace(ki, var=f"x{i}"))
            low.values[n] = Value(f"x{i}", ki.kind, inputs[i].dtype == torch.bool)
    held: dict = {}              # canonical id -> the Value of a value the caller passes in
    canon = canonical_ids(gm, shared) if reuse else {}
    for cid, i in (reuse or {}).items():
        if inputs[i] is None:      # not kept by this caller: computed again below
            continue
        ki = _input(f"in{i}", inputs[i], anchor, kinds[i])
        ins.append(dataclasses.replace(ki, var=f"x{i}"))
        held[cid] = Value(f"x{i}", ki.kind, inputs[i].dtype == torch.bool)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if canon.get(n) in held:
            low.values[n] = held[canon[n]]
            continue
        target = _functional(n.target)
        method = next((m for belongs, m in _CATEGORIES if belongs(target)), None)
        if method is None:
            raise Unfusable(f"{target} has no row in kernels/optable.py")
        method(low, n, target)
        if target is not n.target and isinstance(n.args[0], fx.Node):   # x.add_(y): later reads of x see it
            low.values[n.args[0]] = low.values[n]
    outs = _outputs(gm, low.values, placeholders, inputs, rows, cols)
    # only the statements the stores need (a value read from the caller leaves its recomputation dead),
    # and only the inputs those read: an input only handed back is not loaded
    live = {o.value for o in outs if o.kind != ALIAS}
    for st in reversed(low.body):
        if st.var in live:
            live |= set(st.reads)
    body = [st for st in low.body if st.var in live]
    if any(v.missing and v.expr in live for v in low.values.values()):
        raise RuntimeError("internal: a kernel variant needs a value its caller did not keep for backward")
    ins = [x for x in ins if x.var in live]
    used = tuple(int(x.name[2:]) for x in ins)   # may be empty: every output handed back (a no-op)
    reduces_rows = any(st.reduces_rows for st in body)
    if reduces_rows and cols > MAX_ROW:
        raise Unfusable(f"rows of {cols} elements are longer than the row template holds ({MAX_ROW})")
    wide = any(inputs[i].numel() and _max_offset(inputs[i]) >= 2**31 for i in used) \
        or rows * cols >= 2**31
    return KernelPlan("row" if reduces_rows else "pointwise", rows, cols, tuple(ins), tuple(outs),
                      tuple(body), wide, compute, used)


def _outputs(gm, values: dict, placeholders: list, inputs: list, rows: int, cols: int) -> list:
    """The kernel's stores: one per graph output, or an alias where the output is an input handed back
    (a residual add's gradient) or an earlier output (two gradients of one value)."""
    outs = []
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for j, o in enumerate(out_node.args[0]):
        if not isinstance(o, fx.Node):
            raise Unfusable("an output that is not a tensor")
        value = values[o]
        if value.kind == SCALAR:
            raise Unfusable("an output that is a constant")
        v, name = _val(o), value.expr
        kind = _output_kind(value.kind, v.numel(), rows, cols)
        src = next((i for i, p in enumerate(placeholders) if p in values and values[p].expr == name), None)
        if src is not None and inputs[src].dtype == v.dtype and inputs[src].numel() == v.numel():
            # a gradient that passes through unchanged (a residual add's): hand the tensor back, as autograd does
            outs.append(KernelOutput(f"out{j}", v.dtype, ALIAS, tuple(v.shape), name, src))
            continue
        twin = next((k for k, p in enumerate(outs) if p.value == name and p.kind == kind and p.dtype == v.dtype
                     and p.shape == tuple(v.shape) and p.kind != ALIAS), None)
        if twin is not None:   # x + r: both inputs' gradients are one tensor, stored once
            outs.append(KernelOutput(f"out{j}", v.dtype, ALIAS, tuple(v.shape), name, same_as=twin))
            continue
        outs.append(KernelOutput(f"out{j}", v.dtype, kind, tuple(v.shape), name))
    return outs


def _view_kind(kind: str, shape: tuple, rows: int, cols: int, target) -> str:
    """The kind of a view of a value of ``kind``: a view may relabel, never move, the last dim."""
    numel = math.prod(shape)
    if kind == FULL:
        if not shape or shape[-1] != cols or numel != rows * cols:
            raise Unfusable(f"{target} to {shape} moves the last dim of the [{rows}, {cols}] space")
        return FULL
    if kind in (ROW, ROWFLAT):
        if shape and shape[-1] == 1 and numel == rows:
            return ROW                          # [..., 1]: broadcasts along the last dim
        if shape and numel == rows * cols and shape[-1] == cols:
            return ROW                          # an expand of a row value
        if numel == rows and (not shape or shape[-1] != 1):
            return ROWFLAT
    if kind == COL and shape and shape[-1] == cols and numel in (cols, rows * cols):
        return COL
    if kind in (SCALAR, COLSUM):
        return kind
    raise Unfusable(f"{target} to {shape} of a {kind} value in the [{rows}, {cols}] space")


def _output_kind(kind: str, numel: int, rows: int, cols: int) -> str:
    """How an output is stored: a per-row or per-column value stored at full shape is broadcast first."""
    if kind == COLSUM and numel == cols:
        return kind
    if kind in (ROW, ROWFLAT) and numel == rows and cols != 1:
        return ROW
    if kind in (FULL, ROW, COL) and numel == rows * cols:
        return FULL
    raise Unfusable(f"an output of {numel} elements holds a {kind} value of the [{rows}, {cols}] space")


def _functional(target):
    """``aten.add_.Scalar`` -> ``aten.add.Scalar`` when the table has the out-of-place op; else ``target``."""
    packet = getattr(target, "overloadpacket", None)
    if packet is None or not packet.__name__.endswith("_"):
        return target
    pure = getattr(getattr(torch.ops.aten, packet.__name__[:-1], None), target._overloadname, None)
    return pure if pure is not None and optable.supported(pure) else target


MAX_ROW = 32768     # the row template holds a whole row in one tile


def _max_offset(t: torch.Tensor) -> int:
    return sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
