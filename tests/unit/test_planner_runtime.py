"""The planner's ``Runtime`` and overlap costs against closed forms: what a collective hidden beside
compute still costs (``Cluster.comm_compute_share``), ZeRO-1 as a reduce-scatter (a distributed
optimizer), the parameter all-gather beside the next forward, and tp collectives pipelined under GEMMs."""
import dataclasses

import pytest

from autoshard.planner import DGX_A100, DGX_H100, Candidate, Runtime, predict
from autoshard.planner.cost import _exposed, _rank_params, ring_all_reduce_seconds
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


def test_the_dp_reduction_hidden_behind_backward_costs_its_share():
    """autoshard reduces its buckets beside the last backward: on a GPU cluster all of a 1.7B model's
    reduction fits there, and what is left is the compute its kernels take."""
    shape, c = BUILTIN["gpt-1.7b"], Candidate(dp=32, pp=1, tp=1, b=16, m=1, v=1, recompute="full", zero=0)
    ring = ring_all_reduce_seconds(4 * shape.params(), 32, DGX_A100.link(32, 1))
    q = predict(shape, DGX_A100, c, flash=False)
    assert ring < q.breakdown.total / 4
    assert q.breakdown.dp_comm == pytest.approx(DGX_A100.comm_compute_share * ring, rel=1e-3)
    assert predict(shape, DGX_A100.with_(comm_compute_share=0.0), c, flash=False).breakdown.dp_comm == 0.0


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


def test_the_parameter_gather_hides_behind_the_next_forward():
    shape = BUILTIN["gpt-7.5b"]
    c = Candidate(dp=16, pp=1, tp=8, b=4, m=8, v=1, recompute="none", zero=1)
    link, params = DGX_H100.link(16, 8), _rank_params(shape, c)
    reduce = ring_all_reduce_seconds(4 * params, 16, link) / 2
    runtime = Runtime("x", dp_overlap=False, sharded_grads=True)
    exposed = predict(shape, NO_SHARE, c, runtime=runtime).breakdown.dp_comm
    assert exposed == pytest.approx(reduce + ring_all_reduce_seconds(2 * params, 16, link) / 2)
    overlapped = predict(shape, NO_SHARE, c, runtime=dataclasses.replace(runtime, param_gather_overlap=True))
    # a 7.5B model's tp shard gathers in 35 ms, beside a 4-sequence microbatch's 37 ms forward
    assert overlapped.breakdown.dp_comm == pytest.approx(reduce)
    assert exposed > overlapped.breakdown.dp_comm
    shared = predict(shape, DGX_H100, c, runtime=dataclasses.replace(runtime, param_gather_overlap=True))
    assert shared.breakdown.dp_comm == pytest.approx(reduce + DGX_H100.comm_compute_share * (exposed - reduce))


def test_tp_collectives_pipelined_under_the_gemms_leave_the_model_ends_and_their_share():
    """--tp-comm-overlap hides the layers' tp collectives under their GEMMs; the embedding's and the
    loss's collectives stay exposed. With no share, the ends' are all that is left; with one, the
    layers' collectives cost that share of themselves."""
    shape = BUILTIN["gpt-18b"]
    c = Candidate(dp=1, pp=1, tp=8, b=1, m=8, v=1, recompute="none", zero=0, sp=True)
    overlap = Runtime("x", tp_overlap=True)
    exposed = predict(shape, NO_SHARE, c).breakdown.tp_comm
    hidden = predict(shape, NO_SHARE, c, runtime=overlap).breakdown.tp_comm
    assert 0 < hidden < exposed / 20          # the ends' collectives and the norms' sum, a few % of the layers'
    with_share = predict(shape, DGX_H100, c, runtime=overlap).breakdown.tp_comm
    assert with_share == pytest.approx(hidden + DGX_H100.comm_compute_share * (exposed - hidden), rel=1e-6)
