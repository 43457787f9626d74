"""Write the benchmark's results: a markdown table, the JSON, and a PNG of step time by variant and TP size."""
from __future__ import annotations

import json
import os
import platform

import torch

from benchmarks.variants import label

KIND_ABBR = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A",
             "broadcast": "BC"}


def environment() -> dict:
    env = dict(python=platform.python_version(), torch=torch.__version__, machine=platform.machine(),
               cpus=os.cpu_count(), cuda=torch.cuda.is_available(),
               device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu")
    try:
        from importlib.metadata import version

        env["megatron_core"] = version("megatron-core")
    except Exception:  # noqa: BLE001
        env["megatron_core"] = None
    return env


def _kinds(by_kind: dict) -> str:
    if not by_kind:
        return "0"
    return " ".join(f"{n} {KIND_ABBR.get(k, k)}" for k, n in sorted(by_kind.items()))


def markdown(results: dict) -> str:
    cfg, env = results["config"], results["env"]
    lines = [
        "# Tensor-parallel benchmark (`python -m benchmarks.tp`)",
        "",
        f"GPT: {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads, seq {cfg['seq']}, "
        f"batch {cfg['batch']}, fp32, tied embeddings, fused QKV. {cfg['warmup']} warm-up + {cfg['steps']} timed "
        f"steps per variant, interleaved; a step = forward + backward; time = max over ranks, "
        f"1 intra-op thread per rank.",
        f"Machine: {env['cpus']} CPUs, {env['device']}; torch {env['torch']}, megatron-core {env['megatron_core']}.",
        "",
        "| TP | vocab | variant | median ms | min ms | vs Megatron | collectives/step | MiB/step | peak MiB/rank |",
        "|---:|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    for run in results["runs"]:
        for name, row in run["variants"].items():
            tag = label(name, run["tp"])
            if not row.get("available"):
                lines.append(f"| {run['tp']} | {run['vocab']} | {tag} | skipped: {row['reason']} | | | | | |")
                continue
            ratio = f"{row['vs_megatron']:.3f}" if "vs_megatron" in row else "-"
            lines.append(f"| {run['tp']} | {run['vocab']} | {tag} | {row['median_ms']:.1f} | {row['min_ms']:.1f} | "
                         f"{ratio} | {row['calls_per_step']} ({_kinds(row['calls_by_kind'])}) | "
                         f"{row['bytes_per_step'] / 2**20:.2f} | {row['peak_mb']:.1f} |")
    lines += ["", "Max RSS per rank (MiB, whole process: all variants share it):", ""]
    for run in results["runs"]:
        lines.append(f"- TP={run['tp']} vocab={run['vocab']}: " + ", ".join(f"{x:.0f}" for x in run["max_rss_mb"]))
    if results.get("targets"):
        lines += ["", "Targets (measured, not asserted):", ""] + [f"- {t}" for t in results["targets"]]
    warn = [w for run in results["runs"] for w in run["warnings"]]
    if warn:
        lines += ["", "Warnings:", ""] + [f"- {w}" for w in warn]
    lines += [
        "",
        "Notes: collectives and bytes per step count AR = all-reduce, AG = all-gather, RS = reduce-scatter; "
        "bytes are those of the full tensor (reduced, gathered, or scattered). autoshard's come from its own "
        "`pm.comm_counts()` counters (checked against the plan, `pm.program.collectives`), the others' from "
        "`benchmarks.comm.CommTracer` (a TorchDispatchMode over the c10d and functional-collective ops) on an "
        "untimed step. Peak MiB/rank: parameter shards + peak tensor bytes allocated during one step "
        "(torch.profiler allocator events on CPU; torch.cuda.max_memory_allocated on GPU), max over ranks. "
        "The single-process baselines run in rank 0 while the other ranks wait.",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[benchmarks.tp] matplotlib is not installed (pip install matplotlib): no PNG written")
        return False
    vocabs = list(dict.fromkeys(run["vocab"] for run in results["runs"]))
    tps = list(dict.fromkeys(run["tp"] for run in results["runs"]))
    names = list(results["config"]["variants"])
    fig, axes = plt.subplots(1, len(vocabs), figsize=(5.5 * len(vocabs), 4.2), squeeze=False)
    width = 0.8 / max(1, len(names))
    for ax, vocab in zip(axes[0], vocabs):
        for i, name in enumerate(names):
            xs, med, lo = [], [], []
            for j, tp in enumerate(tps):
                run = next((r for r in results["runs"] if r["tp"] == tp and r["vocab"] == vocab), None)
                row = run["variants"].get(name) if run else None
                if row and row.get("available"):
                    xs.append(j + (i - (len(names) - 1) / 2) * width)
                    med.append(row["median_ms"])
                    lo.append(row["median_ms"] - row["min_ms"])
            if xs:
                disp = {"single_1t": "single, 1 thread", "single_nt": "single, TP threads"}.get(name, name)
                ax.bar(xs, med, width, yerr=[lo, [0] * len(lo)], capsize=2, label=disp)
        ax.set_xticks(range(len(tps)))
        ax.set_xticklabels([f"TP={t}" for t in tps])
        ax.set_ylabel("step time, ms (median; whisker to min)")
        ax.set_title(f"vocab {vocab}")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    cfg = results["config"]
    fig.suptitle(f"forward+backward step time: GPT {cfg['layers']}L h{cfg['hidden']} seq{cfg['seq']} "
                 f"b{cfg['batch']} ({results['env']['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_all(results: dict, out: str) -> list:
    os.makedirs(out, exist_ok=True)
    paths = []
    md = os.path.join(out, "tp_results.md")
    with open(md, "w") as f:
        f.write(markdown(results))
    paths.append(md)
    js = os.path.join(out, "tp_results.json")
    with open(js, "w") as f:
        slim = dict(results, runs=[{k: v for k, v in run.items() if k != "profile"} for run in results["runs"]])
        slim.pop("files", None)
        json.dump(slim, f, indent=1, default=str)
    paths.append(js)
    png = os.path.join(out, "tp_results.png")
    if plot(results, png):
        paths.append(png)
    for run in results["runs"]:
        if run.get("profile"):
            p = os.path.join(out, f"tp_profile_tp{run['tp']}_vocab{run['vocab']}.txt")
            with open(p, "w") as f:
                for name, table in run["profile"].items():
                    f.write(f"=== {name} (rank 0, 2 steps, sorted by self CPU time) ===\n{table}\n\n")
            paths.append(p)
    return paths
