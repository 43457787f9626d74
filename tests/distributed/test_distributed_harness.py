"""Self-test for tests.harness.distributed.run_distributed (2 gloo ranks on CPU)."""
import pytest
import torch
import torch.distributed as dist

from tests.harness.distributed import run_distributed


def _all_reduce_body(rank, world_size, base):
    t = torch.tensor([float(base + rank)])
    dist.all_reduce(t)
    return (rank, world_size, t.item())


def _raising_body(rank, world_size):
    # No collective on either rank, so the healthy rank cannot hang on the
    # failing one.
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def test_all_reduce_two_ranks():
    results = run_distributed(_all_reduce_body, 2, 10)
    expected = float((10 + 0) + (10 + 1))
    assert results == [(0, 2, expected), (1, 2, expected)]


def test_error_in_one_rank_is_reported_with_traceback():
    with pytest.raises(AssertionError) as excinfo:
        run_distributed(_raising_body, 2, timeout=60)
    msg = str(excinfo.value)
    assert "rank 1 failed" in msg
    assert "Traceback (most recent call last)" in msg
    assert "ValueError: boom from rank 1" in msg
    assert "_raising_body" in msg
    assert "rank 0 failed" not in msg
