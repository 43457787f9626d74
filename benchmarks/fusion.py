"""Generated fusion kernels against eager PyTorch and ``torch.compile`` (Inductor).

    python -m benchmarks.fusion [--rows 8192] [--hidden 4096] [--dtype bf16] [--out benchmarks/results]

For each pattern of ``tests/harness/fusion_patterns.py`` (the fusion tests' fixtures) and for a whole
GPT (two layers) forward+backward:
- the bytes moved, counted from shapes: eager (each ATen op reads its inputs and writes its output; in
  backward, the ops autograd runs) and fused (the kernel's operands);
- on a GPU: the time of eager, autoshard-fused and ``torch.compile`` (CUDA events, median), and each
  generated kernel's achieved bandwidth against the device's measured peak (a large ``copy_``).

On CPU the kernels only run in Triton's interpreter, which says nothing about speed: the benchmark prints
the byte counts, notes that the kernel timings need a GPU, and runs the chunked loss's CPU measurement
(``benchmarks/chunked_loss.py``) if it is there. Writes ``fusion_results.md`` and ``.json`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tests.harness.fusion_patterns import PATTERNS, operands

OUT = os.path.join(os.path.dirname(__file__), "results")


def _meta(x):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


def eager_bytes(fn, ins, grad_inputs) -> tuple:
    """(forward, backward) bytes of the eager ops, counted from shapes."""
    from autoshard.kernels.trace import eager_backward_graph
    from autoshard.passes.fusion import graph_bytes
    metas = [_meta(x) for x in ins]
    fwd = graph_bytes(make_fx(fn)(*metas))
    if grad_inputs is not None:
        def of_diff(*xs):
            full = list(metas)
            for i, x in zip(grad_inputs, xs):
                full[i] = x
            return fn(*full)
        return fwd, graph_bytes(eager_backward_graph(of_diff, [metas[i] for i in grad_inputs]))
    return fwd, graph_bytes(eager_backward_graph(fn, metas))


def kernel_bytes(kernel, inputs) -> int:
    from autoshard.passes.fusion import kernel_bytes as kb
    return kb(kernel, inputs)


def _cuda_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _host_ms(fn, iters: int) -> float:
    """Median host time to issue ``fn`` (no synchronisation inside the timed span): where it nears the
    CUDA-event time, the GPU waited on Python and the timing measures the launch path, not the kernel."""
    import time
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def peak_bandwidth(device) -> float:
    """Bytes/s of a 1 GiB device-to-device ``copy_`` (read + write)."""
    x = torch.empty(2**28, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    ms = _cuda_ms(lambda: y.copy_(x), 20)
    return 2 * x.numel() * 4 / (ms / 1e3)


def bench_pattern(p, args, device, dtype, gpu: bool) -> dict:
    from autoshard.kernels.launch import compile_group
    b, s = args.rows // args.seq, args.seq
    ins = operands(p.name, b, s, args.hidden, heads=args.heads, dtype=dtype, device=device)
    group = compile_group(p.fn, ins, p.name, grad_inputs=p.grad_inputs)
    fwd_k = group.forward_kernels.get(ins)
    outs = p.fn(*ins)
    grads = [torch.randn_like(o) for o in outs]
    bwd_ops = [*ins, *grads, *outs]
    bwd_k = group.backward_kernels.get(bwd_ops) if group.backward_kernels else None
    e_fwd, e_bwd = eager_bytes(p.fn, ins, p.grad_inputs)
    row = {"pattern": p.name, "shape": list(ins[0].shape), "dtype": str(dtype).removeprefix("torch."),
           "eager_fwd_bytes": e_fwd, "fused_fwd_bytes": kernel_bytes(fwd_k, ins),
           "eager_bwd_bytes": e_bwd, "fused_bwd_bytes": kernel_bytes(bwd_k, bwd_ops) if bwd_k else 0}
    if not gpu:
        return row
    wants = [x.is_floating_point() and (p.grad_inputs is None or i in p.grad_inputs) for i, x in enumerate(ins)]
    leaves = [x.detach().requires_grad_(w) for x, w in zip(ins, wants)]
    compiled = torch.compile(p.fn)

    def train(f):
        def run():
            torch.autograd.backward(f(*leaves), grads)
        return run

    row["fwd_kernel_ms"] = _cuda_ms(lambda: fwd_k(*ins), args.iters)
    row["fwd_kernel_GBps"] = row["fused_fwd_bytes"] / row["fwd_kernel_ms"] / 1e6
    if bwd_k:
        row["bwd_kernel_ms"] = _cuda_ms(lambda: bwd_k(*bwd_ops), args.iters)
        row["bwd_kernel_GBps"] = row["fused_bwd_bytes"] / row["bwd_kernel_ms"] / 1e6
    for name, f in (("eager", p.fn), ("fused", group), ("compile", compiled)):
        row[f"{name}_fwd_bwd_ms"] = _cuda_ms(train(f), args.iters)
        row[f"{name}_host_ms"] = _host_ms(train(f), args.iters)
    return row


def _gpt_layer_rank(rank, world, job):
    """Two GPT layers, forward+backward: eager, autoshard unfused and fused (tp=1 on one GPU), compile."""
    import copy

    import autoshard
    from autoshard.models.gpt import GPT, GPTConfig
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=job["vocab"], block_size=job["seq"], n_layer=2, n_head=job["heads"],
                    n_embd=job["hidden"])
    model = GPT(cfg).to(device)
    idx = torch.randint(0, job["vocab"], (job["rows"] // job["seq"], job["seq"]), device=device)
    mesh = autoshard.init_mesh(tp=1)
    variants = {"eager": copy.deepcopy(model), "compile": torch.compile(copy.deepcopy(model)),
                "autoshard": autoshard.parallelize(copy.deepcopy(model), mesh, (idx, idx), fuse=False),
                "autoshard_fused": autoshard.parallelize(copy.deepcopy(model), mesh, (idx, idx), fuse=True)}
    res = {}
    for name, m in variants.items():
        def step():
            m(idx, idx)[1].backward()
        res[name] = _cuda_ms(step, job["iters"])
    program = variants["autoshard_fused"].programs[0]
    report = program.gm.meta.get("autoshard_fusion_report")
    if report is not None:
        res["groups"] = len(report.groups)
        res["kernels"] = report.kernel_count
    return res


def _markdown(rows, layer, peak, gpu: bool) -> str:
    L = ["# Fusion benchmark", ""]
    if peak:
        L += [f"Measured peak bandwidth (copy): {peak / 1e9:.0f} GB/s", ""]
    head = "| pattern | shape | dtype | fwd bytes eager -> fused | bwd bytes eager -> fused |"
    sep = "|---|---|---|---|---|"
    if gpu:
        head += (" fwd kernel GB/s (% peak) | bwd kernel GB/s (% peak) | eager ms | fused ms | compile ms |"
                 " host ms to issue, eager / fused |")
        sep += "---|---|---|---|---|---|"
    L += [head, sep]
    for r in rows:
        line = (f"| {r['pattern']} | {r['shape']} | {r['dtype']} | {r['eager_fwd_bytes']} -> {r['fused_fwd_bytes']} | "
                f"{r['eager_bwd_bytes']} -> {r['fused_bwd_bytes']} |")
        if gpu:
            def pct(k):
                return f"{r[k]:.0f} ({100 * r[k] * 1e9 / peak:.0f}%)" if k in r else "-"
            line += (f" {pct('fwd_kernel_GBps')} | {pct('bwd_kernel_GBps')} | {r['eager_fwd_bwd_ms']:.3f} | "
                     f"{r['fused_fwd_bwd_ms']:.3f} | {r['compile_fwd_bwd_ms']:.3f} | "
                     f"{r['eager_host_ms']:.3f} / {r['fused_host_ms']:.3f} |")
        L.append(line)
    if layer:
        L += ["", "## GPT, 2 layers, forward + backward (ms)", "", "| " + " | ".join(layer) + " |",
              "|" + "---|" * len(layer), "| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v)
                                                     for v in layer.values()) + " |"]
        if "eager" in layer:
            L += ["", f"fused / eager: {layer['autoshard_fused'] / layer['eager']:.3f}; "
                      f"fused / compile: {layer['autoshard_fused'] / layer['compile']:.3f}"]
    if not gpu:
        L += ["", "No GPU here: the kernel timings need one (the kernels run only in Triton's interpreter on "
                  "CPU). Run `python -m benchmarks.fusion` on a CUDA machine for them."]
    return "\n".join(L) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192, help="b*s")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-loss", action="store_true", help="skip the chunked-loss measurement")
    ap.add_argument("--no-gpt", action="store_true", help="skip the two-layer GPT timing (its torch.compile "
                    "takes minutes at the default sizes)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # compile-only: nothing is launched
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = [bench_pattern(p, args, device, dtype, gpu) for p in PATTERNS]
    for r in rows:
        print(f"{r['pattern']:>22}: fwd {r['eager_fwd_bytes']:>12} -> {r['fused_fwd_bytes']:>12} B   "
              f"bwd {r['eager_bwd_bytes']:>12} -> {r['fused_bwd_bytes']:>12} B"
              + (f"   fused {r['fused_fwd_bwd_ms']:.3f} ms, eager {r['eager_fwd_bwd_ms']:.3f}, compile "
                 f"{r['compile_fwd_bwd_ms']:.3f}" if gpu else ""))
    peak, layer = (peak_bandwidth(device) if gpu else None), {}
    result = {"gpu": gpu, "peak_bytes_per_s": peak, "patterns": rows, "gpt": layer}
    _write(args.out, rows, layer, peak, gpu, result)   # the patterns' table survives a run stopped below
    if gpu and not args.no_gpt:
        from autoshard.launcher import launch
        job = {k: getattr(args, k) for k in ("rows", "seq", "hidden", "heads", "vocab", "iters")}
        layer = result["gpt"] = launch(_gpt_layer_rank, 1, job)[0]
        print("GPT 2 layers fwd+bwd ms:", layer)
    elif not gpu:
        print("no GPU: byte counts only; the kernel timings need a GPU (python -m benchmarks.fusion there)")
    if not args.no_loss:
        try:
            from benchmarks import chunked_loss
            result["chunked_loss"] = chunked_loss.main([])
        except ImportError:
            pass
    _write(args.out, rows, layer, peak, gpu, result)
    return result


def _write(out, rows, layer, peak, gpu, result) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fusion_results.md"), "w") as f:
        f.write(_markdown(rows, layer, peak, gpu))
    with open(os.path.join(out, "fusion_results.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
