"""The fusion part of the dump: a table per group in ``plan.md`` and every kernel's source beside it.

Read from the ``FusionReport`` the ``fuse`` pass leaves in ``gm.meta`` (one source of truth: the dump
never re-derives a group).
"""
from __future__ import annotations

import os

from autoshard.ir.fusion import FusionReport


def _kb(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def fusion_section(report: FusionReport | None) -> list:
    if report is None:
        return []
    L = ["## Fusion", "", f"{report.why}."]
    if not report.enabled:
        return L + [""]
    L += [f"{len(report.groups)} groups, {report.kernel_count} generated kernels (sources in `kernels/`).", "",
          "| group | ops fused | space | bytes fwd (eager -> fused) | bytes bwd (eager -> fused) | saved for backward | kernels |",
          "|---|---|---|---|---|---|---|"]
    for g in report.groups:
        ops = ", ".join(o.removeprefix("aten.").removesuffix(".default") for o in g.ops)
        saved = ", ".join(g.saved) or "nothing"
        kernels = ", ".join(f"`{k.name}.py` ({k.template})" for k in g.kernels)
        bwd = f"{_kb(g.eager_backward_bytes)} -> {_kb(g.fused_backward_bytes)}" if g.eager_backward_bytes else "no backward"
        L.append(f"| {g.name} | {ops} | {list(g.anchor)} | {_kb(g.eager_bytes)} -> {_kb(g.fused_bytes)} | {bwd} | "
                 f"{saved} | {kernels} |")
    eager = sum(g.eager_bytes + g.eager_backward_bytes for g in report.groups)
    fused = sum(g.fused_bytes + g.fused_backward_bytes for g in report.groups)
    if eager:
        L += ["", f"Traffic of the fused ops per step, forward + backward: {_kb(eager)} eager, {_kb(fused)} fused "
                  f"({fused / eager:.2f}x). The backward recomputes each group's pointwise work from what it saves."]
    if report.unfused:
        L += ["", "Left to eager ops:", ""] + [f"- {', '.join(u.nodes)}: {u.reason}" for u in report.unfused]
    return L + [""]


def chunked_loss_section(report) -> list:
    """``plan.md``'s record of the chunk_loss pass (``passes/chunk_loss.py``)."""
    if report is None or not report.losses:
        return []
    L = ["## Chunked loss", ""]
    for r in report.losses:
        if r.rewritten:
            chunks = -(-r.rows // r.chunk)
            L.append(f"- `{r.node}`: the LM head and cross-entropy over {r.rows} rows run as {chunks} chunks of "
                     f"{r.chunk} rows; the fp32 logits held at once are {_kb(r.chunk_bytes)} instead of "
                     f"{_kb(r.logits_bytes)} ([{r.rows}, {r.local_vocab}] on this rank)")
        else:
            L.append(f"- `{r.node}` not chunked: {r.why}")
    return L + [""]


def write_kernels(report: FusionReport | None, dump_dir: str) -> None:
    """Every generated kernel's source under ``dump_dir/kernels/``."""
    if report is None or not report.groups:
        return
    out = os.path.join(dump_dir, "kernels")
    os.makedirs(out, exist_ok=True)
    for g in report.groups:
        for k in g.kernels:
            with open(os.path.join(out, f"{k.name}.py"), "w") as f:
                f.write(k.source)
