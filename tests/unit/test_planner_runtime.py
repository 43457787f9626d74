"""The planner's ``Runtime`` and overlap costs against closed forms: what a collective hidden beside
compute still costs (``Cluster.comm_compute_share``), ZeRO-1 as a reduce-scatter (a distributed
optimizer), the parameter all-gather beside the next forward, and tp collectives pipelined under GEMMs."""
import dataclasses

import pytest

from autoshard.planner import DGX_A100, DGX_H100, Candidate, Link, Runtime, plan, predict
from autoshard.planner.cluster import NCCL_COMPUTE_SHARE
from autoshard.planner.cost import (FP32, NORM_TENSORS, _exposed, _layer_seconds, _rank_params,
                                    _vocab_parallel_seconds, ring_all_reduce_seconds)
from autoshard.planner.shape import BUILTIN

NO_SHARE = DGX_H100.with_(comm_compute_share=0.0)


def test_a_hidden_collective_costs_its_share_of_the_compute_beside_it():
    share = DGX_A100.comm_compute_share
    assert 0 < share < 1
    assert _exposed(DGX_A100, 2.0, 5.0) == pytest.approx(share * 2.0)            # all of it hidden
    assert _exposed(DGX_A100, 2.0, 0.5) == pytest.approx(1.5 + share * 0.5)      # what does not fit is exposed
    assert _exposed(DGX_A100, 2.0, 0.0) == 2.0                                    # nothing beside it
    # ranks that share a CPU's cores hide nothing: the collective's thread takes a core instead
    assert _exposed(DGX_A100.with_(oversubscription=2.0), 2.0, 5.0) == 2.0


def test_the_share_follows_the_backend_unless_given():
    nccl = dataclasses.replace(DGX_H100, comm_compute_share=None)
    gloo = dataclasses.replace(DGX_H100, comm_compute_share=None, backend="gloo")
    assert (nccl.comm_compute_share, gloo.comm_compute_share) == (NCCL_COMPUTE_SHARE, 0.0)
    assert dataclasses.replace(DGX_H100, comm_compute_share=0.05).comm_compute_share == 0.05


def test_a_distributed_optimizer_reduce_scatters_the_gradients():
    """Under ZeRO-1, autoshard all-reduces the gradients and gathers the parameters; a runtime that
    reduce-scatters them (Megatron's distributed optimizer) moves half the gradient bytes."""
    shape = BUILTIN["gpt-7.5b"]
    c = Candidate(dp=16, pp=1, tp=8, b=1, m=32, v=1, recompute="none", zero=1)
    link, params = DGX_H100.link(16, 8), _rank_params(shape, c)
    ring, gather = ring_all_reduce_seconds(4 * params, 16, link), ring_all_reduce_seconds(2 * params, 16, link) / 2
    after = Runtime("x", dp_overlap=False)
    assert predict(shape, NO_SHARE, c, runtime=after).breakdown.dp_comm == pytest.approx(ring + gather)
    sharded = dataclasses.replace(after, sharded_grads=True)
    assert predict(shape, NO_SHARE, c, runtime=sharded).breakdown.dp_comm == pytest.approx(ring / 2 + gather)
    # without ZeRO the gradients are all-reduced whatever the runtime's optimizer would do
    plain = dataclasses.replace(c, zero=0)
    assert predict(shape, NO_SHARE, plain, runtime=sharded).breakdown.dp_comm == pytest.approx(ring)


@pytest.mark.parametrize("b,v,pp", [(4, 1, 1), (1, 1, 1), (1, 2, 4)])
def test_the_parameter_gather_hides_behind_one_microbatch_of_the_first_chunk(b, v, pp):
    """The gather runs beside the next step's first forward: one microbatch through the rank's first chunk
    (a 7.5B model's tp shard gathers in about 35 ms; a 4-sequence microbatch's forward takes longer, a
    1-sequence one about 10 ms, leaving the rest exposed)."""
    shape = BUILTIN["gpt-7.5b"]
    c = Candidate(dp=16, pp=pp, tp=8, b=b, m=32 // b, v=v, recompute="none", zero=1)
    link, params = DGX_H100.link(16, 8 * pp), _rank_params(shape, c)
    reduce, gather = ring_all_reduce_seconds(4 * params, 16, link) / 2, ring_all_reduce_seconds(2 * params, 16, link) / 2
    window = -(-shape.layers // pp) * _layer_seconds(shape, NO_SHARE, c, b * shape.seq, True).forward / v
    runtime = Runtime("x", dp_overlap=False, sharded_grads=True, param_gather_overlap=True)
    got = predict(shape, NO_SHARE, c, runtime=runtime).breakdown.dp_comm
    assert got == pytest.approx(reduce + max(0.0, gather - window))
    assert (gather < window) == (b == 4)
    shared = predict(shape, DGX_H100, c, runtime=runtime).breakdown.dp_comm
    assert shared == pytest.approx(got + DGX_H100.comm_compute_share * min(gather, window))


def _tp_ends(shape, cluster, c) -> float:
    """The tp collectives outside the layers, a step: the embedding's and the loss's a microbatch, and the
    norms' shares summed once (p = 1)."""
    embedding, loss = _vocab_parallel_seconds(shape, cluster, c, c.b * shape.seq)
    norms = ring_all_reduce_seconds(FP32 * shape.hidden * NORM_TENSORS * shape.layers, c.tp, cluster.link(c.tp, 1))
    return c.m * (embedding + loss) + norms


def test_tp_collectives_pipelined_under_the_gemms_leave_the_model_ends_and_their_share():
    """--tp-comm-overlap (under SP) hides the layers' tp collectives under their GEMMs; the embedding's,
    the loss's and the norms' stay exposed, and what hides costs the cluster's share of itself."""
    shape = BUILTIN["gpt-18b"]
    c = Candidate(dp=1, pp=1, tp=8, b=1, m=8, v=1, recompute="none", zero=0, sp=True)
    overlap = Runtime("x", tp_overlap=True)
    ends = _tp_ends(shape, NO_SHARE, c)
    exposed = predict(shape, NO_SHARE, c).breakdown.tp_comm
    assert predict(shape, NO_SHARE, c, runtime=overlap).breakdown.tp_comm == pytest.approx(ends)
    with_share = predict(shape, DGX_H100, c, runtime=overlap).breakdown.tp_comm
    assert with_share == pytest.approx(ends + DGX_H100.comm_compute_share * (exposed - ends))
    # on a link too slow to hide behind the GEMMs, what does not fit stays exposed
    slow = NO_SHARE.with_(intra=Link(2e9, 5e-6))
    one = _layer_seconds(shape, slow, c, shape.seq, True)
    collectives, w = one.tp, one.weight_gemms
    assert collectives > 3 * w
    got = predict(shape, slow, c, runtime=overlap).breakdown.tp_comm
    assert got == pytest.approx(_tp_ends(shape, slow, c) + c.m * shape.layers * (collectives - 3 * w))
    # full recompute runs the forward's GEMMs again beside its collectives: 4 w of them
    full = dataclasses.replace(c, recompute="full")
    one = _layer_seconds(shape, slow, full, shape.seq, True)
    collectives, w = one.tp, one.weight_gemms
    got = predict(shape, slow, full, runtime=overlap).breakdown.tp_comm
    assert got == pytest.approx(_tp_ends(shape, slow, full) + c.m * shape.layers * (collectives - 4 * w))


def test_tp_overlap_needs_sequence_parallelism():
    """Megatron's --tp-comm-overlap pipelines SP's all-gathers and reduce-scatters: without SP nothing hides."""
    shape = BUILTIN["gpt-18b"]
    c = Candidate(dp=1, pp=1, tp=8, b=1, m=8, v=1, recompute="none", zero=0, sp=False)
    assert (predict(shape, DGX_H100, c, runtime=Runtime("x", tp_overlap=True)).breakdown.tp_comm
            == predict(shape, DGX_H100, c).breakdown.tp_comm)


def test_plan_prices_every_candidate_with_the_runtime_given():
    shape = BUILTIN["gpt-7.5b"]
    runtime = Runtime("x", dp_overlap=False, sharded_grads=True, param_gather_overlap=True, tp_overlap=True)
    plans = plan(shape, 64, DGX_H100, 256, runtime=runtime, top=3)
    for p in plans.ranked:
        q = p.prediction
        assert q.step_seconds == predict(shape, DGX_H100, q.candidate, True, runtime).step_seconds
    assert plan(shape, 64, DGX_H100, 256, top=1).best.prediction.step_seconds != plans.best.prediction.step_seconds


def test_runtimes_by_name_and_a_clear_error_for_anything_else():
    from autoshard.planner import RUNTIMES, runtime_named
    assert runtime_named("megatron-core-overlapped").tp_overlap
    assert runtime_named("AUTOSHARD") is RUNTIMES["autoshard"]
    custom = Runtime("mine", dp_overlap=False)
    assert runtime_named(custom) is custom
    for bad in ("megatron", 3, None):
        with pytest.raises(ValueError, match="runtime=.*autoshard.planner.Runtime"):
            plan(BUILTIN["gpt-1.7b"], 8, DGX_H100, 64, runtime=bad)


def test_the_cli_plans_for_another_runtime_and_plan_md_says_so(tmp_path, capsys):
    from autoshard.__main__ import main
    argv = ["plan", "--model", "gpt-7.5b", "--gpus", "64", "--cluster", "dgx-h100", "--global-batch", "256"]
    assert main(argv + ["--runtime", "megatron-core-overlapped", "--out", str(tmp_path / "m")]) == 0
    assert main(argv + ["--out", str(tmp_path / "a")]) == 0
    megatron, own = ((tmp_path / d / "plan.md").read_text() for d in ("m", "a"))
    assert "priced for `megatron-core-overlapped`" in megatron and "tp collectives under their GEMMs" in megatron
    assert "Runtime: autoshard's (the dp reduction beside backward; gradients cross the dp links in 32-bit)" in own
    with pytest.raises(SystemExit):
        main(argv + ["--runtime", "nope", "--out", "none"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_interleaved_sends_run_beside_compute_where_the_runtime_overlaps_them():
    """Megatron Core's overlap_p2p_comm: under the interleaved schedule the sends hide behind compute
    (less the share); 1F1B's stay exposed, as they are in Megatron."""
    shape = BUILTIN["gpt-145b"]
    overlap = Runtime("x", p2p_overlap=True)
    interleaved = Candidate(dp=1, pp=8, tp=8, b=1, m=64, v=4, recompute="none", zero=0)
    exposed = predict(shape, DGX_H100, interleaved).breakdown
    hidden = predict(shape, DGX_H100, interleaved, runtime=overlap).breakdown
    assert exposed.p2p > 0 and exposed.p2p < exposed.compute
    assert hidden.p2p == pytest.approx(DGX_H100.comm_compute_share * exposed.p2p)
    plain = dataclasses.replace(interleaved, v=1)
    assert (predict(shape, DGX_H100, plain, runtime=overlap).breakdown.p2p
            == predict(shape, DGX_H100, plain).breakdown.p2p)
