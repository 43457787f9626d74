"""Sequence parallelism on a stream that is multiplied as ``(b * s, h)`` views (HF's Conv1D: GPT-2 and
its kin flatten the batch and the sequence before each matmul). The view of a sequence shard is ``b``
blocks of rows, each split over the ranks (``Shard(0, blocks=b)``); the plan reduce-scatters the
row-parallel outputs into those blocks and gathers them back for the column-parallel inputs, each as one
collective of the dim viewed ``(b, s)`` (``runtime.layout.unblocked``). Before, both went through a
replica (an all-reduce, then a cut; an all-gather whose gradient was all-reduced): 1.5 times TP's bytes.
The gloo run is ``tests/distributed/test_pipeline.py`` (``hf``, tp=2, sequence parallel)."""
import pytest

import autoshard
from autoshard.ir import ops
from autoshard.ir.program import comm_summary
from tests.harness.models import batch, build
from tests.harness.simulate import assert_hf_matches


def _ring_bytes(prog) -> float:
    """Bytes each rank sends per step by the ring formulas (an all-reduce twice an all-gather's)."""
    _, nbytes = comm_summary(prog.collectives)
    return sum(b * (2 if kind == "all_reduce" else 1) for (_, _, kind), b in nbytes.items())


@pytest.mark.parametrize("B", [1, 2, 3])
def test_gpt2_conv1d_stream_is_reduce_scattered_and_gathered_in_blocks(B):
    """Per layer two reduce-scatters forward (the row-parallel outputs) and two gathers fused into the
    column-parallel matmuls (their gradients reduce-scattered beside dW); no all-reduce of the stream in
    either direction, and TP's bytes."""
    model = build("hf", vocab_size=96)
    _, kwargs = batch("hf", 96, B=B, T=16)
    sp, tp_alone = (autoshard.compile_rank(model, {"tp": 2}, 0, (), kwargs,
                                           options=autoshard.CompileOptions(loss_only=True, sequence_parallel=sp))
                    for sp in (True, False))
    calls, _ = comm_summary(sp.collectives)
    layers = model.config.n_layer
    assert calls[("tp", "fwd", "reduce_scatter")] == 2 * layers + 1     # and the embedding's
    assert calls[("tp", "bwd", "all_gather")] == 2 * layers + 1
    fused = [n for n in sp.gm.graph.nodes if n.op == "call_module"
             and isinstance(sp.gm.get_submodule(n.target), ops.ColumnParallelMatmul)
             and sp.gm.get_submodule(n.target).gather_dim is not None]
    assert len(fused) == 2 * layers and all(sp.gm.get_submodule(n.target).gather_blocks == B for n in fused)
    streams = [c for c in sp.collectives if c.kind == "all_reduce" and len(c.shape) == 2 and c.shape[-1] == 32]
    assert not streams, [(c.node, c.phase, c.what) for c in streams]
    assert _ring_bytes(sp) <= 1.1 * _ring_bytes(tp_alone)


@pytest.mark.parametrize("t,B", [(2, 2), (4, 3)])
def test_gpt2_conv1d_under_sequence_parallelism_is_exact(t, B):
    """HF's GPT-2 with the blocked reduce-scatters and gathers above: loss and every gradient, each rank."""
    model = build("hf", vocab_size=96)
    _, kwargs = batch("hf", 96, B=B, T=16)
    assert_hf_matches(model, t, kwargs, sequence_parallel=True, loss_only=True)
