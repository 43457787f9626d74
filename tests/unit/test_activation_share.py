"""The stage balancer's activation bytes per rank (``passes/activation_share.py``): the global graph's saved
values, each at the share one rank keeps under tensor and sequence parallelism and selective recompute.
Measured on gloo for the built-in GPT at pp=2 x tp=2 (h 128, s 64, 4 heads, fp32, m=4): the predicted
bytes a microbatch of stage 0 were 1.35x, 1.36x, 1.07x and 1.05x the executor's count (TP, SP, selective,
SP + selective), where the global graph's count said 2.2x for all four."""
import pytest

import autoshard
from autoshard.ir.options import CompileOptions, PipelineOptions
from tests.harness.models import batch, build


def _stage_bytes(mesh, **options):
    opts = CompileOptions(pipeline=PipelineOptions(microbatches=2), loss_chunk_rows=None, **options)
    model = build("gpt", n_layer=4, dropout=0.0, flash=False)     # eager attention: its core saves s x s scores
    prog = autoshard.compile_pipeline(model, mesh, 0, *batch("gpt", 96, B=4), opts)
    return [c.activation_bytes for c in prog.plan.costs]


@pytest.fixture(scope="module")
def priced():
    return {"tp1": _stage_bytes({"pp": 2}),
            "tp": _stage_bytes({"pp": 2, "tp": 2}),
            "sp": _stage_bytes({"pp": 2, "tp": 2}, sequence_parallel=True),
            "selective": _stage_bytes({"pp": 2, "tp": 2}, recompute="selective"),
            "full": _stage_bytes({"pp": 2, "tp": 2}, recompute=True),
            "full sp": _stage_bytes({"pp": 2, "tp": 2}, recompute=True, sequence_parallel=True)}


def test_a_tp_rank_keeps_its_shard_and_the_replicated_stream(priced):
    for one, two in zip(priced["tp1"], priced["tp"]):
        assert one / 2 < two < one          # the stream's norms and adds stay whole on every tp rank


def test_sequence_parallelism_and_selective_recompute_keep_less(priced):
    for tp, sp, sel in zip(priced["tp"], priced["sp"], priced["selective"]):
        assert sp < tp and sel < tp


def test_full_recompute_keeps_the_layer_inputs_a_sequence_shard_under_sp(priced):
    for full, tp in zip(priced["full"], priced["tp"]):
        assert full < tp / 4
    assert priced["full sp"][0] == pytest.approx(priced["full"][0] / 2)     # stage 0: layer inputs alone
    assert priced["full sp"][1] < priced["full"][1]      # the last: the LM head's values are not recomputed


def test_only_the_ranks_that_recompute_are_priced_so():
    """``recompute_stages=(0,)`` (what ``memory_limit`` sets when only the first rank would not fit): the
    balancer prices rank 0's chunk as the recompute pass runs it and rank 1's as it is."""
    prog = autoshard.compile_pipeline(
        build("gpt", n_layer=4, dropout=0.0, flash=False), {"pp": 2}, 0, *batch("gpt", 96, B=4),
        CompileOptions(pipeline=PipelineOptions(microbatches=2), loss_chunk_rows=None, recompute=True,
                       recompute_stages=(0,)))
    first, last = prog.plan.costs
    assert first.recompute_seconds > 0 and last.recompute_seconds == 0
    everywhere, nowhere = _stage_bytes({"pp": 2}, recompute=True), _stage_bytes({"pp": 2})
    assert [first.activation_bytes, last.activation_bytes] == [everywhere[0], nowhere[1]]


def test_a_schedule_priced_on_the_same_cuts_uses_its_own_placement():
    """ZB-V is compared with the interleaved schedule on the same cuts: chunk 2 is rank 1's in the V but
    rank 0's interleaved, so with only rank 0 recomputing its price differs between the two."""
    from autoshard.ir.schedule import make_schedule
    from autoshard.passes.stage_prices import PerRankRecompute
    v, interleaved = make_schedule("zb-v", 2, 4, 2), make_schedule("interleaved", 2, 4, 2)
    seg = PerRankRecompute("recomputed", "plain", frozenset({0}), v.rank_of)
    assert [seg.priced_as(k) for k in range(4)] == ["recomputed", "plain", "plain", "recomputed"]
    assert [seg.priced_as(k, interleaved.rank_of) for k in range(4)] == ["recomputed", "plain", "recomputed", "plain"]


def test_regather_keeps_the_column_parallel_inputs_as_shards():
    """``sequence_parallel="regather"``: the norms' outputs a column-parallel matmul reads are kept as the
    sequence shard too, so a rank keeps less than under SP that keeps them gathered."""
    sp = _stage_bytes({"pp": 2, "tp": 2}, sequence_parallel=True)
    again = _stage_bytes({"pp": 2, "tp": 2}, sequence_parallel="regather")
    assert all(a < b for a, b in zip(again, sp))
