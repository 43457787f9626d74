"""SDPA with ``dropout_p`` on a tp shard is written out as ATen's math attention (``passes/sdpa_dropout.py``)
so ``sharded_dropout`` gives it the single device's mask; the exact runs are on gloo
(``tests/harness/loop_edge_checks.py:dropout_on_tp_shards``: the built-in GPT and HF GPT-2 at tp=4)."""
import math

import pytest
import torch
import torch.nn.functional as F

import autoshard
from tests.harness.models import batch, build

aten = torch.ops.aten


def _targets(model, tp=2, **keywords):
    prog = autoshard.compile_rank(model, {"tp": tp}, 0, *batch("gpt", 96), loss_only=True, **keywords)
    return [n.target for n in prog.gm.graph.nodes if n.op == "call_function"]


def test_sdpa_with_dropout_is_spelled_out_and_its_mask_drawn_whole():
    targets = _targets(build("gpt", n_layer=1, dropout=0.1, flash=True).train())
    assert aten.scaled_dot_product_attention.default not in targets
    assert aten._safe_softmax.default in targets and aten.bernoulli.p in targets


@pytest.mark.parametrize("why", ["eval", "no dropout", "one rank"])
def test_sdpa_stays_fused_where_nothing_draws_on_a_shard(why):
    model = build("gpt", n_layer=1, dropout=0.0 if why == "no dropout" else 0.1, flash=True)
    model.train(why != "eval")
    targets = _targets(model, tp=1 if why == "one rank" else 2)
    assert aten.scaled_dot_product_attention.default in targets


@pytest.mark.parametrize("causal,mask,dtype,scale", [(True, None, torch.float32, None),
                                                     (False, "bool", torch.float32, None),
                                                     (False, "float", torch.float32, None),
                                                     (True, None, torch.bfloat16, None),
                                                     (True, None, torch.float16, None),
                                                     (True, None, torch.float32, -0.2)])
def test_the_spelled_out_attention_is_atens_math_attention(causal, mask, dtype, scale):
    """The ops the pass writes, run by hand on one device, against SDPA with dropout: the same values and the
    same mask (one bernoulli draw over the whole scores), as ATen's math path computes them on a CPU (a
    half or bf16 call in fp32, cast back; a negative scale's root, q negated)."""
    b, a, s, e, p = 2, 4, 8, 64, 0.1
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, a, s, e).to(dtype) for _ in range(3))
    m = None if mask is None else (torch.rand(b, 1, s, s) > 0.3 if mask == "bool" else torch.randn(b, 1, s, s))
    torch.manual_seed(5)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p, is_causal=causal, scale=scale)
    torch.manual_seed(5)
    q, k, v = (x.float() for x in (q, k, v))
    root = math.sqrt(abs(scale) if scale is not None else 1 / math.sqrt(e))
    scores = (q * (root if scale is None or scale >= 0 else -root)) @ (k.transpose(-2, -1) * root)
    if causal:
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    elif mask == "bool":
        scores = scores.masked_fill(~m, float("-inf"))
    elif mask == "float":
        scores = scores + m
    probs = aten._safe_softmax(scores, -1)
    noise = probs.new_empty(probs.shape).bernoulli_(1 - p) / (1 - p)
    assert torch.equal((probs * noise @ v).to(dtype), want)


def test_a_bf16_call_is_computed_in_fp32_and_cast_back():
    prog = autoshard.compile_rank(build("gpt", n_layer=1, dropout=0.1, flash=True).train(), {"tp": 2}, 0,
                                  *batch("gpt", 96), loss_only=True, mixed_precision="bf16")
    nodes = [n for n in prog.gm.graph.nodes if n.op == "call_function"]
    softmax = next(n for n in nodes if n.target is aten._safe_softmax.default)
    assert softmax.meta["val"].dtype == torch.float32
    casts = [n.kwargs.get("dtype") for n in nodes if n.target is aten._to_copy.default]
    assert casts.count(torch.float32) >= 3 and torch.bfloat16 in casts


def test_selective_recompute_still_finds_the_spelled_out_core():
    """The written-out core (``q @ k^T`` to ``_safe_softmax`` to the product with v) is the attention
    selective recompute runs again: its dropout redraws the same mask there (the RNG state restored)."""
    from autoshard.ir.meta import RECOMPUTE_PLAN
    prog = autoshard.compile_rank(build("gpt", n_layer=2, dropout=0.1, flash=True).train(), {"tp": 2}, 0,
                                  *batch("gpt", 96), loss_only=True, recompute="selective")
    regions = prog.gm.meta[RECOMPUTE_PLAN].regions
    assert len(regions) == 2
    nodes = list(prog.gm.graph.nodes)
    inside = {n.target for r in regions for n in nodes[r.first_index:r.last_index + 1] if n.op == "call_function"}
    assert aten.bernoulli.p in inside and aten._safe_softmax.default in inside
