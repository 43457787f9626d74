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


def _environment_and_imports(rank, world_size):
    import os
    import sys
    return dict(env=os.environ.get("AUTOSHARD_POOL_PROBE"), cwd=os.getcwd(), world=dist.get_world_size(),
                transformers="transformers" in sys.modules)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_fresh_ranks_take_the_callers_environment_under_either_start_method(method, monkeypatch, tmp_path):
    """A forked rank inherits the server's environment, the caller's as it was when the server started:
    the launch sends the caller's as it is now. Under the forkserver the suite's AUTOSHARD_PRELOAD
    (transformers among them) is already imported; a spawned rank imports afresh."""
    from autoshard.launcher import launch
    monkeypatch.setenv("AUTOSHARD_START_METHOD", method)
    monkeypatch.setenv("AUTOSHARD_POOL_PROBE", f"set after the server started ({method})")
    monkeypatch.chdir(tmp_path)
    for r in launch(_environment_and_imports, 2, timeout=120):
        assert r["env"] == f"set after the server started ({method})" and r["world"] == 2, r
        assert r["cwd"] == str(tmp_path), r
        assert r["transformers"] == (method == "forkserver"), r


def test_a_preload_that_fails_warns_and_leaves_the_import_to_the_ranks():
    from autoshard import _forkserver_preload
    with pytest.warns(UserWarning, match="no_such_module_for_autoshard did not import"):
        _forkserver_preload._preload("json, no_such_module_for_autoshard")


def test_an_unknown_start_method_is_a_clear_error(monkeypatch):
    from autoshard.launcher import launch
    monkeypatch.setenv("AUTOSHARD_START_METHOD", "fork")
    with pytest.raises(ValueError, match="AUTOSHARD_START_METHOD='fork'"):
        launch(_environment_and_imports, 2)


def test_a_pool_ranks_health_that_overtakes_a_slower_ranks_result_is_kept():
    """A pool rank reports its result, then (after the barrier) its health. Each rank's messages arrive in
    order, but a fast rank's health can reach the caller before a slow rank's result (the slow rank's
    larger result still in its queue's feeder thread): the results' collection kept it, so the health
    check counts every rank at once. Dropped, as before, it cost the full health timeout (60 s) and a
    closed pool, about twice a test-suite run."""
    import queue
    import time

    from autoshard.launcher import _all_ok, _collect

    class Alive:
        exitcode = None
    q = queue.Queue()
    for item in [(7, 1, "ok", b"r1"), (-7, 1, "ok", b""), (6, 0, "ok", b"stale"), (7, 0, "ok", b"r0"),
                 (-7, 0, "ok", b"")]:
        q.put(item)
    early, start = {}, time.monotonic()
    results = _collect([Alive(), Alive()], q, 5, tag=7, early=early)
    health = _collect([Alive(), Alive()], q, 5, tag=-7, early=early)
    assert results == {1: ("ok", b"r1"), 0: ("ok", b"r0")} and _all_ok(health, 2)
    assert time.monotonic() - start < 1         # nothing waited for a message already read
