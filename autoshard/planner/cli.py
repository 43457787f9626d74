"""``python -m autoshard plan``: the planner from a shell, with no processes and no weights.

    python -m autoshard plan --model gpt-1t --gpus 3072 --cluster dgx-a100 --global-batch 3072 --seq 2048
    python -m autoshard plan --model path/to/config.json --gpus 64 --cluster dgx-h100 --global-batch 512

prints the ranked table, and writes ``plan.md`` for the winner and ``plan.svg`` (predicted throughput
over the candidates) into ``--out``.
"""
from __future__ import annotations

import argparse
import os
import sys

from autoshard.planner.cluster import PRESETS
from autoshard.planner.config_reading import model_shape
from autoshard.planner.report import plan_md, plot_svg, table
from autoshard.planner.runtimes import RUNTIMES
from autoshard.planner.search import plan
from autoshard.planner.shape import BUILTIN, ModelShape


def _model(spec: str, seq):
    """A built-in name (``gpt``, ``gpt-1.7b`` ... ``gpt-1t``), ``gpt:n_layer=24,n_embd=2048,...`` (the
    built-in GPT's config), or a path to an HF ``config.json``."""
    if spec in BUILTIN:
        return model_shape(BUILTIN[spec], seq)
    if spec.startswith("gpt:") or spec == "gpt":
        from autoshard.models.gpt import GPTConfig
        pairs = [kv.split("=", 1) for kv in spec[4:].split(",") if kv]
        if any(len(kv) != 2 for kv in pairs):
            raise SystemExit(f"--model {spec}: write each field as name=value, e.g. gpt:n_layer=24,n_embd=2048")
        fields = dict(pairs)
        try:
            config = GPTConfig(**{k: int(v) for k, v in fields.items()})
        except (TypeError, ValueError) as e:
            raise SystemExit(f"--model {spec}: {e} (fields: n_layer, n_embd, n_head, vocab_size, block_size)")
        return model_shape(config, seq)
    if os.path.exists(spec):
        return model_shape(spec, seq)
    raise SystemExit(f"--model {spec!r}: not a built-in ({', '.join(sorted(BUILTIN))}), not gpt:field=value,..., "
                     "and no such config.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autoshard plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="built-in name, gpt:field=value,..., or an HF config.json")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--cluster", default="dgx-a100", type=str.lower, choices=sorted(PRESETS))
    ap.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's context)")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--no-flash", action="store_true", help="attention keeps its s x s matrix (no FlashAttention)")
    ap.add_argument("--memory-limit", type=float, default=None,
                    help="GiB a GPU may hold (a hard limit below the cluster's usable memory)")
    ap.add_argument("--runtime", default="autoshard", type=str.lower, choices=sorted(RUNTIMES),
                    help="the runtime the plan is for (default autoshard's; the others to hand a plan to Megatron "
                         "or DeepSpeed)")
    ap.add_argument("--out", default="autoshard_plan", help="folder for plan.md and plan.svg ('none': write nothing)")
    args = ap.parse_args(argv)
    if args.memory_limit is not None and not args.memory_limit > 0:
        ap.error(f"--memory-limit {args.memory_limit:g}: give the GiB a GPU may hold, a positive number")
    try:
        return _run(args)
    except (ValueError, TypeError) as e:       # what plan() refuses, said as the CLI's error, not a traceback
        print(f"python -m autoshard plan: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    shape: ModelShape = _model(args.model, args.seq)
    print(f"planning {shape.name} ({shape.params() / 1e9:.2f} B parameters, seq {shape.seq}) on {args.gpus} GPUs "
          f"of {args.cluster}, global batch {args.global_batch} ...", file=sys.stderr, flush=True)
    limit = None if args.memory_limit is None else args.memory_limit * 2**30
    plans = plan(shape, args.gpus, args.cluster, args.global_batch, flash=not args.no_flash, top=args.top,
                 memory_limit=limit, runtime=args.runtime,
                 progress=lambda done, total: print(f"  priced {done}/{total}", file=sys.stderr, flush=True))
    print(table(plans))
    print(f"\n{plans.considered} configurations priced in {plans.seconds:.2f} s")
    try:
        best = plans.best
    except ValueError as e:
        print(f"\n{e}", file=sys.stderr)
        return 1
    print(f"best: {best.label()}: {best.step_seconds:.3f} s a step, {best.tflops_per_gpu:.1f} TFLOP/s per GPU")
    if args.out != "none":
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "plan.md"), "w") as f:
            f.write(plan_md(plans))
        with open(os.path.join(args.out, "plan.svg"), "w") as f:
            f.write(plot_svg(plans))
        print(f"wrote {os.path.join(args.out, 'plan.md')} and {os.path.join(args.out, 'plan.svg')}")
    return 0
