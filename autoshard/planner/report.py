"""The planner's answer for a person: the ranked table, ``plan.md`` for the winner, and a plot.

The plot (SVG, no plotting library needed) puts every configuration that fits on one axis of predicted
model TFLOP/s per GPU, grouped by (tp, pp), with the winner marked: where the good region is and how
far the runner-ups are is easier to see than to read.
"""
from __future__ import annotations

import html

from autoshard.planner.search import GiB, Plan, Plans, usable_bytes


def table(plans: Plans) -> str:
    """The ranked plans as a markdown table (the winner first), then the faster ones that do not fit."""
    rows = ["| # | dp | pp | tp | SP | b | m | v | schedule | recompute | ZeRO | step s | TFLOP/s/GPU | GiB/GPU | why |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(plans.ranked, 1):
        rows.append(_row(str(i), p))
    if plans.too_big:
        rows += ["", "Faster, but out of memory:", "",
                 "| | dp | pp | tp | SP | b | m | v | schedule | recompute | ZeRO | step s | TFLOP/s/GPU | GiB/GPU | why |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        rows += [_row("-", p) for p in plans.too_big]
    if plans.fewer is not None and plans.ranked:
        rows += ["", "Note: " + plans.fewer.says(plans.gpus, plans.best.step_seconds) + "."]
    return "\n".join(rows)


def _row(rank: str, p: Plan) -> str:
    return (f"| {rank} | {p.dp} | {p.pp} | {p.tp} | {'regathered' if p.sp == 'regather' else 'yes' if p.sp else 'no'} | {p.b} | {p.m} | {p.v} | {p.schedule} | {p.recompute} | {p.zero} | "
            f"{p.step_seconds:.4g} | {p.tflops_per_gpu:.1f} | {p.memory_bytes / GiB:.1f} | {p.why} |")


def plan_md(plans: Plans) -> str:
    """``plan.md`` for the winner: the configuration, its step breakdown and memory, the alternatives."""
    best = plans.best
    q = best.prediction
    shape, cluster = plans.shape, plans.cluster
    lines = [f"# Plan: {shape.name} on {plans.gpus} GPUs of {cluster.name}", "",
             f"Model: {shape.layers} layers, hidden {shape.hidden}, {_attention(shape)}, "
             f"{_mlp(shape)}{_layers(shape)}; vocabulary {shape.vocab}, sequence {shape.seq}; "
             f"{shape.params() / 1e9:.2f} B parameters. Global batch {plans.global_batch} sequences.", "",
             f"Cluster: {cluster.gpus_per_node} GPUs a node, {cluster.peak_flops / 1e12:.0f} TFLOP/s peak, "
             f"{cluster.hbm_bytes / 1e9:.0f} GB at {cluster.hbm_bandwidth / 1e12:.2f} TB/s; inside a node "
             f"{cluster.intra.bandwidth / 1e9:.0f} GB/s, between nodes {cluster.inter.bandwidth / 1e9:.0f} GB/s "
             f"per GPU. Source: {cluster.source or '-'}", "",
             _runtime_line(plans.runtime), "",
             "## The winner", "",
             f"`{best.label()}` ({best.schedule} schedule): `init_mesh(plan=p)` and `parallelize(..., plan=p)` "
             f"set `{best.mesh}` and `{best.parallelize_options()}`.", "",
             f"Predicted step {best.step_seconds:.3f} s, {best.tflops_per_gpu:.1f} model TFLOP/s per GPU "
             f"({best.tflops_per_gpu * 1e12 / cluster.peak_flops:.0%} of peak)."
             + (f" {plans.fewer.says(plans.gpus, best.step_seconds)}." if plans.fewer else ""), "",
             "| part of the step | seconds | share |", "|---|---|---|"]
    lines += [f"| {name} | {s:.4f} | {s / q.step_seconds:.1%} |" for name, s in q.breakdown.items()]
    mem = q.memory
    lines += ["", "| memory per GPU | GiB |", "|---|---|",
              f"| parameters (bf16) | {mem.parameters / GiB:.2f} |", f"| gradients (fp32) | {mem.gradients / GiB:.2f} |",
              f"| optimizer (fp32 master, Adam moments{', ZeRO-1' if best.zero else ''}) | {mem.optimizer / GiB:.2f} |",
              f"| activations in flight | {mem.activations / GiB:.2f} |",
              f"| total ({'memory_limit' if plans.limit < usable_bytes(cluster) else 'usable'} {plans.limit / GiB:.1f}) | "
              f"{mem.total / GiB:.2f} |",
              "", "## The alternatives", "", table(plans), "",
              f"{plans.considered} configurations priced in {plans.seconds:.2f} s.", ""]
    return "\n".join(lines)


def _runtime_line(runtime) -> str:
    """What the plans were priced for: autoshard's runtime, or another one's (the configuration to hand
    to that runtime: ``parallelize`` runs autoshard's, whose step the prediction does not describe)."""
    what = [name for name, on in (("the dp reduction beside backward", runtime.dp_overlap),
                                  ("ZeRO-1 as a reduce-scatter", runtime.sharded_grads),
                                  ("the parameter gather beside the next forward", runtime.param_gather_overlap),
                                  ("tp collectives under their GEMMs (with SP)", runtime.tp_overlap),
                                  ("interleaved pipeline sends beside compute", runtime.p2p_overlap)) if on]
    overlaps = ", ".join(what) or "no overlap"
    grads = f"gradients cross the dp links in {runtime.grad_bytes * 8}-bit"
    if runtime.name == "autoshard":
        return f"Runtime: autoshard's ({overlaps}; {grads})."
    return (f"Runtime: priced for `{runtime.name}` ({overlaps}; {grads}): a configuration to hand to that runtime. "
            "autoshard's own `parallelize` runs the same mesh with its own overlaps, at another step time.")


def plot_svg(plans: Plans, width: int = 900, height: int = 420) -> str:
    """Predicted model TFLOP/s per GPU of every configuration priced, one column per (tp, pp), the winner
    in red, out-of-memory ones hollow."""
    fastest = {}          # one point per (tp, pp, v, recompute, fits): its fastest b and ZeRO setting
    for p in plans.priced:
        key = (p.tp, p.pp, p.v, p.recompute, p.sp, p.fits)
        if key not in fastest or p.step_seconds < fastest[key].step_seconds:
            fastest[key] = p
    points = list(fastest.values()) + list(plans.ranked[:1])
    groups = sorted({(p.tp, p.pp) for p in points})
    top = max((p.tflops_per_gpu for p in points), default=1.0) * 1.1 or 1.0
    left, bottom, right, up = 60, 60, 20, 30
    w, h = width - left - right, height - bottom - up
    col = w / max(len(groups), 1)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="18" font-size="13">{html.escape(plans.shape.name)} on {plans.gpus} GPUs of '
           f'{html.escape(plans.cluster.name)}: predicted model TFLOP/s per GPU by (tp, pp)</text>',
           f'<line x1="{left}" y1="{up + h}" x2="{left + w}" y2="{up + h}" stroke="black"/>',
           f'<line x1="{left}" y1="{up}" x2="{left}" y2="{up + h}" stroke="black"/>']
    for k in range(5):
        v = top * k / 4
        y = up + h - h * k / 4
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.0f}</text>')
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + w}" y2="{y:.1f}" stroke="#ddd"/>')
    for i, (t, pp) in enumerate(groups):
        x = left + col * (i + 0.5)
        out.append(f'<text x="{x:.1f}" y="{up + h + 16}" text-anchor="middle">{t},{pp}</text>')
    out.append(f'<text x="{left + w / 2}" y="{height - 14}" text-anchor="middle">(tp, pp)</text>')
    best = plans.ranked[0] if plans.ranked else None
    for p in points:
        x = left + col * (groups.index((p.tp, p.pp)) + 0.5)
        y = up + h - h * p.tflops_per_gpu / top
        if best is not None and p.prediction is best.prediction:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="6" fill="#d62728"><title>{html.escape(p.label())}</title></circle>')
        elif p.fits:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="#1f77b4" fill-opacity="0.6"/>')
        else:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="none" stroke="#888"/>')
    out.append("</svg>")
    return "\n".join(out)


def _attention(shape) -> str:
    if shape.kv_lora_rank:
        q = f"q rank {shape.q_lora_rank}, " if shape.q_lora_rank else ""
        return (f"{shape.heads} heads of multi-head latent attention ({q}kv rank {shape.kv_lora_rank}, "
                f"q/k head {shape.head_dim}, v head {shape.value_head_dim})")
    return f"{shape.heads} heads ({shape.kv_heads} kv)"


def _layers(shape) -> str:
    """A hybrid's layout: which layers run the other mixer, which softmax attention, which no MLP."""
    if shape.mixer is None:
        return ""
    every = tuple(range(shape.layers))
    mixer = _spans(shape.mixer_layers or every)
    attention = ("no layer" if not shape.attention else
                 _spans(tuple(i for i in every if i not in set(shape.attention_free_layers))))
    free = f"; no MLP on layers {_spans(shape.mlp_free_layers)}" if shape.mlp_free_layers else ""
    return f"; a {shape.mixer.name} on layers {mixer}, softmax attention on {attention}{free}"


def _mlp(shape) -> str:
    gated = " (gated)" if shape.gated else ""
    if shape.experts == 1:
        return f"MLP {shape.ffn}{gated}"
    shared = f" + shared {shape.shared_ffn}" if shape.shared_ffn else ""
    dense = (f"; layers {_spans(shape.dense_layers)} a dense MLP {shape.dense_ffn}" if shape.dense_layers else "")
    return f"MoE MLP: {shape.experts} experts of {shape.ffn}{gated}, top-{shape.experts_per_token}{shared}{dense}"


def _spans(indices) -> str:
    """``0-2, 5, 7`` for (0, 1, 2, 5, 7)."""
    out, run = [], []
    for i in indices:
        if run and i != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)
