"""Sequence parallelism (``parallelize(sequence_parallel=True)``): where the plan replicates the residual
stream, it is sharded along the sequence (``passes/plan.py:sequence_shards``); the row-parallel
all-reduces become reduce-scatters, each column-parallel input is one ``SequenceGather`` (all-gather
forward, reduce-scatter backward), and the norms' weight gradients are summed over tp (in one all-reduce after
backward: ``ir/partial_grads``). Exact against the
single-device model; the pipeline and dp runs are in ``tests/distributed/test_pipeline.py``."""
import copy
import warnings

import pytest
import torch
import transformers as T

import autoshard
from autoshard.ir.program import comm_summary
from tests.harness.models import batch, build
from tests.harness.parity_checks import rel
from tests.harness.simulate import simulate


def _ring_bytes(prog) -> float:
    """Bytes each rank sends per step by the ring formulas (all-reduce twice an all-gather's)."""
    _, nbytes = comm_summary(prog.collectives)
    return sum(b * (2 if kind == "all_reduce" else 1) for (_, _, kind), b in nbytes.items())


@pytest.mark.parametrize("t", [2, 4])
def test_gpt_is_exact_and_moves_the_same_bytes(t):
    model = build("gpt", vocab_size=96, n_layer=2, dropout=0.0)
    args, kwargs = batch("gpt", 96, B=2, T=16)
    plain = autoshard.compile_rank(model, {"tp": t}, 0, args, kwargs, options=autoshard.CompileOptions(loss_only=True))
    sp = autoshard.compile_rank(model, {"tp": t}, 0, args, kwargs,
                                options=autoshard.CompileOptions(loss_only=True, sequence_parallel=True))
    calls, _ = comm_summary(sp.collectives)
    assert calls[("tp", "fwd", "reduce_scatter")] == calls[("tp", "fwd", "all_gather")] > 0
    assert calls[("tp", "bwd", "reduce_scatter")] == calls[("tp", "bwd", "all_gather")] > 0
    assert _ring_bytes(sp) <= 1.1 * _ring_bytes(plain)           # RS + AG of the stream = one AR, as Megatron
    # the norms' weight and bias gradients (each rank's share: its tokens) are summed over tp in one
    # all-reduce after backward (ir/partial_grads), not one f each: per layer the two norms' weights and
    # biases and the two row-parallel biases (added on the shard), and the final norm's 2
    summed = [c for c in sp.collectives if c.axis == "tp" and c.phase == "bwd" and c.kind == "all_reduce"]
    assert [c.node for c in summed] == ["after backward"] and "14 parameters" in summed[0].what
    # each layer's two gathers are fused into the column-parallel matmul they feed: the gradient's
    # reduce-scatter overlaps dW (the LM head's stays apart, for the chunked loss)
    fused = [c for c in sp.collectives if c.kind == "reduce_scatter" and "overlapped with dW" in c.what]
    assert len(fused) == 4, [(c.node, c.what) for c in sp.collectives]
    ref = copy.deepcopy(model)
    want = ref(*args)[1]
    want.backward()
    for rank, (out, grads, _) in enumerate(simulate(model, t, args, kwargs, loss_fn=lambda o: o[1],
                                                    sequence_parallel=True, loss_only=True)):
        assert rel(out[1].detach(), want.detach()) <= 1e-5
        for n, p in ref.named_parameters():
            assert rel(grads[n], p.grad) <= 1e-5, (rank, n)


@pytest.mark.parametrize("t", [2, 4])
def test_llama_with_rotary_is_exact(t):
    """Rotary tables sliced per shard; at t=4 its 2 kv heads are not split, so the k and v projections
    read the stream replicated beside q's column-parallel one: the one sequence gather serves both
    (``ops.GatheredReplica``), and SP moves the bytes TP does."""
    cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=ids, labels=ids.clone(), attention_mask=torch.ones_like(ids), use_cache=False)
    ref = copy.deepcopy(model)
    want = ref(**kwargs).loss
    want.backward()
    plain, prog = (autoshard.compile_rank(model, {"tp": t}, 0, (), kwargs,
                                          options=autoshard.CompileOptions(loss_only=True, sequence_parallel=sp))
                   for sp in (False, True))
    calls = comm_summary(prog.collectives)[0]
    assert calls[("tp", "fwd", "reduce_scatter")] > 0
    # per layer two stream gathers forward (attention's, the MLP's), however many kinds of reader each
    # has, and the LM head's
    stream = [c for c in prog.collectives if c.phase == "fwd" and c.kind == "all_gather" and c.shape == (2, 16, 64)]
    assert len(stream) == 2 * cfg.num_hidden_layers + 1, [(c.node, c.what) for c in stream]
    # the same bytes as TP, but for the norms' weight gradients summed after backward (Megatron's too)
    norms = 2 * cfg.num_hidden_layers + 1
    assert _ring_bytes(prog) - _ring_bytes(plain) == 2 * 4 * norms * cfg.hidden_size
    for rank, (out, grads, _) in enumerate(simulate(model, t, (), kwargs, loss_fn=lambda o: o.loss,
                                                    sequence_parallel=True, loss_only=True)):
        assert rel(out.loss.detach(), want.detach()) <= 1e-5
        for n, p in ref.named_parameters():
            if p.grad is not None:
                assert rel(grads[n], p.grad) <= 1e-5, (rank, n)


@pytest.mark.parametrize("t", [2, 4])
def test_regather_keeps_the_shard_and_gathers_it_again_in_backward(t):
    """``sequence_parallel="regather"`` (Megatron's): each fused column-parallel matmul keeps its input's
    sequence shard, not the gathered input, and gathers it again in backward; the same values, one more
    all-gather a fused matmul in backward (measured on gloo, ``benchmarks.memory``: 8 s b h (1 - 1/t) bytes
    a layer fewer, 256 KiB at t=2 and 384 KiB at t=4 on its GPT, exactly the two inputs' shares)."""
    model = build("gpt", vocab_size=96, n_layer=2, dropout=0.0)
    args, kwargs = batch("gpt", 96, B=2, T=16)

    def calls(sp):
        prog = autoshard.compile_rank(model, {"tp": t}, 0, args, kwargs,
                                      options=autoshard.CompileOptions(loss_only=True, sequence_parallel=sp))
        return comm_summary(prog.collectives)[0]
    kept, again = calls(True), calls("regather")
    fused = 4          # two column-parallel matmuls a layer, two layers
    assert again[("tp", "bwd", "all_gather")] == kept[("tp", "bwd", "all_gather")] + fused
    assert {k: v for k, v in again.items() if k != ("tp", "bwd", "all_gather")} == \
        {k: v for k, v in kept.items() if k != ("tp", "bwd", "all_gather")}
    ref = copy.deepcopy(model)
    want = ref(*args)[1]
    want.backward()
    for rank, (out, grads, _) in enumerate(simulate(model, t, args, kwargs, loss_fn=lambda o: o[1],
                                                    sequence_parallel="regather", loss_only=True)):
        assert rel(out[1].detach(), want.detach()) <= 1e-5
        for n, p in ref.named_parameters():
            assert rel(grads[n], p.grad) <= 1e-5, (rank, n)


def test_sequence_parallel_takes_true_false_or_regather():
    with pytest.raises(ValueError, match="'regather'"):
        autoshard.CompileOptions(sequence_parallel="yes")


def test_a_sequence_that_does_not_split_over_tp_is_said_not_silently_dropped():
    """Sequence parallelism needs the sequence to split evenly over tp: at 15 tokens and tp=2 the program is
    plain TP, and a warning says why and how to pad."""
    cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 128, (2, 15), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=ids, labels=ids.clone(), use_cache=False)
    with pytest.warns(UserWarning, match="sequence \\(15 tokens\\) does not split evenly over tp=2; pad the batch to "
                                         "16 tokens.*runs as plain tensor parallelism"):
        prog = autoshard.compile_rank(model, {"tp": 2}, 0, (), kwargs,
                                      options=autoshard.CompileOptions(loss_only=True, sequence_parallel=True))
    calls = comm_summary(prog.collectives)[0]
    assert not any(kind == "reduce_scatter" for (_, _, kind) in calls), calls
    # the stage balancer prices what runs: whole boundaries and activations, as without SP
    peaks = []
    for sp in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = autoshard.compile_pipeline(model, {"pp": 2, "tp": 2}, 0, (), kwargs, microbatches=2,
                                              sequence_parallel=sp)
        peaks.append(pipe.plan.predicted_peak_bytes)
    assert peaks[0] == peaks[1]
