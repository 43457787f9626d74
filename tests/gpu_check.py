"""One command for the checks only a GPU machine can make: autoshard on CUDA and NCCL against the
single-device model.

    python -m tests.gpu_check                            # on this machine's GPUs (1, 2, 4, 8 ranks)
    python -m tests.gpu_check --backend gloo --world 4   # the same checks on CPU ranks: a dry run

The test suite runs on gloo with CPU ranks, also on a GPU machine (``tests/conftest.py``). This runs the
suite's parity check (``tests/harness/pipeline_checks.py:pipeline_parity``: the loss and every gradient gathered
to full shape, then 3 AdamW steps, the tied copies bit-identical) with one GPU per rank, where the
parameters are CUDA DTensors, buffers and batches are moved to the rank's GPU, the pipeline's transfers
go through NCCL (one coalesced work per batch, a stream per group), and ``fuse="auto"`` runs the
generated Triton kernels:

- 1 GPU: pm.step with and without microbatches on the built-in GPT and an HF Llama (the device paths
  and the Triton kernels), ``codegen="inductor"`` (Inductor's Triton kernels), and selective and full
  recompute (checkpointed regions around generated kernels);
- 2 GPUs: tp=2; pp=2 with 1F1B (clipping), interleaved and GPipe, a tied head across the stages; dp=2
  with ZeRO-1; an HF Llama at pp=2;
- 4 GPUs: pp=2 x tp=2, dp=2 x pp=2 with ZeRO-1, dp=2 x tp=2, pp=4 interleaved, an HF Llama at
  pp=2 x tp=2 interleaved;
- 8 GPUs: dp=2 x pp=2 x tp=2 with ZeRO-1.

The reference runs on the CPU in fp32, so the GPU's own kernels (matmuls, attention) round differently:
the bound is 1e-4 relative (gloo runs are exact to 2e-5). Writes ``gpu_check.md`` into ``--out``
(default ``benchmarks/results``) and exits non-zero if a check fails.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

GPT = dict(n_layer=4)
LLAMA = dict(family="llama", layers=4, hidden=64, heads=4, kv_heads=2, tie_word_embeddings=True)
CONFIGS = {
    1: [("gpt", dict(tp=1), {}, GPT),
        ("gpt", dict(tp=1), dict(microbatches=2), GPT),
        ("family", dict(tp=1), dict(microbatches=2), LLAMA),
        ("gpt", dict(tp=1), dict(microbatches=2, codegen="inductor"), GPT),
        ("gpt", dict(tp=1), dict(microbatches=2, codegen="inductor", cuda_graphs=True), GPT),
        ("gpt", dict(tp=1), dict(microbatches=2, recompute="selective"), GPT),
        ("gpt", dict(tp=1), dict(microbatches=2, recompute=True), GPT)],
    2: [("gpt", dict(tp=2), dict(microbatches=2), GPT),
        ("gpt", dict(pp=2), dict(microbatches=4, schedule="1f1b", clip=0.05), GPT),
        ("gpt", dict(pp=2), dict(microbatches=4, schedule="interleaved", virtual_stages=2), GPT),
        ("gpt", dict(pp=2), dict(microbatches=4, schedule="gpipe"), GPT),
        ("gpt", dict(dp=2), dict(microbatches=2, zero=1), GPT),
        ("family", dict(pp=2), dict(microbatches=2), LLAMA),
        ("gpt", dict(tp=2), dict(microbatches=2, codegen="inductor"), GPT),
        ("gpt", dict(tp=2), dict(microbatches=2, codegen="inductor", cuda_graphs=True), GPT)],
    4: [("gpt", dict(pp=2, tp=2), dict(microbatches=2, clip=0.05), GPT),
        ("gpt", dict(dp=2, pp=2), dict(microbatches=2, zero=1), GPT),
        ("gpt", dict(dp=2, tp=2), dict(microbatches=2), GPT),
        ("gpt", dict(pp=4), dict(microbatches=4, schedule="interleaved", virtual_stages=2), GPT),
        ("family", dict(pp=2, tp=2), dict(microbatches=2, schedule="interleaved", virtual_stages=2), LLAMA),
        ("gpt", dict(pp=2, tp=2), dict(microbatches=2, codegen="inductor"), GPT)],
    8: [("gpt", dict(dp=2, pp=2, tp=2), dict(microbatches=2, zero=1), GPT)],
}
TOL = 1e-4
OUT = os.path.join(os.path.dirname(__file__), "results")


def _verdict(result: dict) -> tuple[float, float, float, bool]:
    """(worst loss error, worst gradient error, final parameter error, pass) over the steps."""
    loss, grads, final = max(result["losses"]), max(result["grads"]), result["final"]
    ok = loss < TOL and grads < TOL and final < TOL and max(result["norms"], default=0) < TOL \
        and result["exact"] and all(result["tied"].values())
    return loss, grads, final, ok


def run(world: int, tracebacks: list) -> list:
    """One table row per configuration of ``world`` ranks: ``(config, verdict or error)``; a rank's whole
    traceback goes to ``tracebacks`` (the table keeps its last line)."""
    from autoshard.launcher import RankError, launch
    from tests.harness.pipeline_checks import run_configs
    cuda = os.environ.get("AUTOSHARD_BACKEND") != "gloo"
    configs = [c for c in CONFIGS[world] if cuda or not c[2].get("cuda_graphs")]   # CUDA graphs: on GPUs only
    print(f"gpu_check: {world} rank(s), {len(configs)} configuration(s) ...", flush=True)
    try:
        results = launch(run_configs, world, configs, timeout=1800)
    except RankError as e:
        first = next(iter(e.errors.values())).strip().splitlines()[-1]
        tracebacks += [f"--- {world} rank(s), rank {r}:\n{text}" for r, text in sorted(e.errors.items())]
        return [(c, f"rank error: {first[:200]}") for c in configs]
    rows = []
    for config, per_rank in zip(configs, zip(*results)):
        verdicts = [_verdict(r) for r in per_rank]
        worst = tuple(max(v[i] for v in verdicts) for i in range(3))
        rows.append((config, (*worst, all(v[3] for v in verdicts))))
    return rows


def markdown(rows: list, backend: str, device: str) -> str:
    lines = [f"# GPU check ({backend}; {device})", "",
             f"Parity with the single-device model (fp32, on the CPU): worst relative error over 3 AdamW steps; "
             f"pass below {TOL:g}.", "",
             "| ranks | mesh | options | model | loss | gradients | final parameters | result |",
             "|---|---|---|---|---|---|---|---|"]
    for world, (kind, mesh, options, cfg), verdict in rows:
        model = cfg.get("family", kind) if kind == "family" else f"{kind} {cfg}"
        if isinstance(verdict, str):
            lines.append(f"| {world} | {mesh} | {options} | {model} | | | | FAIL: {verdict} |")
        else:
            loss, grads, final, ok = verdict
            lines.append(f"| {world} | {mesh} | {options} | {model} | {loss:.1e} | {grads:.1e} | {final:.1e} | "
                         f"{'pass' if ok else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    ap.add_argument("--world", type=int, nargs="*", default=None,
                    help="rank counts to run (default: every one of 1, 2, 4, 8 the GPUs allow)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    os.environ["AUTOSHARD_BACKEND"] = args.backend
    if args.backend == "nccl":
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; run on a GPU machine, or --backend gloo for a dry run on CPU ranks")
            return 2
        gpus = torch.cuda.device_count()
        device = f"{gpus} x {torch.cuda.get_device_name(0)}"
    else:
        gpus, device = 8, "CPU ranks"
    worlds = args.world or [w for w in CONFIGS if w <= gpus]
    rows, tracebacks = [], []
    text = markdown(rows, args.backend, device)
    for world in worlds:
        if world not in CONFIGS:
            raise SystemExit(f"--world takes {sorted(CONFIGS)}, got {world}")
        for config, verdict in run(world, tracebacks):
            rows.append((world, config, verdict))
            ok = not isinstance(verdict, str) and verdict[3]
            print(f"  {'pass' if ok else 'FAIL'}  {config[1]} {config[2]} {config[0]}: {verdict}", flush=True)
        text = markdown(rows, args.backend, device)     # after each rank count: a run stopped later keeps it
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
            f.write(text)
        if tracebacks:
            with open(os.path.join(args.out, "gpu_check_errors.log"), "w") as f:
                f.write("\n".join(tracebacks))
    if tracebacks:
        print(f"gpu_check: the ranks' tracebacks are in {os.path.join(args.out, 'gpu_check_errors.log')}")
    print(text)
    return 0 if all(not isinstance(v, str) and v[3] for _, _, v in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
