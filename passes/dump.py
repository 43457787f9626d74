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
from autoshard.ir.placement import Shard
from autoshard.ir.program import comm_summary
from autoshard.ir.redistribute import volume
from autoshard.passes.chunk_loss import CHUNKED_LOSS
from autoshard.passes.cost import symbolize
from autoshard.passes.dump_fusion import chunked_loss_section, fusion_section, write_kernels
from autoshard.passes.shapes import shape_of
from autoshard.passes.walk import upstream

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


def dump_name(index: int, name: str) -> str:
    """A pass's dump file: numbered in pass order (00 is the capture)."""
    return f"{index:02d}_{name}.txt"


def graph_text(gm, index, name) -> str:
    return f"# after pass {index}: {name}\n" + format_graph(gm)


def write_dump(dump_dir, file_name, text):
    os.makedirs(dump_dir, exist_ok=True)
    with open(os.path.join(dump_dir, file_name), "w") as f:
        f.write(text)


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


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _fmt_collectives(records) -> str:
    return ", ".join(f"{c.kind} {c.phase} ({c.what}: {c.numel} elements, {c.nbytes} B)" for c in records)


def _fmt_grouped(records) -> str:
    """Collectives that repeat (one pair per loss chunk) as counts: kind phase (what) x calls, bytes in all."""
    groups: dict = {}
    for c in records:
        calls, nbytes = groups.get((c.kind, c.phase, c.what), (0, 0))
        groups[c.kind, c.phase, c.what] = (calls + 1, nbytes + c.nbytes)
    return ", ".join(f"{kind} {phase} ({what}) x{calls}, {nbytes} B in all"
                     for (kind, phase, what), (calls, nbytes) in groups.items())


def _gathers_feeding(gm, x, by_node):
    """The forward collectives that made ``x`` whole: walk up from ``x`` through views, same-shape pointwise
    ops and collectives without a forward gather, stopping at each collective that gathers or reduces.
    Returns ``([(node, records)], [nodes that computed the value whole themselves])``."""
    from autoshard.ir import ops
    from autoshard.passes.rules import POINTWISE, VIEW_OPS
    found, producers = [], []

    def follow(u):
        fwd = [c for c in by_node.get(u.name, []) if c.phase == "fwd" and c.kind in ("all_gather", "all_reduce")]
        op = gm.get_submodule(u.target) if u.op == "call_module" else None
        packet = getattr(u.target, "overloadpacket", None) if u.op == "call_function" else None
        if isinstance(op, (ops.Redistribute, ops.CopyToParallel, ops.SequenceGather, ops.GatheredReplica)):
            if fwd:
                found.append((u, fwd))
                return ()
            return [u.args[0]]
        if packet in VIEW_OPS or packet is aten.alias:
            return [u.args[0]]
        if packet in POINTWISE:
            shape = M.GLOBAL_SHAPE.get(u, None)
            return [a for a in u.all_input_nodes if M.GLOBAL_SHAPE.get(a, None) == shape]
        producers.append(u)
        return ()
    for _ in upstream([x], follow):
        pass
    return found, producers


def loss_section(program) -> list:
    """``plan.md``'s "Loss" lines: for each cross-entropy and logsumexp of the program, whether it ran
    vocab-parallel (and on which row statistics) or replicated, and then which collectives gathered its
    logits and why; and which outputs are gathered to be returned whole (a loss computed outside the model)."""
    from autoshard.ir import ops
    from autoshard.ir.placement import Shard
    from autoshard.passes.rules_vocab import cross_entropy_args, cross_entropy_blockers, logsumexp
    from autoshard.passes.strategy import RuleContext
    gm, t = program.gm, program.mesh.tp
    by_node = {}
    for c in program.collectives:
        by_node.setdefault(c.node, []).append(c)
    L = ["## Loss", ""]
    for n in gm.graph.nodes:
        op = gm.get_submodule(n.target) if n.op == "call_module" else None
        packet = getattr(n.target, "overloadpacket", None) if n.op == "call_function" else None
        if isinstance(op, ops.VocabParallelCrossEntropy):
            smooth = f", label_smoothing={op.label_smoothing} over V={op.vocab}" if op.label_smoothing else ""
            L.append(f"- `{n.name}` cross_entropy (reduction={_REDUCTIONS.get(op.reduction, op.reduction)}, "
                     f"ignore_index={op.ignore_index}{smooth}): **vocab-parallel**, the logits `{n.args[0].name}` "
                     f"stay sharded by vocab, never gathered. Collectives: {_fmt_collectives(by_node.get(n.name, []))}")
        elif isinstance(op, ops.VocabParallelLinearCrossEntropy):
            smooth = f", label_smoothing={op.label_smoothing} over V={op.vocab}" if op.label_smoothing else ""
            where = "**vocab-parallel**, " if op.size > 1 else ""
            if op.epilogue:   # a scale or soft cap of the logits, applied per chunk
                smooth += f", logits through {op.epilogue_text}"
            L.append(f"- `{n.name}` LM head + cross_entropy (reduction={_REDUCTIONS.get(op.reduction, op.reduction)}, "
                     f"ignore_index={op.ignore_index}{smooth}): {where}chunked, {op.chunks} chunks of {op.chunk} "
                     f"rows, the logits never whole (see Chunked loss). Collectives: "
                     f"{_fmt_grouped(by_node.get(n.name, [])) if op.size > 1 else 'none'}")
        elif isinstance(op, ops.VocabParallelLogsumexp):
            L.append(f"- `{n.name}` logsumexp over dims {list(op.dims)}: **vocab-parallel**, `{n.args[0].name}` "
                     f"stays sharded on dim {op.dim}, never gathered. Collectives: "
                     f"{_fmt_collectives(by_node.get(n.name, []))}")
        elif packet in (aten.cross_entropy_loss, aten.logsumexp):
            what = "cross_entropy" if packet is aten.cross_entropy_loss else "logsumexp"
            s = M.STRATEGY.get(n, None)
            sharded = [p for p in (s.ins if s else ()) if isinstance(p, Shard)]
            if sharded:
                L.append(f"- `{n.name}` {what}: sharded on a dim it does not reduce ({sharded[0]!r}): runs on the "
                         f"local shard, no collective")
                continue
            if packet is aten.cross_entropy_loss:
                a = cross_entropy_args(n)
                what += (f" (reduction={_REDUCTIONS.get(a['reduction'], a['reduction'])}, ignore_index="
                         f"{a['ignore_index']}, label_smoothing={a['label_smoothing']})")
                blockers = cross_entropy_blockers(n, t) if t > 1 else ["tp=1"]
            elif t == 1:
                blockers = ["tp=1"]
            else:  # the rule on this node (its input is whole here, so its shapes are the global ones)
                offered = logsumexp(n, RuleContext(program.mesh))
                blockers = [] if any(o.lowering for o in offered) else ["no reduced dim can be sharded"]
            why = (f"the vocab-parallel lowering does not apply ({'; '.join(blockers)})" if blockers
                   else "the planner priced it below the vocab-parallel lowering")
            found, producers = _gathers_feeding(gm, n.args[0], by_node)
            whole = [f"`{u.name}` gathers `{recs[0].source}`: {_fmt_collectives(recs)}" for u, recs in found]
            whole += [f"`{u.name}` computes them whole on every rank" for u in producers]
            L.append(f"- `{n.name}` {what}: **replicated**, because {why}. Its input is whole on every rank: "
                     + ("; ".join(whole) or "nothing to gather") + ".")
    if len(L) == 2:
        L.append("- no cross_entropy or logsumexp in the graph")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for u in dict.fromkeys(a for a in torch.utils._pytree.tree_leaves(out.args) if isinstance(a, torch.fx.Node)):
        recs = [c for c in by_node.get(u.name, []) if c.phase == "fwd" and c.kind in ("all_gather", "all_reduce")]
        if recs and (M.GLOBAL_SHAPE.get(u, None) or ()):
            L.append(f"- returned `{recs[0].source}` {tuple(M.GLOBAL_SHAPE.get(u))} is made whole by `{u.name}`: "
                     f"{_fmt_collectives(recs)}; a loss computed from it outside the model sees the exact full tensor")
    return L + [""]


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
    # the layout is the plan's (blocks, equal or not); whether DTensor can describe even blocks is this
    # torch's answer, asked by the runtime when it wraps the shards (runtime/params.py:strided_shards_work)
    unequal = [p.name for p in program.params if isinstance(p.spec.tp, Shard) and p.spec.tp.unequal]
    blocked = [p.name for p in program.params if isinstance(p.spec.tp, Shard) and not p.spec.tp.unequal
               and p.spec.tp.blocks > 1]
    if unequal:
        L += ["Held in rank order (blocks of unequal size, which no DTensor placement describes): take these whole "
              "from `pm.state_dict()` or `pm.full_state_dict()`, not `full_tensor()`: "
              + ", ".join(f"`{n}`" for n in unequal), ""]
    if blocked:
        L += ["Blocked shards (each rank holds a slice of every block): shown to DTensor as `_StridedShard` where "
              "this torch reads it as the plan does, else held in rank order like the above: "
              + ", ".join(f"`{n}`" for n in blocked), ""]
    if report is not None and report.attention:
        L += ["## Attention", ""] + [f"- {a}" for a in report.attention] + [""]
    L += loss_section(program)
    if program.captured.functionalized:
        L += ["## Writes into views", "", "Made pure at capture (torch's functionalization: `slice_scatter` / "
              "`select_scatter` into a new buffer) so that sharding and stage cuts see them as data: "
              + ", ".join(f"`{m}`" for m in program.captured.functionalized), ""]
    L += ["## Fallbacks (replicated because no sharding could be proven exact)", ""]
    if report is not None:
        L += [f"- {n} has no sharding rule: runs replicated (exact; its inputs are made whole)"
              for n in report.unruled] or ["- none"]
        L += [f"- weight `{w}` stays replicated: no exact sharded strategy" for w in report.replicated_weights]
        L += ["", "## Compile", "",
              f"ILP on {report.axis}={report.size}: {report.variables} variables, solved in "
              f"{report.solve_seconds:.3f} s, objective {report.objective:.3e} s/step"]
    L += ["Pass timings: " + ", ".join(f"{k} {v:.3f} s" for k, v in program.timings.items()), ""]
    L += chunked_loss_section(program.gm.meta.get(CHUNKED_LOSS))
    recompute = program.gm.meta.get(M.RECOMPUTE_PLAN)
    if recompute is not None:
        L += recompute.lines()
    fusion = program.gm.meta.get(M.FUSION_REPORT)
    L += fusion_section(fusion)
    write_kernels(fusion, dump_dir)
    with open(os.path.join(dump_dir, "plan.md"), "w") as f:
        f.write("\n".join(L))
