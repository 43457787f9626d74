"""A shard added to partial sums is zero-padded in place (``Shard -> Partial``, no communication), and a
norm weight read through a cast keeps its gradient partial until the one sum after backward.

Both come from blocks whose residual joins the row-parallel outputs before their reduction: Cohere's
parallel attention + MLP block adds ``residual + attention + mlp`` in that order, so under sequence
parallelism the residual (a sequence shard) meets a partial sum. It used to be all-gathered for that
(``S(1) -> P``: gather, then keep it on rank 0), one more forward all-gather a layer; its norm multiplies
by ``weight.to(float32)``, whose cast hid the weight from the after-backward sum, so each layer paid an f
of its own. Both now cost what TP alone costs."""
import pytest
import torch

import autoshard
from autoshard.ir.placement import Partial, Shard
from autoshard.ir.program import comm_summary
from autoshard.ir.redistribute import plan_redistribute
from autoshard.runtime.collectives import ShardToPartial
from autoshard.runtime.layout import take_shard
from tests.harness.simulate import assert_hf_matches
from tests.harness.zoo import ZOO, build_zoo, tolerance


class _Rank:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


@pytest.mark.parametrize("n,t,blocks", [(8, 2, 1), (7, 2, 1), (12, 4, 3), (12, 2, (4, 8))])
def test_shard_to_partial_sums_to_the_whole_and_passes_back_each_chunk(n, t, blocks):
    """Even, padded (7 over 2), equal-block and unequal-block shards: the ranks' outputs sum to the full
    tensor, and each rank's input gradient is its chunk of the output's gradient. No collective runs."""
    assert [s.kind for s in plan_redistribute(Shard(0, blocks), Partial(), (n, 3), "tp", t)] == ["shard_to_partial"]
    full = torch.randn(n, 3, dtype=torch.float64)
    grad = torch.randn(n, 3, dtype=torch.float64)
    total = torch.zeros_like(full)
    for r in range(t):
        x = take_shard(full, 0, n, t, r, blocks).clone().requires_grad_()
        y = ShardToPartial.apply(x, _Rank(r, t), 0, n, blocks)
        y.backward(grad)
        total += y.detach()
        torch.testing.assert_close(x.grad, take_shard(grad, 0, n, t, r, blocks))
    torch.testing.assert_close(total, full)


def _ring(prog) -> float:
    """Bytes each rank sends per step by the ring formulas (an all-reduce twice an all-gather's)."""
    return sum(b * (2 if kind == "all_reduce" else 1) for (_, _, kind), b in comm_summary(prog.collectives)[1].items())


def _kwargs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    return dict(input_ids=ids, labels=ids.clone(), attention_mask=torch.ones_like(ids), use_cache=False)


@pytest.mark.skipif(build_zoo("cohere2") is None, reason="this transformers has no Cohere2")
@pytest.mark.parametrize("t", [2, 4])
def test_parallel_block_under_sequence_parallelism_costs_what_tp_costs(t):
    """Cohere2 at tp=t with SP: a layer's collectives are one reduce-scatter and one sequence gather (and
    their backward converses), none per norm; its ring bytes TP's; exact."""
    model = build_zoo("cohere2")
    kwargs = _kwargs()
    sp, alone = (autoshard.compile_rank(model, {"tp": t}, 0, (), kwargs,
                                        options=autoshard.CompileOptions(loss_only=True, sequence_parallel=s))
                 for s in (True, False))
    layers = model.config.num_hidden_layers
    calls, _ = comm_summary(sp.collectives)
    if t <= model.config.num_key_value_heads:   # (beyond, the replicated kv projections gather the stream too)
        assert calls[("tp", "fwd", "all_gather")] == layers + 1   # the sequence gathers, the head's; no S(1) -> P
        assert calls[("tp", "fwd", "reduce_scatter")] == calls[("tp", "bwd", "all_gather")] == layers + 1
        assert _ring(sp) <= 1.05 * _ring(alone)
    summed = [c for c in sp.collectives if c.kind == "all_reduce" and c.phase == "bwd"]
    assert [c.node for c in summed] == ["after backward"], [(c.node, c.what) for c in summed]
    assert_hf_matches(model, t, kwargs, tolerance("cohere2"), sequence_parallel=True, loss_only=True)


@pytest.mark.skipif("gpt_oss" not in ZOO or build_zoo("gpt_oss") is None, reason="this transformers has no GPT-OSS")
def test_no_plan_gathers_a_shard_into_a_partial_sum():
    """GPT-OSS at tp=2 (plain TP) used to all-gather sharded values into partial sums (S -> P); now no
    redistribution of its plan gathers for that, and its ring bytes fell (579.8 to 451.8 KiB a step)."""
    model = build_zoo("gpt_oss")
    prog = autoshard.compile_rank(model, {"tp": 2}, 0, (), _kwargs(),
                                  options=autoshard.CompileOptions(loss_only=True))
    to_partial = [c for c in prog.collectives if "-> P" in c.what and c.kind == "all_gather"]
    assert not to_partial, [(c.node, c.what) for c in to_partial]
