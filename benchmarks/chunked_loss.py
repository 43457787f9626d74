"""The chunked LM head + cross-entropy against the unchunked vocab-parallel loss: peak memory and time.

    python -m benchmarks.chunked_loss [--rows 4096] [--vocab 50304] [--hidden 768] [--chunk auto] [--reps 3]

Both compute the loss of ``h [rows, hidden]`` against ``W [vocab, hidden]`` and its gradients, as the
compiled programs do at tp=1: unchunked is ``logits = h @ W^T`` then ``VocabParallelCrossEntropy``
(in place on the logits, as when nothing else reads them), then autograd; chunked is
``ChunkedLinearCrossEntropy``. Each measurement runs in a fresh process (A B A B ...): peak memory is
the rise of the process's peak RSS (``ru_maxrss``, a high-water mark) over the first full-size forward
and backward, after the inputs exist and a tiny warm-up step has run (CPU), or
``torch.cuda.max_memory_allocated`` over the allocated baseline (GPU). Time is the median step. Writes ``chunked_loss_results.md`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

OUT = os.path.join(os.path.dirname(__file__), "results")


class _One:
    """The tp=1 communicator: every all-reduce is the identity."""
    size = 1

    def all_reduce(self, x, phase, op=None):
        return x


def _step(variant: str, h, w, target, chunk: int):
    from autoshard.runtime.chunked_loss import ChunkedLinearCrossEntropy
    from autoshard.runtime.losses import VocabParallelCrossEntropy
    hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
    if variant == "chunked":
        loss = ChunkedLinearCrossEntropy.apply(hl, wl, target, _One(), 0, w.shape[0], -100, 1, chunk)
    else:
        logits = hl @ wl.t()
        loss = VocabParallelCrossEntropy.apply(logits, target, _One(), 0, w.shape[0], -100, 1, True)
    loss.backward()
    return float(loss)


def _peak_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(variant: str, rows: int, vocab: int, hidden: int, chunk: int, reps: int) -> dict:
    """One variant in this process: peak extra bytes over the baseline, step times, the loss."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(rows, hidden, generator=g) * 0.5).to(device)
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device)
    target = torch.randint(0, vocab, (rows,), generator=g).to(device)
    target[: rows // 10] = -100
    # warm-up on a tiny problem (thread pool, kernels): the peak RSS is a high-water mark, so the first
    # full-size step below is the one that measures memory
    _step(variant, h[:8, :8].contiguous(), w[:64, :8].contiguous(), target[:8].clamp(max=63), chunk)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _peak_bytes(device)
    _step(variant, h, w, target, chunk)
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = _peak_bytes(device) - base
    times, loss = [], 0.0
    for _ in range(reps):
        start = time.perf_counter()
        loss = _step(variant, h, w, target, chunk)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"variant": variant, "peak_extra_bytes": peak, "step_s": times, "loss": loss,
            "device": device.type}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--chunk", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="processes per variant, interleaved")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from autoshard.passes.chunk_loss import default_chunk
    chunk = default_chunk(args.rows, args.vocab, args.hidden) if args.chunk == "auto" else int(args.chunk)
    if args.child:
        print(json.dumps(measure(args.child, args.rows, args.vocab, args.hidden, chunk, args.reps)))
        return {}
    runs: dict = {"unchunked": [], "chunked": []}
    for _ in range(args.rounds):
        for variant in runs:
            cmd = [sys.executable, "-m", "benchmarks.chunked_loss", "--child", variant, "--rows", str(args.rows),
                   "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(chunk),
                   "--reps", str(args.reps)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
    summary = {}
    for variant, rs in runs.items():
        summary[variant] = {"peak_extra_MiB": statistics.median(r["peak_extra_bytes"] for r in rs) / 2**20,
                            "median_step_s": statistics.median(t for r in rs for t in r["step_s"]),
                            "loss": rs[0]["loss"]}
    u, c = summary["unchunked"], summary["chunked"]
    if abs(u["loss"] - c["loss"]) > 1e-4 * abs(u["loss"]):
        raise RuntimeError(f"the losses differ: unchunked {u['loss']}, chunked {c['loss']}")
    result = {"rows": args.rows, "vocab": args.vocab, "hidden": args.hidden, "chunk": chunk,
              "device": runs["chunked"][0]["device"], "summary": summary,
              "memory_ratio": u["peak_extra_MiB"] / max(c["peak_extra_MiB"], 1e-9),
              "time_ratio": c["median_step_s"] / u["median_step_s"]}
    lines = [f"# Chunked loss: rows={args.rows}, V={args.vocab}, H={args.hidden}, chunk={chunk} "
             f"({result['device']})", "", "| variant | peak extra MiB | median step s | loss |", "|---|---|---|---|"]
    for variant, s in summary.items():
        lines.append(f"| {variant} | {s['peak_extra_MiB']:.1f} | {s['median_step_s']:.3f} | {s['loss']:.6f} |")
    lines += ["", f"Peak memory for the loss: {result['memory_ratio']:.2f}x less chunked; time "
                  f"{result['time_ratio']:.3f}x the unchunked."]
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "chunked_loss_results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
