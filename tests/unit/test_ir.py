"""The shared IR and the pass manager: one plan per placement change, run and counted as planned; a 2-D
simulated mesh; pass requirements; the shape check's failures; the captured graph left untouched."""
import itertools

import pytest
import torch

import autoshard
from autoshard.ir import meta as M
from autoshard.ir.mesh import MeshSpec
from autoshard.ir.placement import P, R, Shard, local_shape
from autoshard.ir.redistribute import plan_redistribute, redistribute_steps
from autoshard.passes.capture import capture
from autoshard.passes.manager import PASSES, PassContext, check_pass_list, run_passes
from autoshard.passes.validate import ShapeCheckError, check_local_shapes_pass
from autoshard.runtime.collectives import redistribute
from autoshard.runtime.layout import take_shard
from tests.harness.models import batch, build
from tests.harness.simulate import run_ranks

PLACEMENTS = [R, P, Shard(0), Shard(1), Shard(1, blocks=3)]


def _full_to_local(full, placement, rank, t):
    if placement == P:  # rank 0 holds the value, the rest zeros: sums to it
        return full.clone() if rank == 0 else torch.zeros_like(full)
    if isinstance(placement, Shard):
        return take_shard(full, placement.dim, full.shape[placement.dim], t, rank, placement.blocks).clone()
    return full.clone()


@pytest.mark.parametrize("t", [2, 3])
def test_redistribution_runs_exactly_its_plan(t):
    """For every pair of placements (padded and blocked dims too): the runtime executes the planned steps,
    the value arrives right, and the collectives it runs, forward and backward, are those the plan lists
    (the list the cost model prices and the dump prints); and backward gives each rank the gradient its
    source placement holds: its chunk of a shard, the whole of a replica or a partial sum."""
    shape = (5, 3 * t * 2)                                   # dim 0 padded at t=2 and t=3; dim 1 blocked
    full = torch.randn(shape, dtype=torch.float64)
    grad = torch.randn(shape, dtype=torch.float64)
    mesh = MeshSpec(tp=t)
    for src, dst in itertools.product(PLACEMENTS, PLACEMENTS):
        if src == dst:
            continue
        transforms = plan_redistribute(src, dst, shape, "tp", t)
        steps = redistribute_steps(transforms, True, shape, "", t)
        planned = sorted((s.phase, s.kind) for s in steps)
        planned_bytes = sum(s.numel for s in steps) * full.element_size()

        def body(rank, comms):
            comm = comms["tp"]
            x = _full_to_local(full, src, rank, t).requires_grad_()
            y = redistribute(x, transforms, comm)
            y.backward(_full_to_local(grad, dst, rank, t) if isinstance(dst, Shard) else grad)
            return y.detach(), sorted((ph, k) for (_, ph, k), n in comm.tracer.calls.items() for _ in range(n)), \
                sum(comm.tracer.bytes.values()), x.grad

        results = run_ranks(mesh, body)
        for rank, (y, ran, nbytes, dx) in enumerate(results):
            assert ran == planned, (src, dst, rank, ran, planned)
            assert torch.equal(dx, _full_to_local(grad, src, rank, t) if isinstance(src, Shard) else grad), (src, dst)
            assert nbytes == planned_bytes, (src, dst, rank, nbytes, planned_bytes)   # padding included
            if dst != P:
                want = _full_to_local(full, dst, rank, t)
                assert y.shape == local_shape(shape, dst, t) and torch.equal(y, want), (src, dst, rank)
        if dst == P:
            assert torch.allclose(sum(y for y, _, _, _ in results), full), (src, dst)


def test_simulator_runs_a_two_axis_mesh():
    """Every rank of a (dp=2, tp=2) mesh in threads: each axis's group sums over its own members."""
    mesh = MeshSpec(dp=2, tp=2)

    def body(rank, comms):
        x = torch.tensor([float(rank)])
        return float(comms["tp"].all_reduce(x.clone(), "fwd")), float(comms["dp"].all_reduce(x.clone(), "fwd"))

    out = run_ranks(mesh, body)
    assert out == [(1.0, 2.0), (1.0, 4.0), (5.0, 2.0), (5.0, 4.0)]   # tp groups {0,1},{2,3}; dp {0,2},{1,3}


def test_disable_checks_names_and_requirements():
    with pytest.raises(ValueError, match=r"unknown pass name\(s\) \['plann'\]"):
        check_pass_list(("plann",))
    with pytest.raises(ValueError, match=r"pass 'tp_rewrite' needs the 'autoshard_strategy' annotation, which "
                                         r"pass 'plan' provides, but 'plan' is disabled"):
        autoshard.compile_rank(build("gpt", n_layer=1), {"tp": 2}, 0, batch("gpt", 96)[0],
                               options=autoshard.CompileOptions(disable=("plan",)))
    assert [p.name for p in check_pass_list(("overlap_grad_allreduce",))] == \
        [p.name for p in PASSES if p.name != "overlap_grad_allreduce"]


def test_disabled_pass_still_gives_a_working_program():
    from tests.harness.simulate import simulate
    model = build("gpt", n_layer=1)
    args, _ = batch("gpt", 96)
    ref = model(*args)[1]
    for out, _, _ in simulate(model, 2, args, loss_fn=lambda o: o[1], disable=("overlap_grad_allreduce", "fuse_bias")):
        torch.testing.assert_close(out[1], ref, rtol=1e-5, atol=1e-6)


def _compiled(t=2):
    model = build("gpt", n_layer=1)
    args, _ = batch("gpt", 96)
    cap = capture(model, args, {})
    gm, _ = run_passes(cap.gm, PassContext(MeshSpec(tp=t), 0))
    return cap, gm


def test_captured_graph_is_untouched_by_compiling():
    cap, gm = _compiled()
    assert gm is not cap.gm
    assert not any(M.SPEC.has(n) or M.LOCAL_SHAPE.has(n) for n in cap.gm.graph.nodes)
    fresh = capture(build("gpt", n_layer=1), batch("gpt", 96)[0], {})
    assert [n.format_node() for n in cap.gm.graph.nodes] == [n.format_node() for n in fresh.gm.graph.nodes]


def test_shape_check_fails_on_a_missing_or_wrong_local_shape():
    _, gm = _compiled()
    check_local_shapes_pass(gm)  # the compiled program passes
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.layer_norm.default)
    want = M.LOCAL_SHAPE.get(node)
    M.LOCAL_SHAPE.set(node, (want[0], want[1], want[2] + 1))
    with pytest.raises(ShapeCheckError, match=rf"local shape of {node.name} .* is \(2, 8, 32\), the plan says"):
        check_local_shapes_pass(gm)
    M.LOCAL_SHAPE.set(node, None)   # what tp_rewrite writes for a non-tensor: a tensor here is a bug
    with pytest.raises(ShapeCheckError, match="the plan says None"):
        check_local_shapes_pass(gm)
    del node.meta[M.LOCAL_SHAPE.key]
    with pytest.raises(M.MissingMetaError, match=rf"'{node.name}' .* no 'autoshard_local_shape' annotation: pass "
                                                 r"'tp_rewrite' provides it"):
        check_local_shapes_pass(gm)


def test_unbound_program_refuses_real_tensors():
    from autoshard.ir.ops import NotBoundError
    _, gm = _compiled()
    inputs = [torch.zeros(M.LOCAL_SHAPE.get(n), dtype=n.meta["val"].dtype) for n in gm.graph.nodes if n.op == "placeholder"]
    with pytest.raises(NotBoundError, match="instantiate it with autoshard.runtime.ParallelModule"):
        gm(*inputs)


def test_specs_carry_every_mesh_axis():
    prog = autoshard.compile_rank(build("gpt", n_layer=1), {"tp": 2}, 0, batch("gpt", 96)[0])
    specs = {p.name: p.spec for p in prog.params}
    assert specs["transformer.h.0.mlp.c_fc.weight"].placements == (R, R, Shard(0))   # (dp, pp, tp)
    tokens = next(n for n in prog.gm.graph.nodes if n.op == "placeholder" and M.KIND.get(n) == "input")
    assert M.SPEC.get(tokens).dp == Shard(0)                # the batch is split over dp by rule


def test_state_dict_names_survive_double_underscores():
    """Parameters are stored as p0, p1, ... with their names beside them: no name encoding to collide."""
    import torch.nn as nn
    from autoshard.runtime.module import ParallelModule

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.up__proj, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
            self.register_buffer("pos__scale", torch.ones(8))

        def forward(self, x):
            return self.down(torch.relu(self.up__proj(x * self.pos__scale))).sum()

    torch.manual_seed(0)
    model = M()
    pm = ParallelModule(autoshard.compile_rank(model, {"tp": 1}, 0, (torch.randn(2, 8),)), model)
    assert set(pm.state_dict()) == set(model.state_dict())
    pm.load_state_dict(model.state_dict())
    assert set(pm.full_state_dict()) == set(model.state_dict())
