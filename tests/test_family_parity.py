"""Tier 2 for HF families: tp=2 training over real gloo collectives equals the single-device model.

GPT-NeoX, Llama, BLOOM, Falcon (multi-query), Qwen2 (GQA, q/k/v biases) and Phi-3 (fused q|k|v and
gate|up, sliced) from ``tests/families.py``
(2 layers, hidden 64, 4 heads, vocab 97 so tp pads it), called with ``input_ids=, labels=,
attention_mask=, use_cache=False``. Per family: the loss, the logits, every gradient gathered to its
full shape (relative 1e-5, test_parity.py's floor for analytically zero gradients), then the parameters
after 3 AdamW steps (eps=1e-4, as test_parity.py explains) through ``pm.full_state_dict()``. One process
group runs all six families, to pay the start-up once.
"""
from __future__ import annotations

import copy

import autoshard
from tests.distributed import run_distributed
from tests.families import EAGER_ONLY, GQA, FamilyConfig, batch, build, rel
from tests.parity_checks import adamw_errors, gradient_errors

FAMILIES = ["gpt_neox", "llama", "bloom", "falcon", "qwen2", "phi3"]
TP = 2
STEPS = 3


def config(family: str) -> FamilyConfig:
    """Phi-3 as Phi-3-mini is: as many kv heads as heads, so its sliced q|k|v is cut per block."""
    kv_heads = 2 if family in GQA and family != "phi3" else None
    return FamilyConfig(family, layers=2, hidden=64, heads=4, kv_heads=kv_heads, vocab=97,
                        attn_implementation="eager" if family in EAGER_ONLY else "sdpa")


def _check_family(cfg: FamilyConfig, tp: int, steps: int = STEPS) -> dict:
    model = build(cfg)
    ref = copy.deepcopy(model)
    kwargs = batch(cfg.vocab)
    mesh = autoshard.init_mesh(tp=tp)
    pm = autoshard.parallelize(model, mesh, example_kwargs=kwargs)
    errs = {}

    out, rout = pm(**copy.deepcopy(kwargs)), ref(**copy.deepcopy(kwargs))
    errs["loss"] = rel(out.loss, rout.loss)
    errs["logits"] = rel(out.logits, rout.logits)
    out.loss.backward()
    rout.loss.backward()
    errs |= gradient_errors(pm, ref)

    def step():
        pm(**copy.deepcopy(kwargs)).loss.backward()
        ref(**copy.deepcopy(kwargs)).loss.backward()
    return errs | adamw_errors(pm, ref, step, steps)


def _parity(rank, world, families):
    return [_check_family(config(f), world) for f in families]


def test_family_parity_tp2():
    results = run_distributed(_parity, TP, FAMILIES, timeout=300)
    for rank, per_family in enumerate(results):
        for family, errs in zip(FAMILIES, per_family):
            bad = {k: v for k, v in errs.items() if not v <= 1e-5}
            assert not bad, f"tp={TP} rank {rank} {family}: relative errors above 1e-5: {bad}"
            assert sum(k.startswith("grad ") for k in errs) >= 10 and sum(k.startswith("after") for k in errs) >= 10
