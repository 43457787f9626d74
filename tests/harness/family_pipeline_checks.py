"""One HF family on a pp=2 gloo pipeline (``tests/models/test_family_pipeline.py``): loss, every gradient and the
eval-mode loss against the single-device model."""
from __future__ import annotations

import copy

import torch


def build_family(name: str):
    """``(model, vocab)``: a tiny random model of family ``name`` (``tests/harness/families.py``,
    ``tests/models/test_more_families.py`` or ``tests/harness/zoo.py``), dropouts 0."""
    import transformers as T

    from tests.harness.families import GQA, FamilyConfig, build
    from tests.models.test_more_families import CASES
    from tests.harness.zoo import ZOO, build_zoo
    if name in ZOO:
        return build_zoo(name), 128
    if name in CASES:
        config, attn = CASES[name]
        torch.manual_seed(0)
        return T.AutoModelForCausalLM.from_config(config(), attn_implementation=attn), 128
    cfg = FamilyConfig(name, layers=3, hidden=64, heads=4, kv_heads=2 if name in GQA else None, vocab=97,
                       attn_implementation="eager" if name in ("gptj", "bloom") else "sdpa")
    return build(cfg), 97


def worst_gradient(pm, ref_grads: dict, unused_in_reference: bool = False) -> float:
    """The largest gradient error over ``pm``'s parameters (gathered to full shape), relative to the
    reference gradient's largest entry. ``unused_in_reference``: skip parameters the reference left
    without a gradient (an MoE expert no token chose)."""
    worst = 0.0
    for n, p in pm.named_parameters():
        if p.grad is None or (unused_in_reference and ref_grads[n].grad is None):
            continue
        got = pm.gather(n, p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
        expect = ref_grads[n].grad
        worst = max(worst, float((got - expect).abs().max() / max(float(expect.abs().max()), 1e-6)))
    return worst


def pipeline_against_single_device(rank, world, name, router_aux: bool = False, tp: int = 1):
    """``router_aux``: an MoE family trained with its router's auxiliary loss (``output_router_logits``):
    the cuts carry the router logits, and the reference is ``aux_loss_reference``. ``tp``: pp=2 x tp."""
    import autoshard
    model, vocab = build_family(name)
    if router_aux:
        model.config.output_router_logits = True
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, vocab, (4, 8), generator=g), torch.randint(0, vocab, (4, 8), generator=g)
    labels[0, :3] = -100                      # microbatch 0 holds fewer targets than microbatch 1
    kwargs = dict(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids), use_cache=False)
    ref = copy.deepcopy(model)
    want = aux_loss_reference(ref, kwargs) if router_aux else ref(**kwargs).loss
    want.backward()
    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    cuts = {"pipeline_cuts": [1]} if router_aux else {}      # after layer 0: its router logits cross
    pm = autoshard.parallelize(model, autoshard.init_mesh(pp=2, tp=tp), (), kwargs, microbatches=2, **cuts)
    loss = float(pm.step(**kwargs))
    worst = worst_gradient(pm, ref_grads)
    return dict(loss=loss, want=float(want.detach()), worst=worst, eval=float(pm.eval_batch(**kwargs)),
                carried=[len(c) for c in pm.program.plan.carried])


def mixtral_with_aux_loss(layers: int = 2):
    """``(model, kwargs)``: a tiny Mixtral trained with its router's auxiliary loss
    (``output_router_logits=True``), and a batch of 4 rows whose first row has 6 ignored targets."""
    import transformers as T
    cfg = T.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                          router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 128, (4, 8), generator=g), torch.randint(0, 128, (4, 8), generator=g)
    labels[0, :6] = -100
    return model, dict(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids), use_cache=False)


def aux_loss_reference(model, kw: dict, microbatches: int = 2) -> torch.Tensor:
    """What ``pm.step`` computes for ``ce + coef * aux``: the whole batch's cross-entropy (a mean, or a sum
    over ``num_items_in_batch``), and the auxiliary term averaged over microbatches (as Megatron does).
    Backward-able."""
    whole = model(**kw)
    rows = kw["input_ids"].shape[0] // microbatches
    parts = [model(**{k: (v[i * rows:(i + 1) * rows] if torch.is_tensor(v) and v.dim() else v) for k, v in kw.items()})
             for i in range(microbatches)]
    coef = model.config.router_aux_loss_coef
    return whole.loss - coef * whole.aux_loss + coef * sum(p.aux_loss for p in parts) / microbatches


def moe_aux_loss_pipeline(rank, world, dims: dict, options: dict | None = None, layers: int = 4):
    """Mixtral trained with its router's auxiliary loss on a pipeline: every layer's router logits stay
    live until the loss, so each cut sends them beside the residual stream. Loss and every gradient
    against the single-device model (``aux_loss_reference``)."""
    import autoshard
    model, kw = mixtral_with_aux_loss(layers)
    ref = copy.deepcopy(model)
    want = aux_loss_reference(ref, kw)
    want.backward()
    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    pm = autoshard.parallelize(model, autoshard.init_mesh(**dims), (), kw, microbatches=2, **(options or {}))
    loss = float(pm.step(**kw))
    worst = worst_gradient(pm, ref_grads, unused_in_reference=True)
    plan = pm.program.plan if hasattr(pm.program, "plan") else pm.runner.program.plan
    return dict(loss=loss, want=float(want.detach()), worst=worst, carried=[len(c) for c in plan.carried],
                layers=[c.layers for c in plan.costs])
