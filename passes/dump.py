"""Pass-debug dumps: a numbered text file per pass and a ``plan.md`` summary.

Written for a person chasing a wrong loss: every node with its placements, local and global shape and
source module; every collective with where it is, what it moves, and how many elements and bytes per
step, as a formula in the model's sizes (b, s, h, V) and as a number. Everything here reads the
program's records and the graph's ``ir.ops`` records; nothing is recomputed.
"""
from __future__ import annotations

import os

import sympy
import torch

from autoshard.ir import meta as M
from autoshard.ir.program import comm_summary
from autoshard.ir.redistribute import volume
from autoshard.passes.cost import symbolize
from autoshard.passes.shapes import shape_of

aten = torch.ops.aten


def _describe(n):
    spec = M.SPEC.get(n, None)
    ls, gs = M.LOCAL_SHAPE.get(n, None), M.GLOBAL_SHAPE.get(n, None) or shape_of(n)
    parts = [] if spec is None else [f"{spec!r}"]
    if ls is not None and gs is not None and tuple(ls) != tuple(gs):
        parts.append(f"local {tuple(ls)} of {tuple(gs)}")
    elif gs is not None:
        parts.append(f"{tuple(gs)}")
    strategy = M.STRATEGY.get(n, None)
    if strategy is not None and strategy.lowering:
        parts.append(strategy.lowering)
    stack = n.meta.get("nn_module_stack") or {}
    if stack:
        parts.append(f"in {next(reversed(stack.values()))[0] or '<top>'}")
    return "  # " + ", ".join(parts) if parts else ""


def format_graph(gm):
    lines = []
    for n in gm.graph.nodes:
        text = n.format_node() or ""
        if n.op == "call_module":
            text += f"   [{gm.get_submodule(n.target).extra_repr()}]"
        lines.append(text + _describe(n))
    return "\n".join(lines) + "\n"


def dump_graph(gm, dump_dir, index, name):
    os.makedirs(dump_dir, exist_ok=True)
    with open(os.path.join(dump_dir, f"{index:02d}_{name}.txt"), "w") as f:
        f.write(f"# after pass {index}: {name}\n")
        f.write(format_graph(gm))


def model_symbols(gm):
    """Name the model's sizes from the captured graph: b, s from the token input, V, h from the embedding."""
    syms = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "overloadpacket", None) is aten.embedding:
            V, h = shape_of(n.args[0])
            idx = shape_of(n.args[1])
            if len(idx) == 2:
                syms[sympy.Symbol("b")], syms[sympy.Symbol("s")] = idx
            syms[sympy.Symbol("V")], syms[sympy.Symbol("h")] = V, h
            break
    order = ["h", "V", "b", "s"]  # when two sizes are equal, prefer the model dims
    return dict(sorted(syms.items(), key=lambda kv: order.index(str(kv[0]))))


def write_plan(program, dump_dir):
    """``plan.md``: collectives, parameter bytes per rank, fallbacks, and how long compiling took."""
    os.makedirs(dump_dir, exist_ok=True)
    symbols, report, mesh = program.symbols, program.report, program.mesh
    axes = ", ".join(f"{a}={mesh.axis_size(a)}" for a in ("dp", "pp", "tp"))
    L = [f"# autoshard plan: mesh {axes}, rank {program.rank} {program.coords}", ""]
    if symbols:
        L.append("Sizes: " + ", ".join(f"{k} = {v}" for k, v in symbols.items()))
        same = [f"{a} = {b}" for i, (a, va) in enumerate(symbols.items()) for b, vb in list(symbols.items())[i + 1:]
                if va == vb]
        if same:
            L.append(f"(Equal sizes {', '.join(same)}: the formulas below cannot tell them apart; the numbers are exact.)")
        L.append("")
    L += ["## Collectives per step (forward + backward)", "",
          "| # | node | from | what | phase | kind | axis | elements | bytes | bytes (number) | ring bytes sent per rank |",
          "|---|------|------|------|-------|------|------|----------|-------|----------------|--------------------------|"]
    for i, c in enumerate(program.collectives, 1):
        el = c.stacked * (sympy.Mul(*symbolize(c.shape, symbols)) if c.shape else sympy.Integer(1))
        nb = el * c.itemsize
        L.append(f"| {i} | {c.node} | {c.source or ''} | {c.what} | {c.phase} | {c.kind} | {c.axis} | "
                 f"`{el}` | `{nb}` | {c.nbytes} | {int(volume(c.kind, c.nbytes, mesh.axis_size(c.axis)))} |")
    calls, nbytes = comm_summary(program.collectives)
    L += ["", "Totals: " + (", ".join(f"{k} {ph} on {ax}: {calls[ax, ph, k]} calls, {nbytes[ax, ph, k]} B"
                                      for ax, ph, k in sorted(calls)) or "none"),
          f"All: {sum(calls.values())} collectives, {sum(nbytes.values())} bytes per step.", ""]
    L += ["## Parameters on this rank", "", "| parameter | placements | local shape | global shape | bytes |",
          "|-----------|------------|-------------|--------------|-------|"]
    for p in program.params:
        L.append(f"| {p.name} | {p.spec!r} | {p.local_shape} | {p.global_shape} | {p.nbytes} |")
    L += ["", f"Parameter bytes on this rank: {sum(p.nbytes for p in program.params)}", ""]
    L += ["## Fallbacks (replicated because no sharding could be proven exact)", ""]
    if report is not None:
        L += [f"- node `{n}` has an op with no sharding rule: runs replicated" for n in report.unruled] or ["- none"]
        L += [f"- weight `{w}` stays replicated: no exact sharded strategy" for w in report.replicated_weights]
        L += ["", "## Compile", "",
              f"ILP on {report.axis}={report.size}: {report.variables} variables, solved in "
              f"{report.solve_seconds:.3f} s, objective {report.objective:.3e} s/step"]
    L += ["Pass timings: " + ", ".join(f"{k} {v:.3f} s" for k, v in program.timings.items()), ""]
    with open(os.path.join(dump_dir, "plan.md"), "w") as f:
        f.write("\n".join(L))
