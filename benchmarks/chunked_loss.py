"""The chunked LM head + cross-entropy against the unchunked vocab-parallel loss: peak memory and time.

    python -m benchmarks.chunked_loss [--rows 4096] [--vocab 50304] [--hidden 768] [--chunk auto 384] [--reps 3]

Every variant computes the loss of ``h [rows, hidden]`` through ``W [vocab, hidden]`` and the gradients
of both: the unchunked vocab-parallel loss (``logits = h @ W^T`` then ``VocabParallelCrossEntropy`` in
place on the logits, what a tp > 1 program runs on its shard when nothing else reads the logits; the
baseline of the ratios), torch's ``F.cross_entropy`` on the logits (what a tp = 1 program runs
unchunked), and ``ChunkedLinearCrossEntropy`` (``runtime/chunked_loss.py``) with ``--chunk`` rows per
chunk ("auto" is the compiler's rule, ``passes/chunk_loss.py:default_chunk``). All run side by side in
this process.

Memory is the peak of the bytes the allocator holds for tensors during one forward + backward, over
what it held before (the inputs), i.e. what the loss adds at its worst moment. On CUDA that is
``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` before. On CPU it is the same count
taken from the profiler's allocator events (``profile_memory``: every allocation and free of the CPU
allocator, in order; their running sum's maximum): exact tensor bytes, unlike the process RSS, which
the allocator's caching and the kernel's page accounting blur. The gradients the step leaves in
``.grad`` count (they are alive at the peak in both variants).

Time is per forward + backward step, the variants interleaved rep by rep (so a busy neighbour on a
shared machine slows all alike); the ratio is taken on the fastest step of each (the least disturbed),
and the medians are printed too. Writes ``chunked_loss_results.md`` to ``--out``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

OUT = os.path.join(os.path.dirname(__file__), "results")


def _step(variant, h, w, target):
    """One forward + backward. ``variant``: rows per chunk; ``"vocab_parallel"``, the unchunked loss of a
    tp > 1 program (in place on the logits); ``"torch"``, what a tp = 1 program runs unchunked
    (``F.cross_entropy``: log-softmax, NLL, and their backward on fresh logits-sized buffers)."""
    from autoshard.runtime.chunked_loss import ChunkedLinearCrossEntropy
    from autoshard.runtime.losses import VocabParallelCrossEntropy
    hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
    if variant == "torch":
        loss = torch.nn.functional.cross_entropy(hl @ wl.t(), target)
    elif variant == "vocab_parallel":
        loss = VocabParallelCrossEntropy.apply(hl @ wl.t(), target, _One(), 0, w.shape[0], -100, 1, True)
    else:   # rows per chunk; "<rows>+kernel": each chunk's loss by kernels/cross_entropy.py
        rows, _, kernel = str(variant).partition("+")
        loss = ChunkedLinearCrossEntropy.apply(hl, wl, target, None, 0, w.shape[0], -100, 1, int(rows), True, None,
                                               0.0, w.shape[0], True, None, (), bool(kernel))
    loss.backward()
    return float(loss.detach())


class _One:
    """The tp=1 communicator of the unchunked loss: every all-reduce is the identity."""
    size = 1

    def all_reduce(self, x, phase, op=None):
        return x


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_extra_bytes(fn, device) -> int:
    """The most bytes ``fn`` holds in tensors at once, over those held before it ran."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    if not events:
        raise RuntimeError("the profiler recorded no allocator events: cannot count CPU memory")
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def run(rows: int, vocab: int, hidden: int, chunks: list, reps: int, device, with_torch: bool = True) -> dict:
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(rows, hidden, generator=g) * 0.5).to(device)
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device)
    target = torch.randint(0, vocab, (rows,), generator=g).to(device)
    target[: rows // 10] = -100
    variants = ["vocab_parallel"] + (["torch"] if with_torch else []) + chunks
    res = {c: {"chunk": c, "times": []} for c in variants}
    for c in variants:             # warm-up (thread pool, kernels), then the memory count
        res[c]["loss"] = _step(c, h, w, target)
        res[c]["peak"] = peak_extra_bytes(lambda c=c: _step(c, h, w, target), device)
    for _ in range(reps):
        for c in variants:
            _sync(device)
            start = time.perf_counter()
            _step(c, h, w, target)
            _sync(device)
            res[c]["times"].append(time.perf_counter() - start)
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--chunk", nargs="+", default=["auto"], help="rows per chunk: 'auto' and/or ints")
    ap.add_argument("--no-torch", action="store_true", help="leave out the F.cross_entropy row (the slowest)")
    ap.add_argument("--kernel", action="store_true",
                    help="also each chunk size with the Triton kernels for the loss (a GPU, or TRITON_INTERPRET=1)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    from autoshard.passes.chunk_loss import default_chunk
    auto = default_chunk(args.rows, args.vocab, args.hidden, gpu=args.device.startswith("cuda"))
    chunks = list(dict.fromkeys(auto if c == "auto" else int(c) for c in args.chunk))
    if args.kernel:
        chunks += [f"{c}+kernel" for c in chunks]
    device = torch.device(args.device)
    res = run(args.rows, args.vocab, args.hidden, chunks, args.reps, device, not args.no_torch)
    base = res["vocab_parallel"]
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    lines = [f"# Chunked loss: rows={args.rows}, V={args.vocab}, H={args.hidden} ({device.type}{threads})", "",
             "`python -m benchmarks.chunked_loss`: peak extra tensor bytes of one forward + backward (allocator "
             "count: profiler events on CPU, max_memory_allocated on CUDA); time per step, fastest and median "
             f"of {args.reps} interleaved.", "",
             "Ratios are against the unchunked vocab-parallel loss.", "",
             "| variant | peak extra MiB | memory, x less | fastest step s | median step s | time, x unchunked "
             "(fastest) | loss |", "|---|---|---|---|---|---|---|"]
    out = {"rows": args.rows, "vocab": args.vocab, "hidden": args.hidden, "device": device.type, "variants": []}
    for c, r in res.items():
        if abs(r["loss"] - base["loss"]) > 1e-4 * abs(base["loss"]):
            raise RuntimeError(f"the losses differ: unchunked {base['loss']}, chunk {c}: {r['loss']}")
        name = {"vocab_parallel": "unchunked (vocab-parallel loss, in place)",
                "torch": "unchunked (F.cross_entropy, what tp=1 runs)"}.get(c, f"chunk {c}" + (" (auto)" if c == auto else "")
                                                                      + (", Triton loss kernels" if "kernel" in str(c) else ""))
        mem_x = base["peak"] / max(r["peak"], 1)
        time_x = min(r["times"]) / min(base["times"])
        lines.append(f"| {name} | {r['peak'] / 2**20:.1f} | {mem_x:.2f} | {min(r['times']):.3f} | "
                     f"{statistics.median(r['times']):.3f} | {time_x:.3f} | {r['loss']:.6f} |")
        out["variants"].append({"chunk": c, "peak_bytes": r["peak"], "times": r["times"], "memory_ratio": mem_x,
                                "time_ratio": time_x})
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"chunked_loss_results{'_cuda' if device.type == 'cuda' else ''}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return out


if __name__ == "__main__":
    main()
