"""Dropout on a pipeline (``runtime/stage_rng.py``), on 2 gloo ranks: pm.step moves every rank's global RNG by
one draw (before, each stage advanced it by its own draws and the ranks drifted apart), a step is
reproducible from the seed, and the two stages' streams differ."""
import copy

import torch

import autoshard
from autoshard.runtime.stage_rng import stage_seed
from tests.harness.distributed import run_distributed
from tests.harness.models import batch, build


def _steps(rank, world):
    model = build("gpt", vocab_size=96, n_layer=2, dropout=0.2)
    (idx, tgt), _ = batch("gpt", 96, B=4)
    torch.manual_seed(7)
    pm = autoshard.parallelize(copy.deepcopy(model), autoshard.init_mesh(pp=world), (idx, tgt), microbatches=2,
                               recompute=True)
    losses, kept = [], True
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        losses.append(float(pm.step(idx, tgt)))
        after = torch.get_rng_state()
        torch.manual_seed(seed)
        torch.randint(0, 1 << 62, (), dtype=torch.int64)
        kept &= torch.equal(after, torch.get_rng_state())     # one draw of the user's stream a step
        pm.zero_grad()
    states = [None] * world
    torch.distributed.all_gather_object(states, torch.get_rng_state())
    return dict(losses=losses, kept=kept, same_state=all(torch.equal(s, states[0]) for s in states),
                seed=stage_seed(12345, rank))


def test_a_pipeline_keeps_the_global_stream_and_draws_a_stream_per_stage():
    results = run_distributed(_steps, 2, timeout=300)
    for r in results:
        assert r["kept"] and r["same_state"]
    losses = results[0]["losses"]
    assert losses == results[1]["losses"]           # the step's loss on every rank
    assert losses[0] == losses[1] != losses[2]      # reproducible from the seed; another seed, other masks
    assert results[0]["seed"] != results[1]["seed"]
