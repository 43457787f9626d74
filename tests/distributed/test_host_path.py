"""The host path of a call: no DTensor autograd wrapping per parameter, fused optimizers without DTensor's
dispatch, and gradients that still behave as ``backward`` leaves them (set, accumulated, reset by
``zero_grad``). Counted, never timed: ``benchmarks.step`` times it."""
import copy

import pytest
import torch

import autoshard
from autoshard.runtime import fused_optim
from benchmarks.step import WrapCounter
from tests.harness.distributed import run_distributed
from tests.harness.models import batch, build


def _full_grads(pm):
    return {n: pm.gather(n, p.grad)
            for n, p in pm.local_parameters().items() if p.grad is not None}


def _max_rel(got: dict, ref: dict) -> float:
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    return max(float((got[n] - ref[n]).abs().max() / max(float(ref[n].abs().max()), 1e-12)) for n in ref)


def _host_path(rank, world):
    model = build("gpt", vocab_size=97)
    ref = copy.deepcopy(model)
    (idx, tgt), _ = batch("gpt", 97)
    pm = autoshard.parallelize(model, autoshard.init_mesh(tp=world), (idx, tgt), loss_only=True)
    out = {}
    pm(idx, tgt)[1].backward()              # compiled and warm; the leaves are made on the first call
    pm.zero_grad(set_to_none=True)
    with WrapCounter() as calls:
        pm(idx, tgt)[1].backward()
    out["wraps_call"] = calls.calls
    out["grad_type"] = type(next(iter(pm.parameters())).grad).__name__
    ref(idx, tgt)[1].backward()
    rgrads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    out["once"] = _max_rel(_full_grads(pm), rgrads)
    pm(idx, tgt)[1].backward()               # no zero_grad: accumulated, as backward does
    out["twice"] = _max_rel(_full_grads(pm), {n: 2 * g for n, g in rgrads.items()})
    pm.zero_grad(set_to_none=True)
    out["none_after_zero"] = all(p.grad is None for p in pm.parameters())
    pm(idx, tgt)[1].backward()               # nothing left over from before zero_grad
    out["after_zero"] = _max_rel(_full_grads(pm), rgrads)
    pm.zero_grad(set_to_none=False)          # zeroed in place, then accumulated into
    pm(idx, tgt)[1].backward()
    out["after_zero_inplace"] = _max_rel(_full_grads(pm), rgrads)
    pm.zero_grad(set_to_none=True)
    pm.step(idx, tgt)
    pm.zero_grad(set_to_none=True)
    with WrapCounter() as calls:
        pm.step(idx, tgt)
    out["wraps_step"] = calls.calls
    out["step_grads"] = _max_rel(_full_grads(pm), rgrads)
    pm.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)

    # fused AdamW over the DTensors: the local fast path (never DTensor's dispatch), the same steps as torch's
    fallbacks = []
    original = fused_optim._default_dispatch
    fused_optim._default_dispatch = lambda *a: fallbacks.append(a[0]) or original(*a)
    try:
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-4, fused=True)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4, fused=True)
        for step in range(3):
            (i, t), _ = batch("gpt", 97, seed=step + 3)
            pm(i, t)[1].backward()
            ref(i, t)[1].backward()
            opt.step(); ropt.step(); opt.zero_grad(); ropt.zero_grad()
    finally:
        fused_optim._default_dispatch = original
    out["fallbacks"] = len(fallbacks)
    full = pm.full_state_dict()
    out["adamw_params"] = _max_rel({n: full[n] for n, _ in ref.named_parameters()},
                                   {n: p.detach() for n, p in ref.named_parameters()})
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_call_wraps_no_parameter_and_gradients_behave_as_backward(world):
    for r in run_distributed(_host_path, world):
        assert r["wraps_call"] == 0 and r["wraps_step"] == 0, r
        assert r["grad_type"] == "DTensor"
        assert r["once"] < 1e-5 and r["after_zero"] < 1e-5 and r["after_zero_inplace"] < 1e-5, r
        assert r["twice"] < 1e-5 and r["step_grads"] < 1e-5, r
        assert r["none_after_zero"]
        assert r["fallbacks"] == 0, "fused AdamW went through DTensor's dispatch"
        assert r["adamw_params"] < 1e-5, r


def _fallback(rank, world):
    """Lists whose layouts differ index by index are not the handler's: DTensor's own dispatch runs them,
    with the same result as plain tensors."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = autoshard.init_mesh(tp=world)["tp"]
    torch.manual_seed(0)
    full = [torch.randn(4, 6) for _ in range(3)]
    params = [DTensor.from_local(full[0].chunk(world)[rank].clone(), mesh, [Shard(0)]),
              DTensor.from_local(full[1].clone(), mesh, [Replicate()])]
    grads = [DTensor.from_local(full[2].clone(), mesh, [Replicate()]).redistribute(mesh, [Shard(0)]),
             DTensor.from_local(full[2].clone(), mesh, [Replicate()])]
    same = fused_optim._local_lists(([params[1]], [grads[1]]))
    mixed = fused_optim._local_lists(([params[0], params[1]], [grads[1], grads[0]]))
    return same is not None, mixed is None


def test_the_fused_optimizer_handler_declines_mixed_layouts():
    for same, mixed in run_distributed(_fallback, 2):
        assert same and mixed
