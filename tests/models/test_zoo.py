"""The wider zoo (``tests/harness/zoo.py``) at tp=2 and tp=4 in the simulator, called with keywords as users call
HF models: the loss and every gradient equal the single-device model's, plain and with sequence parallelism
and selective recompute (slow: ``pytest -m slow tests/models/test_zoo.py``, about 5 minutes each). ``tests/models/test_family_pipeline.py`` puts the same zoo on pp=2."""
import copy
import warnings

import pytest
import torch

from tests.harness.parity_checks import rel
from tests.harness.simulate import simulate
from tests.harness.zoo import ATTENTION_FREE, ZOO, build_zoo, tolerance


# One of each new kind, in the fast suite: MoE with a dense MLP beside it and chunked attention (Llama 4),
# latent attention (DeepSeek V3.2), a Mamba hybrid (Jamba), a short-conv hybrid (LFM2), and a scan that
# writes into views (Qwen3.5's gated delta rule, functionalized at capture; slow: 27 s alone, the fast suite's
# largest simulated case, while tests/distributed/test_pipeline_carried.py trains a scan that writes into a view
# on gloo ranks)
FAST = ("llama4_text", "deepseek_v32", "jamba", "lfm2", pytest.param("qwen3_5_text", marks=pytest.mark.slow))


@pytest.mark.parametrize("name", FAST)
def test_new_family_at_tp2(name):
    test_zoo_family_matches_single_device(name, 2)


@pytest.mark.slow
@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_family_with_sequence_parallelism_and_selective_recompute(name, t):
    """The same, with the residual stream sequence-sharded and each attention core recomputed: every
    family's attention is found (no warning that nothing is recomputed), and a family without attention
    is told that nothing is."""
    if name in ATTENTION_FREE:
        with pytest.warns(UserWarning, match="nothing is recomputed"):
            test_zoo_family_matches_single_device(name, t, sequence_parallel=True, recompute="selective")
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*nothing is recomputed")
        test_zoo_family_matches_single_device(name, t, sequence_parallel=True, recompute="selective")


@pytest.mark.slow
@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_family_matches_single_device(name, t, **options):
    model = build_zoo(name)
    if model is None:
        pytest.skip(f"this transformers has no {ZOO[name][0]}")
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 128, (2, 8), generator=g), torch.randint(0, 128, (2, 8), generator=g)
    labels[0, :2] = -100
    mask = torch.ones_like(ids)
    mask[1, :2] = 0                          # a left-padded row, as batched inference-style data has
    labels[1, :2] = -100
    kwargs = dict(input_ids=ids, labels=labels, attention_mask=mask, use_cache=False)
    ref = copy.deepcopy(model)
    out = ref(**kwargs)
    out.loss.backward()
    grads = dict(ref.named_parameters(remove_duplicate=False))
    floor = 1e-3 * max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    for rank, (o, g, _) in enumerate(simulate(model, t, (), kwargs, loss_fn=lambda o: o.loss, **options)):
        assert rel(o.loss.detach(), out.loss.detach()) <= 1e-5, (name, rank)
        assert set(g) == set(grads), (name, sorted(set(g) ^ set(grads)))
        for n, p in grads.items():
            assert (g[n] is None) == (p.grad is None), (name, n)
            if p.grad is not None:
                assert rel(g[n], p.grad, floor) <= tolerance(name), (name, t, rank, n)
