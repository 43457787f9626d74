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


def _leaves_state(rank, world_size):
    """Changes what a fresh rank would not have: the next call must not see any of it."""
    import os
    seen = dict(pid=os.getpid(), env=os.environ.get("AUTOSHARD_POOL_PROBE"), grad=torch.is_grad_enabled(),
                dtype=str(torch.get_default_dtype()), cwd=os.getcwd(), seed=torch.initial_seed())
    os.environ["AUTOSHARD_POOL_PROBE"] = "left behind"
    os.chdir("/")
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234)
    return seen


def test_pooled_ranks_serve_call_after_call_from_a_fresh_state(monkeypatch):
    from autoshard.launcher import RankPool
    pool = RankPool(2)
    try:
        first, second = pool.run(_leaves_state), pool.run(_leaves_state)
        for a, b in zip(first, second):
            assert a["pid"] == b["pid"], "the second call ran in new processes"
            assert b["env"] is None and b["grad"] and b["dtype"] == "torch.float32", b
            assert b["cwd"] == a["cwd"] and b["seed"] == a["seed"] != 1234, (a, b)
        monkeypatch.setenv("AUTOSHARD_POOL_PROBE", "set by the test")    # the caller's environment, now
        assert all(c["env"] == "set by the test" for c in pool.run(_leaves_state))
        monkeypatch.delenv("AUTOSHARD_POOL_PROBE")
        with pytest.raises(RuntimeError, match="boom from rank 1"):
            pool.run(_raising_body)
        assert not pool.alive                  # a failed call closes the pool ...
        third = pool.run(_leaves_state)        # ... and the next one starts another
        assert all(t["pid"] != a["pid"] for t, a in zip(third, first)) and all(t["env"] is None for t in third)
    finally:
        pool.close()
