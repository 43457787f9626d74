"""Pipeline parallelism on gloo ranks: ``pm.step`` against the single-device model on the whole batch.

Every run checks the loss, every gradient gathered to full shape, then 3 AdamW steps (two configurations clip every step with
``pm.clip_grad_norm_``: the norm over every stage, a tied weight counted once), on batches whose
microbatches hold different numbers of ignored targets (the sum-and-count loss must be exact). The
configurations share one process group per world size, to keep ``make test`` short.
"""
import os
import time

import pytest


from tests.harness.distributed import run_distributed
from tests.harness.pipeline_checks import run_configs

TOL = 2e-5
GPT = dict(n_layer=4)

TWO_RANKS = [
    ("gpt", dict(pp=2), dict(microbatches=4, schedule="gpipe"), GPT),
    ("gpt", dict(pp=2), dict(microbatches=4, schedule="1f1b", clip=0.05, late_receives=True), GPT),
    ("gpt", dict(pp=2), dict(microbatches=4, schedule="interleaved", virtual_stages=2, late_receives=True), GPT),
    ("gpt", dict(pp=2), dict(microbatches=2, schedule="1f1b"), dict(n_layer=5, tie_weights=False, fused_qkv=False)),
    ("gpt", dict(pp=2), dict(microbatches=2, pipeline_cuts=[1]), GPT),
    ("gpt", dict(pp=2), dict(microbatches=2, recompute=True, recompute_stages=(0,)), GPT),  # as memory_limit asks
    ("hf", dict(pp=2), dict(microbatches=2), {}),
    ("hf", dict(pp=2), dict(microbatches=2, recompute="selective"), {}),   # each attention core again
    ("family", dict(pp=2), dict(microbatches=2, schedule="gpipe"), dict(family="llama", hidden=32, heads=4, kv_heads=2)),
    ("gpt", dict(tp=2), dict(microbatches=4), GPT),                     # pp = 1: gradient accumulation
    ("hf", dict(tp=2), dict(microbatches=2, sequence_parallel=True), {}),   # GPT-2's Conv1D under SP
    ("family", dict(tp=2), dict(microbatches=2, sequence_parallel=True),    # Llama's rotary tables under SP
     dict(family="llama", hidden=32, heads=4, kv_heads=2)),
]
FOUR_RANKS = [
    ("gpt", dict(pp=4), dict(microbatches=4, schedule="interleaved", virtual_stages=2, late_receives=True), GPT),
    ("gpt", dict(pp=4), dict(microbatches=4, schedule="1f1b"), dict(n_layer=4, tie_weights=False)),
    # Megatron's scatter/gather (NCCL's default): each tp rank sends 1/t of the boundary, the receivers gather
    ("gpt", dict(pp=2, tp=2), dict(microbatches=2, schedule="1f1b", clip=0.05, recompute=True, scatter_gather=True),
     GPT),
    ("hf", dict(pp=2, tp=2), dict(microbatches=2, schedule="interleaved", virtual_stages=2, scatter_gather=True), {}),
    ("gpt", dict(pp=2, tp=2), dict(microbatches=2, sequence_parallel=True), GPT),   # sequence-sharded boundary
    # gloo's RS and AG as all-to-alls; the column-parallel inputs kept as shards and gathered again, async
    ("gpt", dict(tp=4), dict(microbatches=2, sequence_parallel="regather"), dict(n_layer=2)),
    # 2 kv heads on 4 ranks: k and v replicated, their input the one sequence gather q's is (GatheredReplica)
    ("family", dict(tp=4), dict(microbatches=2, sequence_parallel=True),
     dict(family="llama", hidden=32, heads=4, kv_heads=2, layers=2)),
]


DATA_PARALLEL = [   # (dp, pp, tp) on 4 ranks; each dp rank steps on its own rows of the global batch
    # pm(...) in train mode refuses (dp > 1 trains with pm.step); in eval mode it is the model's loss
    ("gpt", dict(dp=2, tp=2), dict(microbatches=2, forwards=True), dict(n_layer=2)),
    ("gpt", dict(dp=2, pp=2), dict(microbatches=2, clip=0.05), GPT),
    ("gpt", dict(dp=4), dict(microbatches=2, bucket_bytes=4096), dict(n_layer=2)),   # many buckets, overlapped
    ("gpt", dict(dp=2, pp=2), dict(microbatches=2, zero=1), GPT),        # ZeRO-1 with the tied head on 2 stages
    ("gpt", dict(dp=2, pp=2), dict(microbatches=2, accumulate=True), GPT),  # two pm.step per optimizer step
    ("gpt", dict(dp=2, pp=2), dict(microbatches=2, schedule="interleaved", virtual_stages=2, recompute=True),
     GPT),   # 2 bucket sets; every layer recomputed in backward
    ("gpt", dict(dp=2, tp=2), dict(microbatches=2, zero=1, fused=True, recompute="selective"),
     dict(n_layer=2, flash=False)),  # fused AdamW, ZeRO-1, the attention cores recomputed
    ("gpt", dict(dp=2, tp=2), dict(microbatches=2, zero=1, sequence_parallel=True), dict(n_layer=2)),
    ("family", dict(dp=2, tp=2), dict(microbatches=2, zero=1, forwards=True),   # ZeRO-1 on a q|k|v held in rank order
     dict(family="phi3", kv_heads=2, layers=2, hidden=64, heads=4, vocab=97)),
]


def _check(configs, results):
    for config, per_rank in zip(configs, zip(*results)):
        for r in per_rank:
            assert max(r["losses"]) < TOL, (config, r["losses"])
            assert max(r["grads"]) < TOL, (config, r["grads"])
            assert max(r["norms"], default=0) < TOL, (config, r["norms"])   # clipped by the global norm
            assert r["final"] < TOL, (config, r["final"])
            assert r["exact"], config
            assert all(r["tied"].values()), (config, r["tied"])   # tied copies bit-identical after 3 steps
            assert r["eval"] is None or r["eval"] < TOL, (config, r["eval"])
            assert "expect" not in config[2] or r["schedule"] == config[2]["expect"], (config, r["schedule"])
            # sliced transfers where asked for, none on gloo by default ("auto": NCCL only)
            assert (r["scattered"] > 0) == (config[2].get("scatter_gather") is True), (config, r["scattered"])
        if config[0] != "family" and config[3].get("tie_weights", True) and config[1].get("pp", 1) > 1:
            if per_rank[0]["schedule"] == "zb-v":      # a V: the first and last stages on rank 0
                assert not per_rank[0]["ties"], config
                continue
            assert per_rank[0]["ties"], config          # the tied head really spans two stages
            assert any(r["tied"] for r in per_rank)


def test_pipeline_parity_two_ranks():
    results = run_distributed(run_configs, 2, TWO_RANKS, timeout=600)
    _check(TWO_RANKS, results)


def test_pipeline_parity_four_ranks():
    results = run_distributed(run_configs, 4, FOUR_RANKS, timeout=600)
    _check(FOUR_RANKS, results)


def _two_stage_pipeline(rank, fail):
    """A 2-stage pipeline whose stage 1 (on rank 1) calls ``fail()`` in its second forward."""
    import autoshard
    from tests.harness.models import batch, build
    args, _ = batch("gpt", 96, B=4)
    pm = autoshard.parallelize(build("gpt", n_layer=2), autoshard.init_mesh(pp=2), args, microbatches=4)
    if rank == 1:
        graph, calls = pm.graphs["1"], []

        def broken(*xs):
            calls.append(1)
            if len(calls) == 2:
                fail()
            return graph(*xs)
        pm.graphs["1"].forward = broken
    return pm, args


def _raise():
    raise RuntimeError("injected failure in stage 1")


def _raising_rank(rank, world, timeout):
    """Rank 1 raises in its second forward and then stays alive (holding its connections): rank 0 must
    not hang on its receive, but fail within AUTOSHARD_TIMEOUT with an error naming rank 1."""
    os.environ["AUTOSHARD_TIMEOUT"] = str(timeout)
    pm, args = _two_stage_pipeline(rank, _raise)
    start = time.monotonic()
    try:
        pm.step(*args)
        return ("ok", "", time.monotonic() - start)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        if rank == 1:
            time.sleep(timeout + 3)
        return (type(e).__name__, str(e), time.monotonic() - start)


def test_a_raising_rank_fails_the_others_within_the_timeout():
    timeout = 4
    (kind0, msg0, t0), (kind1, msg1, _) = run_distributed(_raising_rank, 2, timeout, timeout=120, fresh=True)
    assert kind1 == "RuntimeError" and "injected" in msg1
    assert kind0 == "PipelineError", msg0
    assert "global rank 1" in msg0
    assert t0 < timeout + 10


def test_data_parallel_and_zero1():
    """The global batch's loss and gradients with uneven ignore counts across dp ranks, then 3 AdamW
    steps; ZeRO-1 ends at the same parameters as plain dp (both match the single-device model) while
    each rank holds about half of AdamW's state."""
    results = run_distributed(run_configs, 4, DATA_PARALLEL, timeout=600)
    _check(DATA_PARALLEL, results)
    for rank_results in results:
        plain, zero = rank_results[1]["state_bytes"], rank_results[3]["state_bytes"]
        assert 0 < zero <= 0.6 * plain, (zero, plain)


def _dying_rank(rank, world, out_dir):
    """Rank 1 dies (os._exit) in its second forward; rank 0, waiting on its transfer, must fail with an
    error naming rank 1 (written to a file: the launcher kills the job soon after a rank dies)."""
    pm, args = _two_stage_pipeline(rank, lambda: os._exit(7))
    start = time.monotonic()
    try:
        pm.step(*args)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"{time.monotonic() - start:.3f}\n{type(e).__name__}: {e}")
        raise


def test_a_dead_rank_fails_its_peer_promptly(tmp_path):
    with pytest.raises(AssertionError, match="rank 0 failed"):     # both ranks fail: 1 died, 0 raised
        run_distributed(_dying_rank, 2, str(tmp_path), timeout=120)
    seconds, message = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert message.startswith("PipelineError") and "global rank 1" in message
    assert float(seconds) < 30


@pytest.mark.slow
def test_full_mesh_eight_ranks():
    """(dp, pp, tp) = (2, 2, 2) with ZeRO-1 and the tied head: 8 processes, so marked slow on 2 cores."""
    configs = [("gpt", dict(dp=2, pp=2, tp=2), dict(microbatches=2, zero=1, clip=0.05), GPT)]
    _check(configs, run_distributed(run_configs, 8, configs, timeout=900))
