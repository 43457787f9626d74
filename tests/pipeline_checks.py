"""Pipeline parity, run on gloo ranks: the loss and every gradient of ``pm.step`` against the single-device
model on the whole batch, then optimizer steps (shared by tests/test_pipeline.py and the demo checks)."""
from __future__ import annotations

import copy

import torch

import autoshard
from tests.models import batch, build, loss_and_logits


def ragged_batch(kind, vocab, B, T, seed):
    """A batch whose microbatches hold different numbers of ignored targets (-100)."""
    args, kwargs = batch(kind, vocab, B=B, T=T, seed=seed)
    labels = args[1] if kind == "gpt" else kwargs["labels"]
    labels[0, : T - 1] = -100          # the first row (microbatch 0) keeps one target
    labels[-1, : T // 2] = -100
    return args, kwargs


def pipeline_parity(rank, world, kind, mesh, options, cfg, steps=3, B=4, T=8):
    """Per step: |loss - ref| / |ref| and the largest gradient error (relative to the largest gradient);
    then the final parameters' error, and whether tied copies stayed bit-identical."""
    vocab = cfg.get("vocab_size", 96 if kind == "gpt" else 101)
    model = build(kind, **cfg)
    ref = copy.deepcopy(model)
    args, kwargs = ragged_batch(kind, vocab, B, T, seed=1)
    pm = autoshard.parallelize(model, autoshard.init_mesh(**mesh), args, kwargs, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-4)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
    losses, grads = [], []
    for step in range(steps):
        args, kwargs = ragged_batch(kind, vocab, B, T, seed=10 + step)
        loss = pm.step(*args, **kwargs)
        rloss = loss_and_logits(kind, ref(*args, **kwargs))[0]
        rloss.backward()
        losses.append(abs(float(loss) - float(rloss)) / abs(float(rloss)))
        rgrad = dict(ref.named_parameters(remove_duplicate=False))
        scale = max(float(p.grad.abs().max()) for p in ref.parameters())
        err = 0.0
        for name, p in pm.local_parameters().items():
            full = pm.gather(name, p.grad)
            err = max(err, float((full - rgrad[name].grad).abs().max()) / scale)
        grads.append(err)
        opt.step(); ropt.step(); opt.zero_grad(); ropt.zero_grad()
    full = pm.full_state_dict()
    scale = max(float(p.abs().max()) for p in ref.parameters())
    final = max(float((full[n] - p).abs().max()) / scale for n, p in ref.state_dict().items() if p.is_floating_point())
    tied = {}
    for name, p in pm.local_parameters().items():
        if name in pm.tie_groups:
            local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
            every = [torch.empty_like(local) for _ in range(2)]
            torch.distributed.all_gather(every, local.contiguous(), group=pm.tie_groups[name])
            tied[name] = bool(torch.equal(every[0], every[1]))
    return dict(losses=losses, grads=grads, final=final, tied=tied, ties=pm.program.ties(),
                exact=pm.program.loss.exact, stages=[c.index for c in pm.program.own])
