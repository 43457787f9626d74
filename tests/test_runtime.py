"""The ParallelModule as a user meets it: loss-only runs, full state dicts both ways, models on meta,
the collective tracer against the plan, and bounded timeouts. One 2-rank process group for all."""
import copy
import os
import time

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.models import GPT, GPTConfig
from autoshard.ir.program import comm_summary
from tests.distributed import run_distributed
from tests.models import batch, build


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _runtime(rank, world):
    out = {}
    mesh = autoshard.init_mesh(tp=world)
    args, _ = batch("gpt", 96)
    model = build("gpt")
    ref = copy.deepcopy(model)
    _, rloss = ref(*args)

    pm = autoshard.parallelize(model, mesh, example_args=args, loss_only=True)
    logits, loss = pm(*args)
    out["loss_only: logits"] = logits
    out["loss_only: loss"] = rel(loss.detach(), rloss.detach())

    # the tracer counts what the plan says, call for call and byte for byte
    pm.reset_comm_counts()
    pm(*args)[1].backward()
    planned_calls, planned_bytes = comm_summary(pm.program.collectives)
    calls, nbytes = pm.comm_counts()
    out["tracer calls"] = (dict(calls), planned_calls)
    out["tracer bytes"] = (dict(nbytes), planned_bytes)

    # full state dict -> the single-device model, strict, tied names included
    for p in pm.parameters():
        p.data.add_(0.001)  # move away from the seed so the round trip is not trivially equal
    fresh = build("gpt")
    fresh.load_state_dict(pm.full_state_dict(), strict=True)
    out["full_state_dict -> single device"] = rel(pm(*args)[1].detach(), fresh(*args)[1].detach())

    # a single-device state dict -> the sharded model
    other = build("gpt", vocab_size=96)
    torch.manual_seed(123)
    for p in other.parameters():
        p.data.normal_(0, 0.05)
    pm.load_full_state_dict(other.state_dict())
    out["load_full_state_dict"] = rel(pm(*args)[1].detach(), other(*args)[1].detach())

    # a model built on meta compiles without its weights, then loads them
    with torch.device("meta"):
        meta_model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=96))
    pm_meta = autoshard.parallelize(meta_model, mesh, example_args=args)
    assert all(not p.is_meta for p in pm_meta.parameters())
    pm_meta.load_full_state_dict(ref.state_dict())
    out["meta model"] = rel(pm_meta(*args)[1].detach(), rloss.detach())

    # ranks that disagree are told so, on every rank, before any training collective runs
    torch.manual_seed(rank)  # a forgotten common seed: each rank draws other weights
    try:
        autoshard.parallelize(GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=16)), mesh, example_args=args)
        out["unseeded"] = None
    except RuntimeError as e:
        out["unseeded"] = str(e)
    other_args = tuple(a[:, :4].contiguous() for a in args) if rank == 1 else args  # another shape on rank 1
    try:
        autoshard.parallelize(build("gpt"), mesh, example_args=other_args)
        out["other plan"] = None
    except RuntimeError as e:
        out["other plan"] = str(e)

    # a data-loader slip (each rank of one replica given other rows) is an error on every rank, not a wrong loss
    theirs = batch("gpt", 96, seed=2)[0] if rank == 1 else args
    for name, make, call in (
            ("tp batch", lambda: autoshard.parallelize(build("gpt"), mesh, example_args=args), lambda m: m(*theirs)),
            ("pp batch", lambda: autoshard.parallelize(build("gpt", n_layer=2), autoshard.init_mesh(pp=world),
                                                       example_args=(torch.cat([args[0]] * 2),
                                                                     torch.cat([args[1]] * 2)), microbatches=2),
             lambda m: m.step(torch.cat([theirs[0]] * 2), torch.cat([theirs[1]] * 2)))):
        try:
            call(make())
            out[name] = None
        except RuntimeError as e:
            out[name] = str(e)
    out["data_parallel_rank"] = autoshard.data_parallel_rank(mesh)

    # a mesh that does not cover the world fails before any collective
    try:
        autoshard.init_mesh(tp=4)
        out["mesh mismatch"] = None
    except ValueError as e:
        out["mesh mismatch"] = str(e)
    return out


def test_runtime_features():
    results = run_distributed(_runtime, 2, timeout=300)
    for rank, out in enumerate(results):
        assert out["loss_only: logits"] is None
        for key in ("loss_only: loss", "full_state_dict -> single device", "load_full_state_dict", "meta model"):
            assert out[key] <= 1e-5, (rank, key, out[key])
        measured, planned = out["tracer calls"]
        assert measured == planned and sum(measured.values()) > 0
        measured, planned = out["tracer bytes"]
        assert measured == planned
        assert "world has 2" in out["mesh mismatch"] and "tp=4" in out["mesh mismatch"]
        assert "weights differ between tensor-parallel ranks" in out["unseeded"], out["unseeded"]
        assert "compiled different plans" in out["other plan"], out["other plan"]
        assert "tp ranks were given different batches" in out["tp batch"], out["tp batch"]
        assert "pp ranks were given different batches" in out["pp batch"], out["pp batch"]
        assert "data_parallel_rank" in out["tp batch"] and out["data_parallel_rank"] == (0, 1)


def _hang(rank, world):
    os.environ["AUTOSHARD_TIMEOUT"] = "3"
    autoshard.init_mesh(tp=world)
    if rank == 1:
        time.sleep(8)  # never joins the collective below
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:  # gloo raises once the process-group timeout expires
        return time.monotonic() - start, type(e).__name__
    return None


def test_collective_timeout_is_bounded():
    """A rank waiting on a collective its peer never joins fails after AUTOSHARD_TIMEOUT, not never."""
    results = run_distributed(_hang, 2, timeout=60, init_pg=False)
    waited, _ = results[0]
    assert waited < 8


def test_program_cache_keeps_the_most_recently_used_and_closes_the_rest():
    from autoshard.runtime.program_cache import ProgramCache
    closed = []
    cache = ProgramCache(2, "program", on_drop=closed.append)
    cache.put("a", "A"), cache.put("b", "B")
    assert cache.get("a") == "A"          # now the most recently used: "b" goes first
    cache.put("c", "C")
    assert closed == ["B"] and "b" not in cache and len(cache) == 2 and cache.values() == ["A", "C"]
    assert cache.get("b") is None
    with pytest.raises(ValueError, match="max_programs=0"):
        ProgramCache(0, "program")
    owner = {"max_programs": 3}                 # a module's limit, changed after the cache was made
    live = ProgramCache(lambda: owner["max_programs"], "program")
    for k in "abc":
        live.put(k, k.upper())
    owner["max_programs"] = 1
    live.put("d", "D")
    assert live.values() == ["D"]


def test_batch_fingerprint_has_one_size_and_compares_nans():
    from autoshard.runtime.batch_check import fingerprint
    a = torch.tensor([[1.0, float("nan")], [3.0, 4.0]])
    assert torch.equal(fingerprint([a, 2]), fingerprint([a.clone(), 3]))          # NaNs and non-tensors
    assert fingerprint([a]).shape == fingerprint([a, a, torch.ones(5)]).shape == (6,)
    assert not torch.equal(fingerprint([a]), fingerprint([a.flip(0)]))            # same sum, other order
    assert not torch.equal(fingerprint([a.reshape(4)]), fingerprint([a]))         # same values, other shape
