"""Tier 2: tensor-parallel training equals the single-device model (multi-process gloo).

Each rank builds the same model, parallelizes it, and compares with a single-device copy: the loss,
the logits, every gathered gradient (relative 1e-5, fp32), then the parameters after 5 AdamW steps.
One process group runs all model variants for one tp size, to pay the process start-up once.
"""
import copy

import pytest

import autoshard
from autoshard.ir.placement import Replicate
from tests.harness.distributed import run_distributed
from tests.harness.parity_checks import adamw_errors, gradient_errors, rel
from tests.harness.models import batch, build, loss_and_logits

VARIANTS = [
    ("gpt", dict(fused_qkv=True, tie_weights=True, vocab_size=96)),
    ("gpt", dict(fused_qkv=True, tie_weights=True, vocab_size=97)),     # vocab padded to a multiple of tp
    ("gpt", dict(fused_qkv=False, tie_weights=False, vocab_size=96, bias=False)),
    ("gpt", dict(fused_qkv=False, tie_weights=True, vocab_size=95, flash=False)),  # manual attention, mask buffer
    ("hf", dict(vocab_size=101)),                                        # Conv1D, fused c_attn, padded vocab
    ("hf", dict(vocab_size=100, attn="eager")),                         # HF's eager attention
    ("gpt", dict(vocab_size=97, loss_only=True)),                        # loss overwrites its logits in place
    ("gpt", dict(vocab_size=96, pins={"transformer.h.0.mlp.c_fc.weight": Replicate()})),  # off Megatron's path
]


def _check_variant(kind, cfg, tp, steps=5):
    cfg = dict(cfg)
    loss_only = cfg.pop("loss_only", False)
    pins = cfg.pop("pins", None)
    model = build(kind, **cfg)
    ref = copy.deepcopy(model)
    args, kwargs = batch(kind, cfg["vocab_size"])
    mesh = autoshard.init_mesh(tp=tp)
    pm = autoshard.parallelize(model, mesh, example_args=args, example_kwargs=kwargs, loss_only=loss_only,
                                pins=pins)
    errs = {}

    loss, logits = loss_and_logits(kind, pm(*args, **kwargs))
    rloss, rlogits = loss_and_logits(kind, ref(*args, **kwargs))
    errs["loss"] = rel(loss.detach(), rloss.detach())
    if loss_only:
        assert logits is None
    else:
        errs["logits"] = rel(logits.detach(), rlogits.detach())
    loss.backward()
    rloss.backward()
    errs |= gradient_errors(pm, ref)

    def step():
        loss_and_logits(kind, pm(*args, **kwargs))[0].backward()
        loss_and_logits(kind, ref(*args, **kwargs))[0].backward()
    return errs | adamw_errors(pm, ref, step, steps)


def _parity(rank, world, variants):
    return [_check_variant(kind, cfg, world) for kind, cfg in variants]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parity_with_single_device(tp):
    variants = VARIANTS if tp > 1 else VARIANTS[:1] + VARIANTS[-1:]
    results = run_distributed(_parity, tp, variants, timeout=600)
    for rank, per_variant in enumerate(results):
        for (kind, cfg), errs in zip(variants, per_variant):
            bad = {k: v for k, v in errs.items() if not v <= 1e-5}
            assert not bad, f"tp={tp} rank {rank} {kind} {cfg}: relative errors above 1e-5: {bad}"
            assert len(errs) > 10  # loss, logits, every gradient, every parameter were compared
