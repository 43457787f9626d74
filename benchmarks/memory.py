"""Activation bytes one layer saves for backward, per rank, against Korthikanti et al.'s formulas.

    python -m benchmarks.memory [--tp 1 2 4] [--hidden 256] [--heads 4] [--seq 128] [--batch 2]

The built-in GPT (manual attention, dropout 0.1, fp32) on t gloo ranks, ``parallelize`` at tp=t with
recompute off, ``"selective"`` and full. A layer's bytes are the difference between a 2-layer and a
1-layer model's (every saved tensor counted once by its storage, parameters excluded), so the embedding
and the head cancel. The paper's formula counts 16-bit activations and 1-byte dropout masks,
``s b h (10 + 24/t + 5 a s / (h t))``: in fp32 every 2-byte term doubles and the masks stay, which makes
``s b h (18 + 48/t + 9 a s / (h t))`` (replicated: two norm inputs, the q|k|v and MLP inputs 4+2+2 at 4
bytes, two masks at 1; sharded: q, k, v, the attention output, the GeLU input and output; per head: the
softmax and its dropout output at 4 bytes, the mask at 1). Selective drops the last term; full recompute
keeps only the layer's input, 4 s b h. With sequence parallelism (``sequence_parallel=True``) the
replicated terms are sharded too: ``(s b h / t)(66 + 9 a s / h)``; autoshard keeps the two
column-parallel inputs gathered for the weight gradient (8 s b h (1 - 1/t) more), unless
``sequence_parallel="regather"`` keeps their shards and gathers them again in backward, as Megatron
(whose bytes the formula counts) does. Step time (forward + backward) is reported against TP alone.
Writes ``memory_results.md``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

OUT = os.path.join(os.path.dirname(__file__), "results")
VARIANTS = {"TP": (False, False), "TP + selective": ("selective", False), "TP + full recompute": (True, False),
            "TP + SP": (False, True), "TP + SP + selective": ("selective", True),
            "TP + SP regather": (False, "regather"), "TP + SP regather + selective": ("selective", "regather")}
# (recompute, sequence_parallel)


def formula_fp32(s: int, b: int, h: int, a: int, t: int, variant: str) -> float:
    """The paper's bytes per layer with fp32 activations and 1-byte masks (see the module docstring)."""
    if variant == "TP + full recompute":
        return 4.0 * s * b * h
    attention = 0 if "selective" in variant else 9 * a * s / (h * t)
    if "SP" in variant:           # the paper's (sbh/t)(34 + 5as/h): every term sharded
        return s * b * h * ((18 + 48) / t + attention)
    return s * b * h * (18 + 48 / t + attention)


def _step_seconds(pm, x, y) -> float:
    """Seconds of one forward + backward, with nothing hooked into autograd."""
    torch.manual_seed(7)
    start = time.perf_counter()
    pm(x, y)[1].backward()
    return time.perf_counter() - start


def _saved_bytes(pm, x, y) -> tuple:
    """(bytes saved for backward by one forward, seconds of forward + backward with the counting hook)."""
    skip = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in pm.parameters()}
    seen, total = set(skip), [0]

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t
    torch.manual_seed(7)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = pm(x, y)[1]
    loss.backward()
    return total[0], time.perf_counter() - start


def _rank(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as dist

    import autoshard
    from autoshard.models.gpt import GPT, GPTConfig
    torch.set_num_threads(1)
    mesh = autoshard.init_mesh(tp=world)
    s, b, h, a = args["seq"], args["batch"], args["hidden"], args["heads"]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, args["vocab"], (b, s), generator=g)
    y = torch.randint(0, args["vocab"], (b, s), generator=g)
    out, timed = {}, {}
    for variant in args["variants"]:
        recompute, sp = VARIANTS[variant]
        saved = {}
        for layers in (1, 2):
            torch.manual_seed(0)
            model = GPT(GPTConfig(block_size=s, vocab_size=args["vocab"], n_layer=layers, n_head=a, n_embd=h,
                                  dropout=0.1, flash=False, tie_weights=False)).train()
            pm = autoshard.parallelize(model, mesh, (x, y), loss_only=True, recompute=recompute, loss_chunk_rows=None,
                                       sequence_parallel=sp)
            saved[layers], _ = _saved_bytes(pm, x, y)
        out[variant] = dict(bytes=saved[2] - saved[1])
        timed[variant] = (pm, [])
    # the 2-layer programs' steps interleaved (A B C ... A B C ...): the shared host's noise hits all alike;
    # timed without the saved-tensor hook (a Python call per saved tensor), after one untimed round
    # the order reverses every round (A B C, C B A, ...): a variant's place after another (a cache left warm
    # or cold, a collective's partner still busy) is then the same for all on average
    for rep in range(args["reps"] + 1):
        for pm, times in (list(timed.values()) if rep % 2 else list(timed.values())[::-1]):
            dist.barrier()
            seconds = _step_seconds(pm, x, y)
            if rep:
                times.append(seconds)
    for variant, (_, times) in timed.items():
        out[variant]["seconds"] = statistics.median(times)
        out[variant]["times"] = times
    return out


def paired_ratio(times: list, base: list) -> float:
    """The median over rounds of a variant's step over TP's step in the same round: the two ran back to
    back, so a slow spell of the shared host slows both, where medians taken apart would each catch it
    in different rounds."""
    return statistics.median(t / b for t, b in zip(times, base))


def markdown(rows: list, args: dict) -> str:
    s, b, h, a = args["seq"], args["batch"], args["hidden"], args["heads"]
    lines = ["# Activation memory per layer per rank (`python -m benchmarks.memory`)", "",
             f"Built-in GPT, manual attention, dropout 0.1, fp32: s={s}, b={b}, h={h}, a={a}; gloo ranks, 1 thread "
             "each. Bytes are one layer's (a 2-layer model's minus a 1-layer model's), per rank; the formula is "
             "the paper's with fp32 activations and 1-byte masks (`benchmarks/memory.py`). Time: forward + backward "
             f"of the 2-layer model, {args['reps']} steps of each variant interleaved with the others (after one "
             "untimed round); *step ms* is the median, *vs TP* the median over rounds of the step over TP's in "
             "the same round, at the same t.", "",
             "| t | variant | measured KiB | formula KiB | measured / formula | step ms | vs TP |",
             "|---|---|---|---|---|---|---|"]
    for t, result in rows:
        base = result["TP"]["times"]
        for variant, r in result.items():
            want = formula_fp32(s, b, h, a, t, variant)
            lines.append(f"| {t} | {variant} | {r['bytes'] / 1024:.0f} | {want / 1024:.0f} | {r['bytes'] / want:.3f} | "
                         f"{r['seconds'] * 1e3:.1f} | {paired_ratio(r['times'], base):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--reps", type=int, default=15, help="timed steps of each variant, interleaved")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="the variants to run (TP, the baseline of 'vs TP', always runs)")
    ap.add_argument("--out", default=OUT)
    ns = ap.parse_args(argv)
    args = {k: v for k, v in vars(ns).items() if k not in ("out", "tp")}
    args["variants"] = ["TP"] + [v for v in ns.variants if v != "TP"]
    from autoshard import launch
    rows = [(t, launch(_rank, t, args, timeout=1800)[0]) for t in ns.tp]
    text = markdown(rows, args)
    print(text)
    if ns.out != "none":
        os.makedirs(ns.out, exist_ok=True)
        path = os.path.join(ns.out, "memory_results.md")
        notes = ""      # the file's own sections after the table (the per-term reading) are kept
        if os.path.exists(path):
            with open(path) as f:
                old = f.read()
            notes = old[old.index("\n## "):] if "\n## " in old else ""
        with open(path, "w") as f:
            f.write(text + notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
