"""Checkpoint runs on gloo ranks (tests/distributed/test_checkpoint.py): resume and reshard through autoshard.save/load."""
from __future__ import annotations

import torch

import autoshard
from tests.harness.models import batch, build


def _train(mesh, steps, start=0, path=None, save_at=None, zero=0, load_from=None):
    device_mesh = autoshard.init_mesh(**mesh)
    model = build("gpt", n_layer=4)
    args, _ = batch("gpt", 96, B=8, seed=1)
    pm = autoshard.parallelize(model, device_mesh, *autoshard.local_batch((args, {}), device_mesh),
                               microbatches=2, zero=zero)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2, eps=1e-4, weight_decay=0.1)
    if load_from:
        start = autoshard.load(pm, opt, load_from)
    losses = []
    for step in range(start, steps):
        torch.manual_seed(100 + step)      # the step's own randomness (as a data loader's would be)
        args, _ = batch("gpt", 96, B=8, seed=10 + step)
        loss = pm.step(*autoshard.local_batch((args, {}), device_mesh)[0])
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if save_at == step + 1:
            autoshard.save(pm, opt, path, step=step + 1)
    return losses, pm.full_state_dict()


def resume_and_reshard(rank, world, path, zero):
    """Uninterrupted 5 steps; 2 steps, save, and 3 more from a fresh model loaded from the checkpoint on
    the same mesh; and a load on another mesh (dp=2 x pp=2 -> pp=2 x tp=2)."""
    mesh = dict(dp=2, pp=2)
    straight, final = _train(mesh, 5, path=path, save_at=2, zero=zero)
    resumed, final_resumed = _train(mesh, 5, load_from=path, zero=zero)
    other, _ = _train(dict(pp=2, tp=2), 4, load_from=path)      # steps 3 and 4: the optimizer state too
    same = all(torch.equal(final[k], final_resumed[k]) for k in final)
    return dict(straight=straight, resumed=resumed, other=other, same_params=same)


def interrupted_save_is_refused(rank, world, path):
    """A directory without meta.json (a save that died before its rename) is not taken for a checkpoint."""
    import os
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    try:
        _train(dict(pp=2, tp=2), 1, load_from=path)
    except FileNotFoundError as e:
        return str(e)
    return None


def suite(rank, world, path):
    return dict(zero=resume_and_reshard(rank, world, path, 1),
                refused=interrupted_save_is_refused(rank, world, path + "_broken"))
