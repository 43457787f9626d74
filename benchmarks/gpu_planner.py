"""The planner's one-GPU predictions against measured steps on the GPU at hand (issues 26 and 27).

    python -m benchmarks.gpu_planner [--steps 8] [--out DIR]

On one CUDA device (a one-rank NCCL group, so parameters are DTensors as on any mesh):

1. ``Cluster.measure()`` in bf16 over GEMMs up to 8192 (a GPU's curve is flat only there), set beside the
   DGX-H100 preset's numbers.
2. For GPT sizes, each with recompute "none", "selective" and "full": the planner's predicted step
   (``predict`` at dp = pp = tp = 1, b = the batch, m = 1) with the measured cluster and with the preset,
   against autoshard's measured step (``parallelize(..., mixed_precision="bf16")`` + ``AdamW(fused=True)``,
   median of the interleaved steps) and its peak memory against the predicted bytes.
3. Activation bytes one layer saves (a 2-layer model's minus a 1-layer model's, manual attention,
   dropout 0.1, bf16) against Korthikanti et al.'s 16-bit formula at t = 1: ``s b h (34 + 5 a s / h)``,
   and ``34 s b h`` with selective recompute.

Selective recompute's step time against none is issue 27's target (at most 1.10x). Writes
``gpu_planner.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from benchmarks.step import interleaved, one_rank_mesh

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SIZES = {"gpt-350m-ish": dict(n_layer=8, n_embd=1024, n_head=16, block_size=1024, batch=8),
         "gpt-1.3b-ish": dict(n_layer=4, n_embd=2048, n_head=16, block_size=2048, batch=4),
         "gpt-6.7b-layer": dict(n_layer=2, n_embd=4096, n_head=32, block_size=2048, batch=2)}
RECOMPUTE = {"none": False, "selective": "selective", "full": True}


def _config(size: dict, vocab: int, **extra):
    from autoshard.models.gpt import GPTConfig
    fields = {k: v for k, v in size.items() if k != "batch"}
    return GPTConfig(vocab_size=vocab, dropout=0.0, **{**fields, **extra})


def steps_against_predictions(args, mesh, device, cluster, preset) -> list:
    import autoshard
    from autoshard.models.gpt import GPT
    from autoshard.planner import Candidate, model_shape, predict
    rows = []
    for label in args.sizes:
        size = SIZES[label]
        cfg = _config(size, args.vocab)
        b = size["batch"]
        ids = torch.randint(0, args.vocab, (b, cfg.block_size), device=device)
        steps, made = {}, {}
        for name, recompute in RECOMPUTE.items():
            torch.manual_seed(0)
            pm = autoshard.parallelize(GPT(cfg), mesh, (ids, ids), loss_only=True, mixed_precision="bf16",
                                       recompute=recompute, fuse=args.fuse)
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-5, fused=True)

            def step(pm=pm, opt=opt):
                pm(ids, ids)[1].backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            step()
            steps[name], made[name] = step, (pm, opt)
        times = interleaved(steps, args.steps, 2, device)
        shape = model_shape(cfg)
        for name in RECOMPUTE:
            peak = _peak_bytes(steps[name], device, *made[name])
            c = Candidate(dp=1, pp=1, tp=1, b=b, m=1, recompute=name)
            mine, theirs = predict(shape, cluster, c), predict(shape, preset, c)
            rows.append(dict(size=label, recompute=name, measured=statistics.median(times[name]) / 1e3,
                             predicted=mine.step_seconds, preset=theirs.step_seconds, peak=peak,
                             predicted_bytes=mine.memory.total, breakdown=dict(mine.breakdown.items()),
                             tflops=mine.model_flops / (statistics.median(times[name]) / 1e3) / 1e12))
        del steps, made
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _peak_bytes(step, device, module, opt) -> int:
    """This variant's peak bytes on ``device`` during one ``step()``: its parameters and optimizer state,
    plus what the step allocates above what was allocated before it (the other variants' models, held
    for the interleaved timing, stay out). 0 on a CPU, which keeps no such count."""
    if device.type != "cuda":
        step()
        return 0
    own = sum(t.numel() * t.element_size() for t in module.parameters())
    own += sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return own + torch.cuda.max_memory_allocated() - before


def layer_bytes(args, mesh, device) -> list:
    """A layer's saved activation bytes in bf16 (manual attention, dropout 0.1) against the paper's."""
    import autoshard
    from autoshard.models.gpt import GPT
    from benchmarks.memory import _saved_bytes
    s, b, h, a = (32, 2, 64, 4) if args.smoke else (1024, 2, 1024, 16)
    ids = torch.randint(0, args.vocab, (b, s), device=device)
    rows = []
    for name, recompute in (("TP", False), ("TP + selective", "selective")):
        saved = {}
        for layers in (1, 2):
            torch.manual_seed(0)
            cfg = _config(dict(n_layer=layers, n_embd=h, n_head=a, block_size=s), args.vocab,
                          flash=False, tie_weights=False)
            cfg.dropout = 0.1
            pm = autoshard.parallelize(GPT(cfg).train(), mesh, (ids, ids), loss_only=True, mixed_precision="bf16",
                                       recompute=recompute, loss_chunk_rows=None, fuse=args.fuse)
            saved[layers], _ = _saved_bytes(pm, ids, ids)
            del pm
        paper = s * b * h * (34 + (0 if recompute else 5 * a * s / h))
        rows.append(dict(variant=name, measured=saved[2] - saved[1], paper=paper, s=s, b=b, h=h, a=a))
    return rows


def markdown(cluster, preset, rows, layers, args) -> str:
    gib = 2 ** 30
    lines = ["# The planner on one GPU (`python -m benchmarks.gpu_planner`)", "",
             f"Device: {_device_name()}, torch {torch.__version__}. autoshard in bf16 mixed "
             f"precision (fp32 master weights), fuse={args.fuse}, AdamW(fused), median of {args.steps} interleaved "
             "steps. Predictions: `autoshard.planner.predict` at dp = pp = tp = 1, m = 1, SDPA attention.", "",
             "| cluster | bf16 GEMM peak TFLOP/s | max efficiency | half at dim | memory GB/s |",
             "|---|---|---|---|---|"]
    for c in (cluster, preset):
        lines.append(f"| {c.name} | {c.peak_flops / 1e12:.0f} | {c.gemm_max_efficiency:.2f} | {c.gemm_half_dim:.0f} "
                     f"| {c.hbm_bandwidth / 1e9:.0f} |")
    lines += ["", "Measured GEMM TFLOP/s, (n x n) @ (n x n): " + ", ".join(f"{n}: {r / 1e12:.1f}" for n, r in args.gemms)]
    lines += ["", "| model (b) | recompute | measured ms | predicted, measured cluster | error | predicted, preset "
              "| error | model TFLOP/s | peak GiB | predicted GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        base.setdefault(r["size"], r["measured"])
        lines.append(f"| {r['size']} ({SIZES[r['size']]['batch']}) | {r['recompute']} ({r['measured'] / base[r['size']]:.2f}x"
                     f" none) | {r['measured'] * 1e3:.1f} | {r['predicted'] * 1e3:.1f} | "
                     f"{r['predicted'] / r['measured'] - 1:+.1%} | {r['preset'] * 1e3:.1f} | "
                     f"{r['preset'] / r['measured'] - 1:+.1%} | {r['tflops']:.0f} | {r['peak'] / gib:.2f} | "
                     f"{r['predicted_bytes'] / gib:.2f} |")
    if layers:
        r0 = layers[0]
        lines += ["", f"Activation bytes one layer saves, bf16, manual attention, dropout 0.1, s={r0['s']} b={r0['b']} "
                  f"h={r0['h']} a={r0['a']}, against the paper's 16-bit sbh(34 + 5as/h) (selective: 34 sbh):", "",
                  "| variant | measured MiB | paper MiB | measured / paper |", "|---|---|---|---|"]
        for r in layers:
            lines.append(f"| {r['variant']} | {r['measured'] / 2**20:.1f} | {r['paper'] / 2**20:.1f} | "
                         f"{r['measured'] / r['paper']:.3f} |")
    return "\n".join(lines) + "\n"


def _device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (a smoke run)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--fuse", default="auto", type=lambda v: False if v == "off" else v)
    ap.add_argument("--no-layer-bytes", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="on the CPU at toy sizes: checks the script, measures nothing")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    from autoshard.planner import DGX_H100, Cluster
    if args.smoke:
        device, gemm_sizes, args.steps, args.vocab = torch.device("cpu"), (64, 128), 1, 128
        SIZES.update({k: dict(n_layer=2, n_embd=64, n_head=4, block_size=32, batch=2) for k in SIZES})
    elif not torch.cuda.is_available():
        print("gpu_planner: no CUDA device (--smoke runs the script on the CPU)")
        return 2
    else:
        device, gemm_sizes = torch.device("cuda", 0), (256, 512, 1024, 2048, 4096, 8192)
        torch.cuda.set_device(device)
    mesh = one_rank_mesh(device.type)
    cluster = Cluster.measure(f"measured ({_device_name()})", sizes=gemm_sizes)
    print(f"measured: peak {cluster.peak_flops / 1e12:.0f} TFLOP/s, efficiency {cluster.gemm_max_efficiency:.2f}, "
          f"half {cluster.gemm_half_dim:.0f}, memory {cluster.hbm_bandwidth / 1e9:.0f} GB/s", flush=True)
    from autoshard.planner.cluster import _gemm_rate
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.gemms = [(n, _gemm_rate((n, n, n), dtype, device, 3)) for n in gemm_sizes]
    print("GEMM TFLOP/s by cube size: " + ", ".join(f"{n}: {r / 1e12:.1f}" for n, r in args.gemms), flush=True)
    layers = [] if args.no_layer_bytes else layer_bytes(args, mesh, device)
    rows = steps_against_predictions(args, mesh, device, cluster, DGX_H100)
    text = markdown(cluster, DGX_H100, rows, layers, args)
    print(text)
    if args.out != "none":
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_planner.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
