"""Pass-debug dumps: a numbered text file per pass and a ``plan.md`` summary.

Written for a person chasing a wrong loss: every node with its placement, local and global shape; every
collective with where it is, what it moves, and how many elements and bytes per step, as a formula in
the model's sizes (b, s, h, V) and as a number.
"""
from __future__ import annotations

import os
from collections import Counter

import sympy
import torch

from autoshard.passes.cost import FWD, BWD, numel, symbolize, transition, volume
from autoshard.passes.shapes import shape_of, val

aten = torch.ops.aten


def _describe(n):
    pl = n.meta.get("placement")
    ls, gs = n.meta.get("local_shape"), n.meta.get("global_shape") or shape_of(n)
    parts = []
    if pl is not None:
        parts.append(f"{pl!r}")
    if ls is not None and gs is not None and tuple(ls) != tuple(gs):
        parts.append(f"local {tuple(ls)} of {tuple(gs)}")
    elif gs is not None:
        parts.append(f"{tuple(gs)}")
    if n.meta.get("tp_strategy") is not None and n.meta["tp_strategy"].lowering:
        parts.append(n.meta["tp_strategy"].lowering)
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


def collectives(gm):
    """Every collective the local program runs per step: dicts of node, kind, phase, shape, itemsize."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_module":
            continue
        mod = gm.get_submodule(n.target)
        kind = type(mod).__name__
        src_val = n.args[0].meta.get("val") if n.args else None
        isz = src_val.element_size() if isinstance(src_val, torch.Tensor) else 4
        if kind == "Redistribute":
            for phase, k in transition(mod.src, mod.dst, n.meta.get("requires_grad", True), mod.shape,
                                       mod.comm.size):
                out.append(dict(node=n.name, source=n.meta.get("source"), kind=k, phase=phase,
                                shape=mod.shape, itemsize=isz, what=f"{mod.src!r} -> {mod.dst!r}"))
        elif kind in ("CopyToTP", "ColumnParallelMatmul"):
            what = "f (gradient of a replicated input)" + (", overlapped with dW" if kind != "CopyToTP" else "")
            out.append(dict(node=n.name, source=n.meta.get("source"), kind="all_reduce", phase=BWD,
                            shape=mod.shape, itemsize=isz, what=what))
        elif kind == "VocabParallelCrossEntropy":
            N = (n.args[1].meta.get("local_shape") or [1])[0]
            out.append(dict(node=n.name, source=None, kind="all_reduce", phase=FWD, shape=(N,), itemsize=4,
                            what="loss: row max"))
            out.append(dict(node=n.name, source=None, kind="all_reduce", phase=FWD, shape=(N,), itemsize=4,
                            factor=2, what="loss: sum of exps and target logit (stacked)"))
    return out


def comm_summary(colls):
    calls, nbytes = Counter(), Counter()
    for c in colls:
        calls[c["phase"], c["kind"]] += 1
        nbytes[c["phase"], c["kind"]] += c.get("factor", 1) * numel(c["shape"]) * c["itemsize"]
    return calls, nbytes


def write_plan(gm, dump_dir, *, t, rank, symbols, info, timings, params):
    """``plan.md``: collectives, parameter bytes per rank, fallbacks, and how long planning took."""
    os.makedirs(dump_dir, exist_ok=True)
    colls = collectives(gm)
    subs = {k: v for k, v in symbols.items()}
    L = [f"# autoshard plan — tp={t}, rank {rank}", ""]
    if symbols:
        L.append("Sizes: " + ", ".join(f"{k} = {v}" for k, v in symbols.items()) + "")
        same = [f"{a} = {b}" for i, (a, va) in enumerate(symbols.items()) for b, vb in list(symbols.items())[i + 1:]
                if va == vb]
        if same:
            L.append(f"(Equal sizes {', '.join(same)}: the formulas below cannot tell them apart; the numbers are exact.)")
        L.append("")
    L += ["## Collectives per step (forward + backward)", "",
          "| # | node | from | what | phase | kind | axis | elements | bytes | bytes (number) | ring bytes sent per rank |",
          "|---|------|------|------|-------|------|------|----------|-------|----------------|--------------------------|"]
    for i, c in enumerate(colls, 1):
        el = c.get("factor", 1) * (sympy.Mul(*symbolize(c["shape"], subs)) if c["shape"] else sympy.Integer(1))
        nb = el * c["itemsize"]
        n_num = int(nb.subs(subs))
        L.append(f"| {i} | {c['node']} | {c['source'] or ''} | {c['what']} | {c['phase']} | {c['kind']} | tp | "
                 f"`{el}` | `{nb}` | {n_num} | {int(volume(c['kind'], n_num, t))} |")
    calls, nbytes = comm_summary(colls)
    L += ["", "Totals: " + (", ".join(f"{k} {ph}: {calls[ph, k]} calls, {nbytes[ph, k]} B"
                                      for ph, k in sorted(calls)) or "none"),
          f"All: {sum(calls.values())} collectives, {sum(nbytes.values())} bytes per step.", ""]
    L += ["## Parameters on this rank", "", "| parameter | placement | local shape | global shape | bytes |",
          "|-----------|-----------|-------------|--------------|-------|"]
    total = 0
    for name, pl, lshape, gshape, isz in params:
        b = numel(lshape) * isz
        total += b
        L.append(f"| {name} | {pl!r} | {tuple(lshape)} | {tuple(gshape)} | {b} |")
    L += ["", f"Parameter bytes on this rank: {total}", ""]
    L += ["## Fallbacks (replicated because no sharding could be proven exact)", ""]
    L += [f"- op `{n.target}` at `{n.name}` has no sharding rule: runs replicated" for n in info.unruled] or ["- none"]
    L += [f"- weight `{w}` stays replicated: no exact sharded strategy" for w in info.replicated_weights]
    L += ["", "## Compile", "",
          f"ILP: {info.variables} variables, solved in {info.solve_seconds:.3f} s, objective {info.objective:.3e} s/step",
          "Pass timings: " + ", ".join(f"{k} {v:.3f} s" for k, v in timings.items()), ""]
    with open(os.path.join(dump_dir, "plan.md"), "w") as f:
        f.write("\n".join(L))
    return colls
