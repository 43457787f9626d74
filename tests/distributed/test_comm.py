"""AxisComm's collectives on gloo against their definitions: the all-gather and the reduce-scatter run
as all-to-alls there (``runtime/comm.py``), so each is checked, sync and async, along every dim of
tensors of a few shapes, on 2 and 3 ranks, against the concatenation and the chunked sum computed
locally from every rank's input."""
import pytest
import torch
import torch.distributed as dist

from autoshard.runtime.comm import AxisComm
from tests.harness.distributed import run_distributed

SHAPES = [(6,), (6, 4), (2, 6, 5), (3, 2, 6)]


def _rank_input(shape, rank, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


def _collectives(rank, world):
    comm = AxisComm("tp", world, rank, dist.group.WORLD)
    worst = 0.0
    for dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
        for shape in SHAPES:
            for dim in range(-len(shape), len(shape)):
                inputs = [_rank_input(shape, r, dtype) for r in range(world)]
                # the all-gather: this rank's input, every rank's concatenated
                want = torch.cat(inputs, dim=dim)
                for got in (comm.all_gather(inputs[rank], dim, "fwd"),
                            comm.all_gather_async(inputs[rank], dim, "bwd").wait()):
                    assert got.shape == want.shape and got.dtype == dtype, (shape, dim)
                    assert torch.equal(got, want), ("all_gather", shape, dim, dtype)
                # the reduce-scatter: every rank's input of world x the size along dim
                full = [torch.cat([i] * world, dim=dim) + r for r, i in enumerate(inputs)]
                want = sum(full).chunk(world, dim=dim)[rank]
                for got in (comm.reduce_scatter(full[rank], dim, "fwd"),
                            comm.reduce_scatter_async(full[rank], dim, "bwd").wait()):
                    assert got.shape == want.shape and got.dtype == dtype, (shape, dim)
                    assert got.is_contiguous()
                    worst = max(worst, float((got - want).abs().max()))
    # a non-contiguous input (a transposed view) gathers and scatters as its values
    x = _rank_input((5, 6), rank, torch.float32).t()
    assert torch.equal(comm.all_gather(x, 0, "fwd"),
                       torch.cat([_rank_input((5, 6), r, torch.float32).t() for r in range(world)], 0))
    calls, _ = comm.tracer.calls, comm.tracer.bytes
    return worst, dict(calls)


@pytest.mark.parametrize("world", [2, 3])
def test_gather_and_reduce_scatter_match_their_definitions(world):
    for worst, calls in run_distributed(_collectives, world, timeout=300):
        assert worst < 1e-5
        cases = 4 * sum(2 * len(s) for s in SHAPES)       # dtypes x (shape, dim): each call counted once
        assert calls[("tp", "bwd", "all_gather")] == calls[("tp", "fwd", "reduce_scatter")] == cases
        assert calls[("tp", "bwd", "reduce_scatter")] == cases and calls[("tp", "fwd", "all_gather")] == cases + 1
