"""The planner against published large-scale runs: what it picks, and what it predicts for theirs.

    python -m benchmarks.planner [--out benchmarks/results]

Each row is a published training configuration with its measured throughput (sources below, and in
``benchmarks/results/planner.md``). Per row: the configuration ``autoshard.plan`` picks for the same
model, GPUs and global batch; the published (t, p, d); the TFLOP/s per GPU the planner predicts for the
published (t, p, d) (with its best microbatch and virtual stages, the published recompute) against the
published figure; and, where the picks differ, the cost that decides it. TFLOP/s are counted as each
source counts them: Megatron-LM's formula includes the recomputed forward ("hardware"), the Llama 3
paper's MFU does not ("model").
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from typing import NamedTuple

from autoshard.planner import DGX_A100, DGX_H100, ModelShape, Runtime, candidates, plan, predict
from autoshard.planner.runtimes import (DEEPSPEED_PIPELINE, LLAMA3, MEGATRON_BF16, MEGATRON_CORE,
                                        MEGATRON_CORE_OVERLAPPED, MEGATRON_FP16)
from autoshard.planner.shape import BUILTIN

OUT = os.path.join(os.path.dirname(__file__), "results")


# The runtimes that measured the published runs (``autoshard/planner/runtimes.py`` says what each does).
# Korthikanti et al. do not name their dtype: MEGATRON_BF16, the costlier reduction, is assumed (their table
# rows have d = 1, so it matters only for the abstract's d = 8). A row that names no runtime is priced as
# MEGATRON_CORE.


@dataclass(frozen=True)
class Published:
    name: str
    shape: ModelShape
    cluster: object
    gpus: int
    global_batch: int
    tp: int
    pp: int
    tflops: float          # per GPU, as the source counts them
    counts: str            # "hardware": recompute counted (Megatron's formula); "model": not (MFU)
    recompute: str         # what the run did
    source: str
    flash: bool = False    # 2021-22 runs kept the attention matrix (no FlashAttention)
    sp: bool = False       # sequence parallelism (Megatron's, since 2022; assumed for the Llama 3 runs, whose
                           # paper lists TP, CP, PP and FSDP-style DP: 8K-token activations need it to fit)
    note: str = ""         # what the row assumes, or why its figure is not the planner's kind of runtime
    runtime: str = "megatron"   # the runtime that measured it: the planner prices Megatron's kind
    priced_as: Runtime = MEGATRON_CORE   # what that runtime does that the planner prices
    zero: int | None = None     # the published ZeRO setting where the source gives it (else the planner's best)


SC21 = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, "
        "SC'21, Table 1 (A100 80GB, Selene)")
SC21_ROWS = [("gpt-1.7b", 1, 1, 32, 512, 137), ("gpt-3.6b", 2, 1, 64, 512, 138), ("gpt-7.5b", 4, 1, 128, 512, 142),
             ("gpt-18b", 8, 1, 256, 1024, 135), ("gpt-39b", 8, 2, 512, 1536, 138), ("gpt-76b", 8, 4, 1024, 1792, 140),
             ("gpt-145b", 8, 8, 1536, 2304, 148), ("gpt-310b", 8, 16, 1920, 2160, 155),
             ("gpt-530b", 8, 35, 2520, 2520, 163), ("gpt-1t", 8, 64, 3072, 3072, 163)]

KORTHIKANTI = ("Korthikanti et al., Reducing Activation Recomputation in Large Transformer Models (MLSys 2023, "
               "arXiv 2205.05198), abstract: the 530B GPT on 2,240 A100s at 54.2% MFU with sequence parallelism and "
               "selective recompute, 42.1% with full recompute (MFU of 312 TFLOP/s)")
KORTHIKANTI_BATCH = ("the abstract gives neither (t, p) nor the batch: (t, p, d) = (8, 35, 8) is assumed, as MT-NLG's "
                     "run on 2,240 GPUs and SC'21's 530B row; the batch 2,240 is assumed, a multiple of p that the interleaved schedule needs (1,920 is not; 2,520 predicts "
                     "within 1% of 2,240)")

KORTHIKANTI_TABLES = ("Korthikanti et al. (arXiv 2205.05198), the configuration and end-to-end iteration-time tables: "
                      "GPT models of 22B (t, p) = (8, 1), 175B (8, 8), 530B (8, 35) and 1T (8, 64) on t x p A100s "
                      "(d = 1), a global batch of 4, 64, 280 and 512, sequence 2048; sequence parallelism with selective "
                      "recompute at 41.5%, 51.4%, 56.0% and 56.3% MFU (1.10, 13.75, 37.83 and 71.49 s an iteration), "
                      "full recompute at 1.42, 18.13, 49.05 and 94.42 s")
KORTHIKANTI_ROWS = [("22B", BUILTIN["gpt-22b"], 8, 1, 4, 0.415, 1.10, 1.42),
                    ("175B", BUILTIN["gpt-175b"], 8, 8, 64, 0.514, 13.75, 18.13),
                    ("530B", BUILTIN["gpt-530b"], 8, 35, 280, 0.560, 37.83, 49.05),
                    ("1T", BUILTIN["gpt-1t"], 8, 64, 512, 0.563, 71.49, 94.42)]

MCORE = ("NVIDIA Megatron-LM README (Megatron Core r0.8.0), the weak-scaling table (images/model_table.png): GPT "
         "models of 1.7B to 462B on 48 to 6,144 H100s, d = 48, vocabulary 131,072, sequence 4,096, per-GPU "
         "TFLOP/s and MFU (of 989), with --overlap-grad-reduce, --overlap-param-gather and --tp-comm-overlap")
MCORE_NOTE = ("the table gives neither the microbatch nor the recompute nor the schedule: none, the planner's best "
              "b and v, and SP wherever t > 1 (--tp-comm-overlap needs it) are assumed; a 4h MLP, "
              "untied embeddings and flash attention, which the parameter counts and the README's "
              "Transformer Engine imply")
MCORE_DP = 48


class McoreRow(NamedTuple):
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    global_batch: int
    tflops: float            # model TFLOP/s per GPU


MCORE_ROWS = [McoreRow("1.7B", 16, 2048, 24, 1, 1, 192, 408.8), McoreRow("7.1B", 32, 4096, 30, 2, 1, 192, 465.9),
              McoreRow("16B", 48, 6144, 32, 4, 1, 192, 489.1), McoreRow("32B", 56, 7168, 48, 8, 1, 192, 459.6),
              McoreRow("70B", 64, 8192, 84, 8, 2, 384, 419.7), McoreRow("119B", 80, 10240, 92, 8, 4, 768, 420.5),
              McoreRow("177B", 96, 12288, 96, 8, 6, 1152, 432.8), McoreRow("314B", 128, 16384, 96, 8, 8, 1536, 474.4),
              McoreRow("462B", 144, 18432, 112, 8, 16, 3072, 459.9)]
MCORE_STRONG = ("as above, the strong-scaling figure (images/strong_scaling.png): the 177B model on 96 to 4,608 "
                "H100s at a global batch of 1,152, MFU 47% at the smallest and 42% at the largest (the README's text)")
MCORE_STRONG_NOTE = ("the figure names no (t, p): (8, 6) is assumed, the weak-scaling table's for this model, "
                     "which every GPU count of the figure (96, 144, 288, ..., 4,608) is a multiple of: d = 2 and 96")


def _mcore_shape(row: McoreRow) -> ModelShape:
    return ModelShape(f"mcore-{row.name}", row.layers, row.hidden, row.heads, row.heads, 4 * row.hidden, 131072, 4096,
                      tied=False)


def _mcore(name: str, row: McoreRow, dp: int, tflops: float, source: str, note: str) -> Published:
    """A Megatron Core row: its distributed optimizer is ZeRO-1 (zero=1), --tp-comm-overlap needs SP."""
    return Published(name, _mcore_shape(row), DGX_H100, row.tp * row.pp * dp, row.global_batch, row.tp, row.pp,
                     tflops, "model", "none", source, flash=True, sp=row.tp > 1, note=note,
                     priced_as=MEGATRON_CORE_OVERLAPPED, zero=1)


def _mcore_table() -> list:
    weak = [_mcore(f"Megatron Core {row.name}", row, MCORE_DP, row.tflops, MCORE, MCORE_NOTE if i == 0 else "")
            for i, row in enumerate(MCORE_ROWS)]
    # the strong-scaling figure's ends: its model at the table's (t, p), MFU of the H100's peak
    row = next(r for r in MCORE_ROWS if r.name == "177B")
    strong = [_mcore(f"Megatron Core {row.name} on {row.tp * row.pp * dp}", row, dp, mfu * DGX_H100.peak_flops / 1e12,
                     MCORE_STRONG, MCORE_STRONG_NOTE if i == 0 else "")
              for i, (dp, mfu) in enumerate(((2, 0.47), (96, 0.42)))]
    return weak + strong


def _korthikanti_table() -> list:
    """Two rows a model: SP + selective at the published MFU, full recompute at the same model FLOPs over its
    longer iteration (MFU x t_selective / t_full)."""
    rows = []
    for name, shape, t, p, batch, mfu, selective_s, full_s in KORTHIKANTI_ROWS:
        rows.append(Published(f"Korthikanti {name}, SP + selective", shape, DGX_A100, t * p, batch, t, p, 312 * mfu,
                              "model", "selective", KORTHIKANTI_TABLES, sp=True, priced_as=MEGATRON_BF16))
        rows.append(Published(f"Korthikanti {name}, full recompute", shape, DGX_A100, t * p, batch, t, p,
                              312 * mfu * selective_s / full_s, "model", "full", KORTHIKANTI_TABLES,
                              priced_as=MEGATRON_BF16))
    return rows


ROWS = [Published(f"SC'21 {n}", BUILTIN[n], DGX_A100, g, B, t, p, tf, "hardware", "full", SC21, priced_as=MEGATRON_FP16)
        for n, t, p, g, B, tf in SC21_ROWS] + [
    Published("BLOOM-176B", ModelShape("bloom-176b", 70, 14336, 112, 112, 4 * 14336, 250880, 2048),
              DGX_A100, 384, 2048, 4, 12, 156, "hardware", "full",
              "BigScience, BLOOM: A 176B-Parameter Open-Access Multilingual Language Model (arXiv 2211.05100), "
              "section 3.4: 384 A100 80GB, TP=4, PP=12, DP=8, ZeRO-1, 156 TFLOP/s per GPU",
              priced_as=DEEPSPEED_PIPELINE, note="Megatron-DeepSpeed: Megatron's layers and tp, DeepSpeed's pipeline "
              "engine and ZeRO-1; counted with the Megatron-measured rows (its kernels and tp are Megatron's)"),
    Published("MT-NLG 530B (280 nodes)", BUILTIN["gpt-530b"], DGX_A100, 2240, 1920, 8, 35, 126, "hardware", "full",
              "Smith et al., Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B (arXiv 2201.11990), "
              "section 2.4: 280 DGX A100 nodes, TP=8, PP=35, batch 1920, 126 TFLOP/s per GPU", runtime="deepspeed",
              priced_as=DEEPSPEED_PIPELINE,
              note="DeepSpeed's pipeline engine (1F1B, not interleaved) drove Megatron's layers. Megatron's own "
                   "runtime, on the same model, 2,240 A100s and (t, p), full recompute, is reported at 42.1% MFU "
                   "(Korthikanti et al., the rows below): 175 hardware TFLOP/s, 39% over this run's 126. The "
                   "planner prices Megatron's kind of runtime, so it lands between the two"),
    Published("MT-NLG 530B (420 nodes)", BUILTIN["gpt-530b"], DGX_A100, 3360, 1920, 8, 35, 113, "hardware", "full",
              "as above: 420 nodes, 113 TFLOP/s per GPU", runtime="deepspeed", priced_as=DEEPSPEED_PIPELINE),
    Published("Korthikanti 530B, SP + selective", BUILTIN["gpt-530b"], DGX_A100, 2240, 2240, 8, 35, 0.542 * 312,
              "model", "selective", KORTHIKANTI, sp=True, note=KORTHIKANTI_BATCH, priced_as=MEGATRON_BF16),
    Published("Korthikanti 530B, full recompute", BUILTIN["gpt-530b"], DGX_A100, 2240, 2240, 8, 35, 0.421 * 312,
              "model", "full", "as above: 42.1% MFU with full recompute", note=KORTHIKANTI_BATCH,
              priced_as=MEGATRON_BF16),
    Published("Llama 3 405B (8K GPUs)", ModelShape("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192,
                                                  gated=True, tied=False),
              DGX_H100, 8192, 2048, 8, 16, 430, "model", "none",
              "Llama Team, The Llama 3 Herd of Models (arXiv 2407.21783), Table 4: 8,192 H100, TP=8, CP=1, PP=16, "
              "DP=64, 16M tokens a batch, 430 TFLOP/s per GPU (43% BF16 MFU)", flash=True, sp=True,
              priced_as=LLAMA3),
    Published("Llama 3 405B (16K GPUs)", ModelShape("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192,
                                                   gated=True, tied=False),
              DGX_H100, 16384, 2048, 8, 16, 400, "model", "none",
              "as above: 16,384 H100, DP=128, 400 TFLOP/s per GPU (41% MFU)", flash=True, sp=True, priced_as=LLAMA3),
] + _korthikanti_table() + _mcore_table()


def _rate(q, counts: str) -> float:
    return q.hardware_tflops_per_gpu if counts == "hardware" else q.tflops_per_gpu


def theirs(row: Published):
    """The planner's prediction for the published (t, p, d): its best b, v and ZeRO that fit, with the
    published recompute (and ZeRO, where the row gives it; None if no candidate is left)."""
    d = row.gpus // (row.tp * row.pp)
    limit = row.cluster.hbm_bytes * row.cluster.usable_memory
    preds = [predict(row.shape, row.cluster, c, row.flash, row.priced_as) for c in candidates(row.shape, row.gpus, row.global_batch)
             if (c.tp, c.pp, c.dp, c.recompute) == (row.tp, row.pp, d, row.recompute) and bool(c.sp) == row.sp
             and row.zero in (None, c.zero)
             and not c.zb]           # the published runs predate zero-bubble schedules; Megatron's SP is either
                                     # of autoshard's (it keeps the shard and gathers it again in backward)
    fitting = [q for q in preds if q.memory.total <= limit]
    return min(fitting or preds, key=lambda q: q.step_seconds) if preds else None, bool(fitting)


def _differ(mine, other) -> str:
    """The costs that separate the planner's pick from the published configuration."""
    a, b = dict(mine.breakdown.items()), dict(other.breakdown.items())
    diffs = sorted(((b[k] - a[k], k) for k in a), reverse=True)
    gain = ", ".join(f"{k} {d:+.2f} s" for d, k in diffs[:2] if d > 0)
    return f"the published one pays {gain} more a step" if gain else "-"


def run() -> list:
    out = []
    for row in ROWS:
        start = time.perf_counter()
        # planned for the runtime that measured the row, so that the pick and the published configuration
        # differ by the plan alone
        plans = plan(row.shape, row.gpus, row.cluster, row.global_batch, flash=row.flash, runtime=row.priced_as)
        seconds = time.perf_counter() - start
        best = plans.best
        q, fits = theirs(row)
        predicted = _rate(q, row.counts) if q is not None else float("nan")
        mine = best.prediction
        same = (best.tp, best.pp) == (row.tp, row.pp)
        out.append(dict(name=row.name, gpus=row.gpus, batch=row.global_batch, published=(row.tp, row.pp, row.gpus // (row.tp * row.pp)),
                        published_tflops=row.tflops, counts=row.counts, predicted=predicted,
                        error=predicted / row.tflops - 1, fits=fits,
                        theirs=f"b={q.candidate.b} v={q.candidate.v} zero={q.candidate.zero}" if q else "-",
                        pick=(best.tp, best.pp, best.dp), pick_label=best.label(),
                        pick_vs=mine.step_seconds / q.step_seconds - 1 if q is not None else float("nan"),
                        same=same, why="-" if same or q is None else _differ(mine, q),
                        seconds=seconds, source=row.source, note=row.note, runtime=row.runtime))
    return out


def markdown(rows: list) -> str:
    lines = ["# The planner against published runs", "",
             "`python -m benchmarks.planner`. TFLOP/s per GPU as each source counts them (hardware: Megatron-LM's "
             "formula, the recomputed forward included; model: MFU's numerator). *Predicted* is the planner's "
             "figure for the published (t, p, d), with its best microbatch, virtual stages and ZeRO setting and the "
             "published recompute, and the overlaps of the runtime that measured it (`Published.priced_as`: "
             "Megatron-LM's of 2021-22 and DeepSpeed's pipeline engine reduce after the last backward, SC'21's fp16 "
             "runs in fp16; Megatron Core r0.8 reduce-scatters beside backward, gathers beside the next forward and "
             "pipelines its tp collectives under the GEMMs); *pick* is what `autoshard.plan(..., runtime=)` "
             "chooses for the same model, GPUs and batch and that runtime's costs (its schedules include autoshard's "
             "ZB-H1, which the published runs predate).", "",
             "*Pick's step* is its predicted step time against the published configuration's (negative: predicted "
             "faster); *why* names the costs the published configuration pays more of.", "",
             "| run | GPUs | batch | published (t, p, d) | published TFLOP/s | predicted | error | pick | pick's step | why the picks differ | plan s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fits = "" if r["fits"] else " (predicted out of memory)"
        lines.append(f"| {r['name']} | {r['gpus']} | {r['batch']} | {r['published']} | {r['published_tflops']:.0f} "
                     f"({r['counts']}) | {r['predicted']:.1f}{fits} ({r['theirs']}) | {r['error']:+.1%} | "
                     f"{r['pick_label']}{' (same t, p)' if r['same'] else ''} | {r['pick_vs']:+.1%} | {r['why']} | {r['seconds']:.2f} |")
    errors = [abs(r["error"]) for r in rows if r["error"] == r["error"]]
    own = [abs(r["error"]) for r in rows if r["error"] == r["error"] and r["runtime"] == "megatron"]
    lines += ["", f"Worst error {max(errors):.1%}, mean {sum(errors) / len(errors):.1%} over {len(errors)} runs; "
              f"over the {len(own)} that Megatron-LM's runtime measured (the kind the planner prices), worst "
              f"{max(own):.1%}, mean {sum(own) / len(own):.1%}. {sum(r['same'] for r in rows)} of {len(rows)} "
              "picks are the published (t, p).", "", "## Sources", ""]
    seen = []
    for r in rows:
        if r["source"] not in seen:
            seen.append(r["source"])
            lines.append(f"- {r['source']}")
    notes = [f"- **{r['name']}**: {r['note']}." for r in rows if r["note"]]
    if notes:
        lines += ["", "## Notes", ""] + notes
    lines += ["", "Clusters: `autoshard/planner/cluster.py` (DGX A100 and DGX H100 presets, with their sources).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT, help="folder for planner.md ('none': print only)")
    args = ap.parse_args(argv)
    text = markdown(run())
    print(text)
    if args.out != "none":
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "planner.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
