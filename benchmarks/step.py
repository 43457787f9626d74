"""A rank's whole training step: autoshard against eager and ``torch.compile`` on one rank.

    python -m benchmarks.step                      # CPU: the host-overhead figure (small GPT, one thread)
    python -m benchmarks.step --device cuda        # GPU: the GPT and HF Llama in bf16, step ms / tok/s / MFU
    python -m benchmarks.step --steps 30 --out DIR

**CPU (host overhead).** A small model (the built-in GPT's default config: 4 layers, ``n_embd`` 64, 52
parameters) on one rank (a one-process gloo group, so the parameters are DTensors as on any real mesh)
and one intra-op thread, where the step's time is mostly the host's: Python, dispatch, autograd. The
variants run interleaved step by step (A B C A B C ...), so the machine's noise hits all alike:

- ``eager``: ``model(idx, targets)`` + ``backward()``;
- ``pm(...)``: ``pm(idx, targets)`` + ``backward()`` (``loss_only=True``), the README's standard loop;
- ``pm.step``: ``pm.step(idx, targets)``;
- ``pm(...)`` with ``codegen="inductor"`` (the program through torch.compile);
- each again with ``AdamW(fused=True)``'s ``step`` + ``zero_grad`` (the optimizer a user would pick).

It also counts, per call, DTensor's autograd wrappings (``DTensor.from_local`` / ``to_local``), the
host cost the issue measured at 0.16 ms per parameter per step.

**GPU.** The built-in GPT and an HF Llama at GPU sizes, bf16 compute with fp32 master weights, one
rank, ``AdamW(fused=True)``: eager under autocast, ``torch.compile(model)`` under autocast, and
autoshard (``mixed_precision="bf16"``, ``loss_only=True``) with ``fuse`` on and off, and with
``codegen="inductor"``. Columns: step ms
(median), tokens/s, MFU (6·N·tokens plus attention's 12·L·h·s·tokens over the chip's bf16 peak), peak
memory, time to the first step. ``--profile`` lists the step's top GPU kernels and flags any fp32 SIMT
GEMM (``sgemm``/``simt`` in a kernel's name).

Writes ``step_results.md`` (and ``.json``) into ``--out`` (default ``benchmarks/results``).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}   # dense bf16 tensor-core flop/s (SXM datasheets)


@dataclass
class Row:
    model: str
    variant: str
    median_ms: float
    min_ms: float
    ratio: float = 1.0              # median over the baseline's median (eager on CPU, torch.compile on GPU)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    peak_gib: float = 0.0
    first_step_s: float = 0.0
    dtensor_wraps_per_call: float = 0.0
    notes: list = field(default_factory=list)


# --- counting DTensor's per-parameter wrapping --------------------------------------------------------
class WrapCounter:
    """Counts calls of ``DTensor.from_local`` and ``DTensor.to_local`` while active (patched on the class:
    every path to DTensor's autograd wrapping goes through one of the two)."""

    def __init__(self):
        from torch.distributed.tensor import DTensor
        self.cls, self.calls = DTensor, 0

    def __enter__(self):
        self._saved = {}
        for name in ("from_local", "to_local"):
            original = getattr(self.cls, name)
            self._saved[name] = self.cls.__dict__[name]

            def counted(*a, _f=original, **k):
                self.calls += 1
                return _f(*a, **k)
            setattr(self.cls, name, staticmethod(counted) if isinstance(self._saved[name], staticmethod)
                    else counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(self.cls, name, original)


# --- one process group of one rank --------------------------------------------------------------------
def one_rank_mesh(device: str = "cpu"):
    """A world of one process (so parameters are DTensors, as on any real mesh) and its mesh."""
    import torch.distributed as dist

    import autoshard
    from autoshard.launcher import _free_port
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    return autoshard.init_mesh(tp=1)


def _timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def interleaved(variants: dict, steps: int, warmup: int, device) -> dict:
    """Median and min ms per variant, run A B C A B C ... after ``warmup`` rounds."""
    times = {k: [] for k in variants}
    for i in range(warmup + steps):
        for name, fn in variants.items():
            t = _timed(fn, device)
            if i >= warmup:
                times[name].append(t)
    return times


# --- CPU: host overhead ---------------------------------------------------------------------------------
def cpu_host(args) -> list:
    import autoshard
    from autoshard.models import GPT, GPTConfig
    torch.set_num_threads(1)
    mesh = one_rank_mesh()
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.hidden, n_head=4, vocab_size=args.vocab,
                    block_size=args.seq)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    tgt = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    pm = autoshard.parallelize(model, mesh, (idx, tgt), loss_only=True)
    pmi = autoshard.parallelize(copy.deepcopy(model), mesh, (idx, tgt), loss_only=True, codegen="inductor")
    nparams = sum(1 for _ in model.parameters())
    opt_eager = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    opt_pm = torch.optim.AdamW(pm.parameters(), lr=1e-4, fused=True)

    def eager():
        model(idx, tgt)[1].backward()
        model.zero_grad(set_to_none=True)

    def pm_call():
        pm(idx, tgt)[1].backward()
        pm.zero_grad(set_to_none=True)

    def pm_step():
        pm.step(idx, tgt)
        pm.zero_grad(set_to_none=True)

    def with_opt(fwd_bwd, opt):
        def run():
            fwd_bwd_only[fwd_bwd]()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    def pmi_call():
        pmi(idx, tgt)[1].backward()
        pmi.zero_grad(set_to_none=True)

    fwd_bwd_only = {
        "eager": lambda: model(idx, tgt)[1].backward(),
        "pm": lambda: pm(idx, tgt)[1].backward(),
        "step": lambda: pm.step(idx, tgt),
    }
    variants = {"eager fwd+bwd": eager, "pm(...) + backward": pm_call, "pm.step": pm_step,
                "pm(...) + backward, codegen='inductor'": pmi_call,
                "eager + AdamW(fused)": with_opt("eager", opt_eager),
                "pm(...) + backward + AdamW(fused)": with_opt("pm", opt_pm),
                "pm.step + AdamW(fused)": with_opt("step", opt_pm)}
    wraps = {}
    for name, fn in (("pm(...) + backward", pm_call), ("pm.step", pm_step)):
        fn()            # compiled and warm
        with WrapCounter() as c:
            fn()
        wraps[name] = c.calls
    times = interleaved(variants, args.steps, args.warmup, torch.device("cpu"))
    rows = []
    for name, ts in times.items():
        base = "eager + AdamW(fused)" if "AdamW" in name else "eager fwd+bwd"
        rows.append(Row("gpt-small (52 params)" if nparams == 52 else f"gpt ({nparams} params)", name,
                        statistics.median(ts), min(ts), statistics.median(ts) / statistics.median(times[base]),
                        dtensor_wraps_per_call=wraps.get(name, 0)))
    return rows


# --- GPU: the whole step against torch.compile ----------------------------------------------------------
def _gpu_models(args):
    from autoshard.models import GPT, GPTConfig
    out = {}

    def gpt():
        return GPT(GPTConfig(n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 128,
                             vocab_size=args.vocab, block_size=args.seq, dropout=0.0))
    out["gpt"] = (gpt, False)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        def llama():
            return LlamaForCausalLM(LlamaConfig(
                hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 256 * 256,
                num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                num_key_value_heads=max(1, args.hidden // 512), vocab_size=args.vocab,
                max_position_embeddings=args.seq, attn_implementation="sdpa"))
        out["llama"] = (llama, True)
    except ImportError:
        pass
    return out


def variant_options(variant: str) -> dict:
    """``parallelize`` options of a variant named like ``"autoshard recompute=selective fuse=False"``: each
    ``key=value`` after the name is an option (a Python literal where it reads as one: ``False``,
    ``None``, ``2048``, ``1e9``; else the string), a bare word is ``word=True`` (``cuda_graphs``); the
    defaults are ``fuse="auto"`` and autoshard's own codegen (the call sets ``loss_only`` and
    ``mixed_precision``)."""
    import ast
    options = dict(fuse="auto", codegen="autoshard")
    for word in variant.split()[1:]:
        key, _, value = word.partition("=")
        if key in ("loss_only", "mixed_precision"):
            raise ValueError(f"variant {variant!r}: {key} is the benchmark's own setting")
        if not value:
            options[key] = True
            continue
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


def _flops_per_step(model, cfg_layers, hidden, seq, tokens) -> float:
    n = sum(p.numel() for p in model.parameters())
    return 6 * n * tokens + 12 * cfg_layers * hidden * seq * tokens


def gpu_step(args) -> list:
    import autoshard
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    mesh = one_rank_mesh("cuda")
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in BF16_PEAK.items() if k in name), None)
    rows = []
    for label, (make, hf) in _gpu_models(args).items():
        if args.models and label not in args.models:
            continue
        torch.manual_seed(0)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
        call = (lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss) if hf else (lambda m: m(ids, ids)[1])
        tokens = args.batch * args.seq
        variants = {}
        for variant in args.variants:
            torch.manual_seed(0)
            model = make()
            flops = _flops_per_step(model, args.layers, args.hidden, args.seq, tokens)
            if variant.startswith("autoshard"):
                example = dict(input_ids=ids, labels=ids, use_cache=False) if hf else None
                pm = autoshard.parallelize(model, mesh, () if hf else (ids, ids), example, loss_only=True,
                                           mixed_precision="bf16", **variant_options(variant))
                module, fwd = pm, (lambda pm=pm: call(pm))
            else:
                model = model.to(device)
                module = model
                runner = torch.compile(model) if variant == "torch.compile" else model

                def fwd(runner=runner):
                    with torch.autocast("cuda", torch.bfloat16):
                        return call(runner)
            opt = torch.optim.AdamW(module.parameters(), lr=1e-5, fused=True)

            def step(fwd=fwd, opt=opt):
                fwd().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            variants[variant] = (step, time.perf_counter() - start, flops, module)
        torch.cuda.reset_peak_memory_stats()
        times = interleaved({k: v[0] for k, v in variants.items()}, args.steps, args.warmup, device)
        base = statistics.median(times.get("torch.compile", next(iter(times.values()))))
        for variant, ts in times.items():
            step, first, flops, module = variants[variant]
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            med = statistics.median(ts)
            row = Row(label, variant, med, min(ts), med / base, tokens / (med / 1e3),
                      flops / (med / 1e3) / peak if peak else 0.0, torch.cuda.max_memory_allocated() / 2 ** 30, first)
            if args.profile:
                row.notes = _profile(step)
            if args.host_profile:
                row.notes += _host_profile(step)
            rows.append(row)
        del variants
        torch.cuda.empty_cache()
    return rows


def _host_profile(step, steps: int = 3, top: int = 10) -> list:
    """Where the host's time goes: cProfile over ``steps`` steps (synchronized at the end), the ``top``
    functions by their own time, ms a step. A step whose wall time exceeds its GPU busy time is the
    host's: this names the Python or dispatch that keeps the GPU waiting (a ``synchronize`` or ``item``
    high in the list is a sync that stops the host from running ahead)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    total = sum(v[2] for v in stats.values()) / steps * 1e3
    notes = [f"host: {total:.2f} ms/step of Python's own time in all functions"]
    for (file, line, name), (_, calls, own, cum, _) in rows:
        where = f"{os.path.basename(file)}:{line}({name})" if file != "~" else name
        notes.append(f"host {where[:70]}: {own / steps * 1e3:.2f} ms/step own, {cum / steps * 1e3:.2f} cum, "
                     f"{calls // steps} calls")
    return notes


def _profile(step) -> list:
    """The step's GPU busy time and launches, its top eight kernels by time, and every fp32 SIMT GEMM."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    busy = sum(e.device_time_total for e in events) / 3e3
    launches = sum(e.count for e in events) / 3
    notes = [f"GPU busy {busy:.2f} ms/step in {launches:.0f} kernels and copies a step"]
    notes += [f"{e.key[:60]}: {e.device_time_total / 3e3:.2f} ms/step ({e.count // 3} a step)" for e in events[:8]]
    simt = [e.key for e in events if "simt" in e.key.lower() or "sgemm" in e.key.lower()]
    notes.append(f"fp32 SIMT GEMMs: {simt or 'none'}")
    return notes


# --- report ---------------------------------------------------------------------------------------------
def write(rows, args, device_name):
    os.makedirs(args.out, exist_ok=True)
    base = "eager" if args.device == "cpu" else "torch.compile"
    lines = [f"# A rank's step ({device_name}, torch {torch.__version__})", "",
             f"`python -m benchmarks.step {' '.join(args.argv)}`; ratio = median / {base}'s median "
             "(with the optimizer, against eager's with the same optimizer).", "",
             "| model | variant | median ms | min ms | ratio | tok/s | MFU | peak GiB | first step s | "
             "DTensor wraps/call |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.variant} | {r.median_ms:.2f} | {r.min_ms:.2f} | {r.ratio:.3f} | "
                     f"{r.tokens_per_s:,.0f} | {r.mfu:.1%} | {r.peak_gib:.2f} | {r.first_step_s:.1f} | "
                     f"{r.dtensor_wraps_per_call:.0f} |")
    for r in rows:
        for n in r.notes:
            lines.append(f"- {r.model} / {r.variant}: {n}")
    text = "\n".join(lines) + "\n"
    suffix = "" if args.device == "cpu" else "_gpu"
    with open(os.path.join(args.out, f"step_results{suffix}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, f"step_results{suffix}.json"), "w") as f:
        json.dump([asdict(r) for r in rows], f, indent=1)
    print(text)


def main(argv=None):
    import sys
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--variants", nargs="+", default=["eager", "torch.compile", "autoshard", "autoshard fuse=False",
                                                     "autoshard codegen=inductor",
                                                     "autoshard codegen=inductor cuda_graphs"])
    p.add_argument("--models", nargs="+", default=None, choices=["gpt", "llama"], help="GPU: which models (default both)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--host-profile", action="store_true", help="GPU: cProfile the host's side of the step")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    args.argv = argv
    cpu = args.device == "cpu"
    for k, (c, g) in dict(steps=(40, 20), layers=(4, 4), hidden=(64, 2048), vocab=(96, 32000), seq=(32, 1024),
                          batch=(4, 8)).items():
        if getattr(args, k) is None:
            setattr(args, k, c if cpu else g)
    rows = cpu_host(args) if cpu else gpu_step(args)
    write(rows, args, "CPU, 1 thread" if cpu else torch.cuda.get_device_name(0))


if __name__ == "__main__":
    main()
