"""An MoE trained with its router's auxiliary loss, on a pipeline: cuts that carry the router logits
against cuts where only the residual stream crosses.

    python -m benchmarks.pp_moe [--pp 2] [--layers 8] [--hidden 256] [--seq 128] [--batch 8] [--reps 6]

HF's MoE models keep every layer's router logits until the loss when ``output_router_logits=True`` (how
Mixtral, Qwen-MoE and OLMoE are trained with the load-balancing loss). With cuts restricted to places
where only the residual stream is live (autoshard before ``CARRIED_FRACTION``), the one legal cut is
before the first router, so stage 0 gets one attention layer and the last stage everything else. With
carried values the balancer can cut after any layer. Both variants train a Mixtral of the same weights
on the same batch; the losses must agree before anything is timed. Runs are interleaved (A B A B) in
one process tree; a step's time is the slowest rank's. Writes ``pp_moe_results.md`` to ``--out``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from autoshard.launcher import launch
from benchmarks.chunked_loss import OUT


def _rank(rank, world, job):
    import transformers as T

    import autoshard
    from autoshard.passes import pipeline_split
    if job["residual_only"]:
        pipeline_split.CARRIED_FRACTION = 0.0      # nothing may cross beside the stream: the old rule
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    cfg = T.MixtralConfig(vocab_size=job["vocab"], hidden_size=job["hidden"], intermediate_size=2 * job["hidden"],
                          num_hidden_layers=job["layers"], num_attention_heads=max(1, job["hidden"] // 32),
                          num_key_value_heads=max(1, job["hidden"] // 64), max_position_embeddings=job["seq"],
                          num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                          router_aux_loss_coef=0.01)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, job["vocab"], (job["batch"], job["seq"]), generator=g)
    if device is not None:
        ids = ids.to(device)
    kw = dict(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    pm = autoshard.parallelize(model, autoshard.init_mesh(pp=world), (), kw, microbatches=job["microbatches"])
    loss = float(pm.step(**kw))
    times = []
    for _ in range(job["reps"]):
        if device is not None:
            torch.cuda.synchronize()
        start = time.perf_counter()
        pm.step(**kw)
        if device is not None:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    plan = pm.program.plan
    return dict(loss=loss, times=times, layers=[list(c.layers) for c in plan.costs], predicted=plan.predicted_step,
                carried=[len(c) for c in plan.carried])


def run(args) -> dict:
    out = {}
    base = dict(layers=args.layers, hidden=args.hidden, seq=args.seq, batch=args.batch, vocab=args.vocab,
                microbatches=args.microbatches, reps=args.reps)
    rounds = {"carried": [], "residual only": []}
    for _ in range(args.rounds):
        for name in rounds:
            ranks = launch(_rank, args.pp, dict(base, residual_only=name == "residual only"), timeout=900)
            rounds[name].append(ranks)
    for name, runs in rounds.items():
        steps = [max(r["times"][i] for r in ranks) for ranks in runs for i in range(args.reps)]
        first = runs[0][0]
        out[name] = dict(loss=first["loss"], fastest=min(steps), median=statistics.median(steps),
                         layers=first["layers"], predicted=first["predicted"], carried=first["carried"])
    if out["carried"]["loss"] != out["residual only"]["loss"]:
        raise RuntimeError(f"the losses differ: {out}")
    return dict(config=dict(base, pp=args.pp, device="cuda" if torch.cuda.is_available() else "cpu"), variants=out)


def markdown(r: dict) -> str:
    v = r["variants"]
    rows = [f"| {k} | {x['layers']} | {x['carried']} | {x['predicted'] * 1e3:.0f} | {x['fastest'] * 1e3:.0f} | "
            f"{x['median'] * 1e3:.0f} |" for k, x in v.items()]
    ratio = v["carried"]["median"] / v["residual only"]["median"]
    return "\n".join([
        "# MoE with its router auxiliary loss on a pipeline", "", f"Config: {r['config']}; loss "
        f"{v['carried']['loss']:.6f} in both", "",
        "| cuts | layers per stage | values carried per cut | predicted ms | fastest ms | median ms |",
        "|---|---|---|---|---|---|", *rows, "",
        f"Carrying the router logits: {ratio:.2f}x the step time of residual-only cuts (medians).", ""])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds, each a fresh process tree per variant")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    r = run(args)
    text = markdown(r)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pp_moe_results.md"), "w") as f:
        f.write(text)
    print(text)
    return r


if __name__ == "__main__":
    main()
