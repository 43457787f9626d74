"""Compile time of ``parallelize`` and the planned collectives, without starting processes.

    python -m benchmarks.compile_time [--layers 4 24] [--tp 2] [--hidden 256] [--vocab 50304]

Compiles rank 0 of a tp mesh (capture + every pass) for GPTs of several depths and prints the time
of each phase and the collectives per forward+backward step, counted and in bytes, as the plan says.
"""
from __future__ import annotations

import argparse
import time
import torch

import autoshard
from autoshard.models import GPT, GPTConfig
from autoshard.ir.program import comm_summary


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 24])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    print("| layers | compile s | capture s | passes s | ILP vars | ILP s | collectives/step | bytes/step |")
    print("|---|---|---|---|---|---|---|---|")
    for L in args.layers:
        with torch.device("meta"):  # no weights needed to compile
            model = GPT(GPTConfig(block_size=args.seq, vocab_size=args.vocab, n_layer=L, n_head=args.heads,
                                  n_embd=args.hidden))
        idx = torch.randint(0, args.vocab, (args.batch, args.seq))
        start = time.perf_counter()
        prog = autoshard.compile_rank(model, {"tp": args.tp}, 0, (idx, idx),
                                      options=autoshard.CompileOptions(loss_only=True))
        total = time.perf_counter() - start
        passes = sum(prog.timings.values())
        calls, per_kind_bytes = comm_summary(prog.collectives)
        kinds = {f"{axis} {phase} {kind}": n for (axis, phase, kind), n in calls.items()}
        nbytes = sum(per_kind_bytes.values())
        print(f"| {L} | {total:.2f} | {total - passes:.2f} | {passes:.2f} | {prog.report.variables} | "
              f"{prog.report.solve_seconds:.2f} | {sum(kinds.values())} ({dict(kinds)}) | {nbytes:,} |")


if __name__ == "__main__":
    main()
