"""Index algebra: where element ``(row, col)`` of the ``[rows, cols]`` iteration space lives in an operand.

A kernel walks the anchor shape ``(*lead, cols)`` flattened to ``[rows, cols]``. An operand with its own
strides (a broadcast bias has stride 0 on every leading dim, a transposed input odd ones) is at offset
``sum_d ((row // P_d) % D_d) * s_d + col * s_c``. The expression is built in sympy, which folds the
constants and drops what is zero; adjacent dims that are contiguous with each other are merged first,
so a contiguous operand reads ``row * cols + col`` and a bias reads ``col``. Shapes are static (the
compiled program's), so every size and stride is a number in the generated source.
"""
from __future__ import annotations

import sympy
from sympy.printing.str import StrPrinter


class FloorDiv(sympy.Function):
    """``a // b`` on non-negative integers, kept unevaluated so it prints as Triton integer division."""
    nargs = 2
    is_integer = True
    is_nonnegative = True


class Mod(sympy.Function):
    """``a % b`` on non-negative integers (sympy's own Mod rewrites floor expressions in ways Triton
    cannot print)."""
    nargs = 2
    is_integer = True
    is_nonnegative = True


class _TritonPrinter(StrPrinter):
    def _print_FloorDiv(self, e):
        return f"({self._print(e.args[0])} // {self._print(e.args[1])})"

    def _print_Mod(self, e):
        return f"({self._print(e.args[0])} % {self._print(e.args[1])})"


ROW = sympy.Symbol("rows", integer=True, nonnegative=True)


def merge_dims(sizes, strides) -> tuple:
    """Drop size-1 and broadcast (stride 0) dims and merge neighbours ``d, d+1`` when ``s_d = s_{d+1} D_{d+1}``.

    Returns (sizes, strides, divisors): dim ``d`` of the result is ``(row // divisors[d]) % sizes[d]``.
    """
    divisors, prod = [], 1
    for size in reversed(sizes):
        divisors.append(prod)
        prod *= size
    divisors.reverse()
    dims = [(sz, st, dv) for sz, st, dv in zip(sizes, strides, divisors) if sz != 1 and st != 0]
    merged: list = []
    for sz, st, dv in dims:
        if merged:
            psz, pst, pdv = merged[-1]
            if pst == st * sz and pdv == dv * sz:
                merged[-1] = (psz * sz, st, dv)
                continue
        merged.append((sz, st, dv))
    return merged


def row_offset(lead_sizes, lead_strides, rows: int) -> sympy.Expr:
    """Offset of ``row`` in an operand whose leading dims (broadcast to the anchor's) have these strides."""
    expr = sympy.Integer(0)
    for size, stride, div in merge_dims(lead_sizes, lead_strides):
        idx = ROW if div == 1 else FloorDiv(ROW, div)
        if size * div < rows:          # the outermost dim needs no modulo: row < rows
            idx = Mod(idx, size)
        expr += idx * stride
    return expr


def to_triton(expr: sympy.Expr) -> str:
    return _TritonPrinter().doprint(expr)
