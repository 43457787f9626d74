"""``make demo``: train the built-in GPT on a small text with tensor parallelism over CPU processes.

    torchrun --standalone --nproc_per_node=2 -m autoshard.demo [--steps 40] [--dump autoshard_dump]
    torchrun --standalone --nproc_per_node=4 -m autoshard.demo --pp 2 --tp 2 [--microbatches 4]
    torchrun --standalone --nproc_per_node=4 -m autoshard.demo --dp 2 --pp 2 --zero 1 [--save ckpt]

With ``--pp`` the model is cut into pipeline stages and each step runs ``pm.step`` over microbatches
(``--schedule 1f1b|gpipe|interleaved``); with ``--dp`` each data-parallel rank steps on its rows of the
global batch (``--zero 1`` shards AdamW's state over dp). The tp size is the rest of the world
(``WORLD_SIZE / (dp * pp)``). With ``--save`` a checkpoint is written halfway.

Every rank trains the tensor-parallel program; rank 0 also trains the single-device model from the
same weights on the same batches and prints both losses side by side, so the equality is visible.
"""
from __future__ import annotations

import argparse
import copy
import os
import time
from importlib import resources

import torch
import torch.distributed as dist
from tqdm import tqdm

import autoshard
from autoshard.models import GPT, GPTConfig


def load_text():
    return resources.files("autoshard").joinpath("data/tiny_shakespeare.txt").read_text()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dump", default=os.environ.get("AUTOSHARD_DUMP", "autoshard_dump"))
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (ranks along pp)")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: WORLD_SIZE / pp)")
    ap.add_argument("--microbatches", type=int, default=4, help="microbatches per step when --pp > 1")
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    ap.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (interleaved: 2 unless more are given)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1], help="1: ZeRO-1 over dp")
    ap.add_argument("--save", default=None, help="write a checkpoint here halfway (autoshard.save)")
    ap.add_argument("--recompute", action="store_true", help="recompute each layer in backward (activation "
                    "checkpointing): less memory, one more forward")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    tp = args.tp or max(1, world_size // (args.pp * args.dp))
    mesh = autoshard.init_mesh(tp=tp, pp=args.pp, dp=args.dp)
    rank = dist.get_rank()
    text = load_text()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)

    torch.manual_seed(0)  # same weights on every rank
    cfg = GPTConfig(block_size=args.seq, vocab_size=len(chars), n_layer=args.layers, n_head=4, n_embd=64)
    model = GPT(cfg)
    ref = copy.deepcopy(model) if rank == 0 else None
    gen = torch.Generator().manual_seed(1)  # same batches on every rank

    def get_batch():
        ix = torch.randint(len(data) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([data[i:i + args.seq] for i in ix])
        return x, torch.stack([data[i + 1:i + 1 + args.seq] for i in ix])

    x, y = get_batch()
    start = time.perf_counter()
    pipelined = args.pp > 1 or args.dp > 1
    extra = dict(microbatches=args.microbatches, schedule=args.schedule, virtual_stages=args.virtual_stages,
                 zero=args.zero) if pipelined else {}
    pm = autoshard.parallelize(model, mesh, example_args=autoshard.local_batch((x, y), mesh), loss_only=True,
                               dump=args.dump, recompute=args.recompute, **extra)
    compile_s = time.perf_counter() - start
    opt = pm.optimizer(torch.optim.AdamW, lr=3e-3) if pipelined else torch.optim.AdamW(pm.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3) if ref is not None else None
    if rank == 0:
        print(f"autoshard: {cfg.n_layer}-layer GPT ({sum(p.numel() for p in model.parameters()):,} parameters, "
              f"vocab {cfg.vocab_size}) over dp={args.dp} x pp={args.pp} x tp={tp} gloo ranks"
              f"{' with ZeRO-1' if args.zero else ''}; compiled in {compile_s:.2f} s")
        if args.pp > 1:
            print(f"pipeline: {args.schedule}, {args.microbatches} microbatches; stages hold layers "
                  + ", ".join(str(list(c.layers)) for c in pm.program.plan.costs))
        print(f"{'step':>5} {'autoshard loss':>15} {'single-device':>14} {'|diff|':>9}")

    bar = tqdm(range(args.steps), disable=rank != 0, leave=False, desc="training")
    pm.reset_comm_counts()
    for step in bar:
        if step:
            x, y = get_batch()
        if pipelined:
            loss = pm.step(*autoshard.local_batch((x, y), mesh))   # this dp rank's rows; the global loss
        else:
            _, loss = pm(x, y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ref is not None:
            _, rloss = ref(x, y)
            rloss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            tqdm.write(f"{step:5d} {loss.item():15.6f} {rloss.item():14.6f} {abs(loss.item() - rloss.item()):9.2e}")
            # (the gap grows slowly: Adam turns fp32 rounding differences into step-sized updates)
        if args.save and step + 1 == args.steps // 2:
            autoshard.save(pm, opt, args.save, step=step + 1)   # every rank writes its own shards
            if rank == 0:
                tqdm.write(f"      checkpoint of step {step + 1} written to {os.path.abspath(args.save)}/ "
                           "(autoshard.load(pm, opt, path) resumes it, on this mesh or another)")
    calls = sum(pm.comm_counts()[0].values()) // max(args.steps, 1)
    if pipelined:   # a validation loss: eval mode, forward only, no gradients (every rank takes part)
        vx, vy = get_batch()
        val = pm.eval_batch(*autoshard.local_batch((vx, vy), mesh))
        if ref is not None:
            with torch.no_grad():
                _, rval = ref.eval()(vx, vy)
            print(f"validation loss (pm.eval_batch): {val.item():.6f}, single-device {rval.item():.6f}")
    state = pm.full_state_dict()  # collective: every rank takes part
    if rank == 0:
        single = GPT(cfg)
        single.load_state_dict(state)
        idx = torch.tensor([[stoi["\n"]]])
        with torch.no_grad():
            for _ in range(120):
                logits, _ = single(idx[:, -cfg.block_size:])
                nxt = torch.multinomial(torch.softmax(logits[:, -1], -1), 1, generator=gen)
                idx = torch.cat([idx, nxt], 1)
        print(f"\n{calls} collectives per step (tp, pp and dp groups); sample from the gathered weights:")
        print("".join(chars[i] for i in idx[0].tolist()))
        print(f"\npass dumps and plan.md written to {os.path.abspath(args.dump)}/ (other ranks in rank<N>/)"
              + ("; pipeline.md has the stages, the schedule and the timelines" if pipelined else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
