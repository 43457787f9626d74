"""Activation recompute: peak memory and step time of one rank's program with and without it.

    python -m benchmarks.recompute [--layers 8] [--hidden 512] [--seq 256] [--batch 4] [--reps 5]

The built-in GPT (dropout 0.1, untied head) compiled for one rank (``compile_rank`` at tp=1, so the
numbers are the recompute alone), once with ``recompute=False`` and once with ``recompute=True``. Both
run the same weights and batch; the losses must agree exactly before anything is timed. Memory is the
peak of the tensor bytes a forward + backward adds over what was held before (the allocator's own
count, ``benchmarks.chunked_loss.peak_extra_bytes``: CUDA's peak statistics, or the CPU profiler's
allocator events), gradients included. Time is the fastest and the median forward + backward, the two
variants interleaved rep by rep. On CUDA it runs on the GPU. Writes ``recompute_results.md`` to ``--out``.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from benchmarks.chunked_loss import OUT, _sync, peak_extra_bytes


def _program(model, x, y, recompute: bool):
    import autoshard
    from autoshard.ir.mesh import MeshSpec
    from autoshard.runtime.module import ParallelModule
    prog = autoshard.compile_rank(model, MeshSpec(tp=1), 0, (x, y), {},
                                  options=autoshard.CompileOptions(recompute=recompute))
    return ParallelModule(prog, copy.deepcopy(model))


def run(layers: int, hidden: int, seq: int, batch: int, vocab: int, reps: int, device) -> dict:
    from autoshard.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=seq, vocab_size=vocab, n_layer=layers, n_head=max(1, hidden // 64),
                          n_embd=hidden, dropout=0.1, tie_weights=False)).to(device).train()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    y = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    variants = {"plain": _program(model, x, y, False), "recompute": _program(model, x, y, True)}

    def step(pm):
        def go():
            for p in pm.parameters():
                p.grad = None
            torch.manual_seed(7)
            loss = pm(x, y)[1]
            loss.backward()
            return float(loss.detach())
        return go
    losses = {k: step(pm)() for k, pm in variants.items()}
    if losses["plain"] != losses["recompute"]:
        raise RuntimeError(f"losses differ: {losses}")
    memory = {k: peak_extra_bytes(step(pm), device) for k, pm in variants.items()}
    times = {k: [] for k in variants}
    for _ in range(reps):
        for k, pm in variants.items():
            fn = step(pm)
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[k].append(time.perf_counter() - start)
    return dict(config=dict(layers=layers, hidden=hidden, seq=seq, batch=batch, vocab=vocab, device=str(device)),
                loss=losses["plain"], memory=memory, fastest={k: min(v) for k, v in times.items()},
                median={k: statistics.median(v) for k, v in times.items()})


def markdown(r: dict) -> str:
    m, f, md = r["memory"], r["fastest"], r["median"]
    return "\n".join([
        "# Activation recompute", "", f"Config: {r['config']}; loss {r['loss']:.6f} in both", "",
        "| variant | peak added MiB | fastest ms | median ms |", "|---|---|---|---|",
        *[f"| {k} | {m[k] / 2**20:.1f} | {f[k] * 1e3:.1f} | {md[k] * 1e3:.1f} |" for k in m],
        "", f"Recompute: {m['plain'] / m['recompute']:.2f}x less peak memory at {f['recompute'] / f['plain']:.2f}x "
            f"the time (fastest steps; {md['recompute'] / md['plain']:.2f}x on medians).", ""])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    r = run(args.layers, args.hidden, args.seq, args.batch, args.vocab, args.reps, device)
    text = markdown(r)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "recompute_results.md"), "w") as f:
        f.write(text)
    print(text)
    return r


if __name__ == "__main__":
    main()
