"""One HF family on a pp=2 gloo pipeline (``tests/test_family_pipeline.py``): loss, every gradient and the
eval-mode loss against the single-device model."""
from __future__ import annotations

import copy

import torch


def build_family(name: str):
    """``(model, vocab)``: a tiny random model of family ``name`` (``tests/families.py``,
    ``tests/test_more_families.py`` or ``tests/zoo.py``), dropouts 0."""
    import transformers as T

    from tests.families import GQA, FamilyConfig, build
    from tests.test_more_families import CASES
    from tests.zoo import ZOO, build_zoo
    if name in ZOO:
        return build_zoo(name), 128
    if name in CASES:
        config, attn = CASES[name]
        torch.manual_seed(0)
        return T.AutoModelForCausalLM.from_config(config(), attn_implementation=attn), 128
    cfg = FamilyConfig(name, layers=3, hidden=64, heads=4, kv_heads=2 if name in GQA else None, vocab=97,
                       attn_implementation="eager" if name in ("gptj", "bloom") else "sdpa")
    return build(cfg), 97


def pipeline_against_single_device(rank, world, name):
    import autoshard
    model, vocab = build_family(name)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, vocab, (4, 8), generator=g), torch.randint(0, vocab, (4, 8), generator=g)
    labels[0, :3] = -100                      # microbatch 0 holds fewer targets than microbatch 1
    kwargs = dict(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids), use_cache=False)
    ref = copy.deepcopy(model)
    want = ref(**kwargs).loss
    want.backward()
    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    pm = autoshard.parallelize(model, autoshard.init_mesh(pp=2), (), kwargs, microbatches=2)
    loss = float(pm.step(**kwargs))
    worst = 0.0
    for n, p in pm.named_parameters():
        if p.grad is not None:
            got = pm.gather(n, p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
            expect = ref_grads[n].grad
            worst = max(worst, float((got - expect).abs().max() / max(float(expect.abs().max()), 1e-6)))
    return dict(loss=loss, want=float(want), worst=worst, eval=float(pm.eval_batch(**kwargs)))
