"""The training helpers on every rank of a simulated mesh (fast; the gloo versions are in
test_training_loop.py): the global gradient norm of every order, and one decision for a non-finite norm."""
import copy
import math

import pytest
import torch

import autoshard
from autoshard.ir.mesh import MeshSpec
from autoshard.runtime.module import ParallelModule
from tests.harness.models import batch, build
from tests.harness.simulate import run_ranks


def _grads_on_ranks(t, body, **cfg):
    model = build("gpt", **cfg)
    args, _ = batch("gpt", cfg.get("vocab_size", 96))
    programs = [autoshard.compile_rank(model, {"tp": t}, r, args) for r in range(t)]

    def rank(r, comms):
        pm = ParallelModule(programs[r], model, comms)
        pm(*copy.deepcopy(args))[1].backward()
        return body(r, pm)
    return model, args, run_ranks(MeshSpec(tp=t), rank)


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_global_norm_and_clipping_match_the_single_device_model(t, norm_type):
    max_norm = 0.01

    def body(r, pm):
        norm = pm.clip_grad_norm_(max_norm, norm_type)
        return float(norm), {n: pm.gather(n, p.grad) for n, p in pm.local_parameters().items()}

    model, args, out = _grads_on_ranks(t, body, vocab_size=97)   # a padded vocab shard too
    ref = copy.deepcopy(model)
    ref(*args)[1].backward()
    rnorm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type))
    grads = dict(ref.named_parameters(remove_duplicate=False))   # tied names too
    for norm, clipped in out:
        assert norm == pytest.approx(rnorm, rel=1e-5)
        for name, g in clipped.items():
            torch.testing.assert_close(g, grads[name].grad, rtol=1e-4, atol=1e-8)


def test_a_non_finite_norm_stops_every_rank():
    """An inf in one rank's shard only: the norm is all-reduced, so every rank sees it and raises."""
    def body(r, pm):
        if r == 1:
            p = pm.local_parameters()["transformer.h.0.mlp.c_fc.weight"]   # sharded
            p.grad[0, 0] = float("inf")
        try:
            pm.clip_grad_norm_(1.0, error_if_nonfinite=True)
            return None
        except RuntimeError as e:
            return str(e)

    _, _, out = _grads_on_ranks(2, body)
    assert all(msg and "non-finite" in msg for msg in out), out


def test_check_replicas_in_the_simulator():
    def body(r, pm):
        if r == 0:
            with torch.no_grad():
                pm.local_parameters()["transformer.ln_f.weight"].add_(1.0)
        try:
            pm.check_replicas()
            return None
        except RuntimeError as e:
            return str(e)

    _, _, out = _grads_on_ranks(2, body)
    assert all(msg and "transformer.ln_f.weight" in msg for msg in out), out
