"""Experts split like a dense MLP (``passes/rules_experts.py``): HF's grouped-matmul MoE layers keep each
expert's weights sharded (column-parallel fused gate|up in blocks, row-parallel down) instead of
gathering them every forward, and the step stays exact against the single-device model."""
import copy
import math

import pytest
import torch

import autoshard
from tests.harness.parity_checks import rel
from tests.harness.simulate import simulate
from tests.harness.zoo import build_zoo


@pytest.mark.parametrize("name,t", [("olmoe", 2), pytest.param("qwen3_moe", 4, marks=pytest.mark.slow)])
def test_experts_are_sharded_not_gathered_and_the_step_is_exact(name, t):
    model = build_zoo(name)
    if model is None:
        pytest.skip(f"this transformers has no {name}")
    experts = model.config.num_experts
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 128, (2, 8), generator=g), torch.randint(0, 128, (2, 8), generator=g)
    labels[0, :2] = -100
    kwargs = dict(input_ids=ids, labels=labels, use_cache=False)
    prog = autoshard.compile_rank(model, {"tp": t}, 0, (), kwargs)
    # no expert weight (experts, in, out) crosses the wire
    moved = [c for c in prog.collectives if len(c.shape) == 3 and c.shape[0] == experts]
    assert moved == [], [(c.node, c.kind, c.shape) for c in moved]
    # each rank holds 1/t of every expert's weights (which dims, the costs choose: at these sizes olmoe's
    # gate|up goes column-parallel in two blocks, matching gate and up columns, and its down row-parallel)
    held = {r.name: r for r in prog.params if ".experts." in r.name}
    assert len(held) == 2 * model.config.num_hidden_layers
    for r in held.values():
        assert math.prod(r.local_shape) * t == math.prod(r.global_shape), r
    ref = copy.deepcopy(model)
    want = ref(**kwargs).loss
    want.backward()
    for rank, (out, grads, _) in enumerate(simulate(model, t, (), kwargs, loss_fn=lambda o: o.loss)):
        assert rel(out.loss.detach(), want.detach()) <= 1e-5, rank
        for n, p in ref.named_parameters():
            assert rel(grads[n], p.grad, 1e-3 * max(float(q.grad.abs().max()) for q in ref.parameters())) <= 1e-5, (rank, n)
