"""Generated Triton kernels (``kernels/``) and the ``fuse`` pass, run in Triton's interpreter on CPU.

Each fusion pattern is checked against eager PyTorch: fp32 within 1e-5, bf16 within 1e-2 of an fp64
reference, gradients by gradcheck in fp64, on odd shapes with broadcast and non-contiguous operands.
The pass is checked on whole per-rank programs (GPT at tp=2 in the simulator, a Llama-style and a GPT-2
HF model): fused and unfused give the same loss and gradients.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
# masked lanes (padding columns, -1e4 scores) overflow in numpy inside the interpreter; they are never stored
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from autoshard.ir import meta as M  # noqa: E402
from autoshard.kernels.launch import compile_group, launch_shape  # noqa: E402
from autoshard.kernels.lower import Unfusable  # noqa: E402
from tests.harness import fusion_patterns as fp  # noqa: E402

B, S, H = 2, 5, 37          # odd sizes: nothing is a power of two


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_KERNEL_CACHE", str(tmp_path_factory.getbasetemp() / "kernels"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")


BY_NAME = {p.name: p for p in fp.PATTERNS}
PATTERNS = list(BY_NAME)


def _inputs(pattern, dtype=torch.float32):
    return BY_NAME[pattern].fn, fp.operands(pattern, B, S, H, heads=3, dtype=dtype)


def _group(pattern, fn, ins):
    return compile_group(fn, ins, pattern, grad_inputs=BY_NAME[pattern].grad_inputs)


def _wants(pattern, ins):
    wants = BY_NAME[pattern].grad_inputs
    return [x.is_floating_point() and (wants is None or i in wants) for i, x in enumerate(ins)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_fp32_forward_and_backward_match_eager(pattern):
    fn, ins = _inputs(pattern)
    group = _group(pattern, fn, ins)
    leaves = [x.clone().requires_grad_(w) for x, w in zip(ins, _wants(pattern, ins))]
    refs = [x.clone().requires_grad_(w) for x, w in zip(ins, _wants(pattern, ins))]
    out, ref = group(*leaves), fn(*refs)
    for o, e in zip(out, ref):
        torch.testing.assert_close(o, e, atol=1e-5, rtol=1e-5)
    grads = [torch.randn_like(o) for o in ref]
    torch.autograd.backward(out, grads)
    torch.autograd.backward(ref, grads)
    for a, e in zip(leaves, refs, strict=True):
        if e.grad is not None:
            torch.testing.assert_close(a.grad, e.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pattern", ["bias_gelu", "residual_layer_norm", "residual_rms_norm", "scale_mask_softmax"])
def test_bf16_within_1e2_of_fp64(pattern):
    fn, ins = _inputs(pattern, torch.bfloat16)
    out = _group(pattern, fn, ins)(*ins)
    ref = fn(*[x.double() if x.is_floating_point() else x for x in ins])
    for o, e in zip(out, ref):
        assert o.dtype == torch.bfloat16            # computed in fp32, cast at the store
        err = float((o.double() - e).abs().max() / e.abs().max())
        assert err < 1e-2, err


@pytest.mark.parametrize("pattern", PATTERNS)
def test_gradcheck_fp64(pattern):
    fn, ins = _inputs(pattern, torch.float64)
    group = _group(pattern, fn, ins)
    leaves = [x.clone().requires_grad_(w) for x, w in zip(ins, _wants(pattern, ins))]
    assert torch.autograd.gradcheck(lambda *xs: group(*xs), leaves, fast_mode=True)


def test_non_contiguous_operands_compile_their_own_variant():
    x = torch.randn(B, H, S).transpose(1, 2)         # strides (S*H, 1, S)
    b = torch.randn(H)
    group = compile_group(fp.bias_gelu, [x.contiguous(), b], "bias_gelu")
    torch.testing.assert_close(group(x, b)[0], fp.bias_gelu(x, b)[0], atol=1e-5, rtol=1e-5)
    layouts = {k[0][1] for k in group.forward_kernels.kernels}
    assert (S * H, H, 1) in layouts and (S * H, 1, S) in layouts
    strided = [k for k in group.forward_kernels.kernels.values() if k.plan.inputs[0].offset != "37*rows + cols"]
    assert strided and "cols * 5" in strided[0].source     # the transposed operand's column stride


def test_backward_saves_only_what_it_reads_and_recomputes_the_rest():
    fn, ins = _inputs("residual_layer_norm")
    group = compile_group(fn, ins, "ln")
    # the backward reads the residual sum y (an output, which the next layer keeps anyway) and the weight;
    # not x and r to add them again, not the bias; mean and rstd are recomputed from y
    assert group.saved == (2,) and group.saved_outputs == (0,)
    fwd, bwd = group.kernels()
    assert fwd.plan.template == bwd.plan.template == "row"
    # mean and variance recomputed, two row sums for dx, the weight and bias gradients
    assert bwd.source.count("tl.sum(") == 6
    assert sum(o.kind == "colsum" for o in bwd.plan.outputs) == 2
    # softmax's backward reads its output and the mask, as eager's does; GeLU's its input
    fn, ins = _inputs("scale_mask_softmax")
    assert _group("scale_mask_softmax", fn, ins).saved_outputs == (0,)
    fn, ins = _inputs("bias_gelu")
    group = _group("bias_gelu", fn, ins)
    assert group.saved == (0, 1) and group.saved_outputs == ()


def test_unsupported_op_is_reported_not_fused():
    def fn(x):                                       # dropout with p > 0 draws torch's RNG: not in the table
        return (F.dropout(x, 0.1, True) * 2,)
    with pytest.raises(Unfusable, match="bernoulli"):
        compile_group(fn, [torch.randn(3, 4)], "dropout")


def test_middle_dim_reduction_is_refused():
    with pytest.raises(Unfusable, match="only the last dim"):
        compile_group(lambda x: (x.sum(1, keepdim=True) * x,), [torch.randn(2, 3, 4)], "mid")


def test_a_row_wider_than_one_block_is_refused():
    """A softmax over a 256K vocabulary row: the row template would need a 2**18-element block (Triton
    refuses over 2**20, and registers spill long before): the group stays eager, and says why."""
    x = torch.randn(2, 1 << 17)
    with pytest.raises(Unfusable, match=r"rows of 131072 elements are longer than the row template holds \(32768\)"):
        compile_group(lambda x: (torch.softmax(x, -1),), [x], "wide")


def test_kernels_are_files_in_the_cache_named_by_their_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_KERNEL_CACHE", str(tmp_path))
    fn, ins = _inputs("swiglu")
    group = compile_group(fn, ins, "swiglu")
    files = sorted(p.name for p in tmp_path.glob("*.py"))
    assert files == sorted(f"{k.module_name}.py" for k in group.kernels())
    assert all((tmp_path / f).read_text().startswith('"""Generated by autoshard') for f in files)


def test_launch_shape_interpreter_uses_large_blocks_and_gpu_small_tiles():
    fn, ins = _inputs("residual_layer_norm")
    plan = compile_group(fn, ins, "ln").kernels()[0].plan
    assert launch_shape(plan, interpreter=True).grid == (1,)          # one instance holds all 10 rows
    gpu = launch_shape(plan, interpreter=False)
    assert gpu.block_c == 64 and gpu.block_r * gpu.block_c <= 4096


# ------------------------------------------------------------------------------------------------------------
# the fuse pass on whole per-rank programs


def _gpt(layers=2):
    from autoshard.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, block_size=16, n_layer=layers, n_head=2, n_embd=32))
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, (ids, ids.roll(-1, 1))


def _report(model, args=(), kwargs=None, t=2, **options):
    import autoshard
    from autoshard.ir.mesh import MeshSpec
    prog = autoshard.compile_rank(model, MeshSpec(tp=t), 0, args, kwargs,
                                  options=autoshard.CompileOptions(fuse=True, **options))
    return prog, prog.gm.meta[M.FUSION_REPORT]


def test_gpt_layer_kernel_count():
    """One GPT layer at tp=2 fuses two groups, each one forward and one backward kernel: the attention's
    bias + dropout + residual add + ln_2, and the MLP's bias + dropout + residual + the next layer's ln_1
    (ln_f after the last layer). The embedding's dropout + ln_1 is one more; a lone GeLU and the
    embedding add stay eager (fusing them saves no bytes)."""
    model, args = _gpt(layers=3)
    prog, report = _report(model, args)
    assert report.enabled
    assert len(report.groups) == 1 + 2 * 3
    assert report.kernel_count == 2 * len(report.groups)
    residual = [g for g in report.groups if g.ops == ("aten.add.Tensor", "aten.dropout.default",
                                                       "aten.add.Tensor", "aten.layer_norm.default")]
    assert len(residual) == 6
    for g in residual:
        assert g.fused_bytes < g.eager_bytes and g.fused_backward_bytes < g.eager_backward_bytes
        fwd, bwd = g.kernels
        assert fwd.template == bwd.template == "row"
        assert "tl.sum(" in fwd.source and bwd.source.count("tl.sum(tl.where(mask") == 7  # + the bias grad
    assert {u.nodes for u in report.unfused} >= {("gelu",), ("add",)}
    called = [n.target for n in prog.gm.graph.nodes if n.op == "call_module" and n.target.startswith("fused_")]
    assert len(called) == len(report.groups)


def test_fused_gpt_tp2_matches_unfused_program():
    from tests.harness.simulate import simulate
    model, args = _gpt()
    plain = simulate(model, 2, args, loss_fn=lambda o: o[1], fuse=False)
    fused = simulate(model, 2, args, loss_fn=lambda o: o[1], fuse=True)
    for (po, pg, _), (fo, fg, _) in zip(plain, fused):
        torch.testing.assert_close(fo[1], po[1], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(fo[0], po[0], atol=1e-5, rtol=1e-5)
        assert pg.keys() == fg.keys()
        for name in pg:
            torch.testing.assert_close(fg[name], pg[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fused_hf_models_match_unfused_and_single_device(family):
    from tests.harness.families import FamilyConfig, batch, build, errors, reference, run_tp
    cfg = FamilyConfig(family, layers=2, hidden=64, heads=4, kv_heads=2 if family == "llama" else None, vocab=97)
    model, kwargs = build(cfg), batch(97)
    loss_fn = (lambda out: out.loss)
    fused = run_tp(model, 2, kwargs, loss_fn, fuse=True)
    errs = errors(reference(model, kwargs, loss_fn), fused)
    bad = {k: v for k, v in errs.items() if not v <= 1e-5}
    assert not bad, bad
    _, report = _report(model, kwargs=kwargs)
    ops = {op for g in report.groups for op in g.ops}
    # Llama: RMSNorm (a decomposition: pow, mean, rsqrt, mul) with its residual add; SwiGLU's silu * up.
    # GPT-2: LayerNorm with the residual add.
    assert len(report.groups) >= 2 * cfg.layers
    assert ("aten.rms_norm.default" in ops or "aten.mul.Tensor" in ops) if family == "llama" \
        else "aten.layer_norm.default" in ops


def test_fuse_auto_is_off_on_cpu_and_fuse_true_without_a_backend_says_how(monkeypatch):
    import autoshard
    from autoshard.passes.fusion import FusionUnavailable
    model, args = _gpt(layers=1)
    prog = autoshard.compile_rank(model, {"tp": 2}, 0, args, options=autoshard.CompileOptions(fuse="auto"))
    report = prog.gm.meta[M.FUSION_REPORT]
    assert not report.enabled and "CUDA" in report.why
    assert not any(n.target.startswith("fused_") for n in prog.gm.graph.nodes if n.op == "call_module")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(FusionUnavailable, match="TRITON_INTERPRET=1"):
        autoshard.compile_rank(model, {"tp": 2}, 0, args, options=autoshard.CompileOptions(fuse=True))


def test_plan_md_has_a_fusion_table_and_the_kernel_sources(tmp_path):
    model, args = _gpt(layers=1)
    prog, report = _report(model, args, dump=str(tmp_path))
    plan = (tmp_path / "rank0" / "plan.md").read_text() if (tmp_path / "rank0").exists() else \
        (tmp_path / "plan.md").read_text()
    assert "## Fusion" in plan and "| fused_" in plan and "saved for backward" in plan
    assert "Left to eager ops" in plan and "gelu: moves" in plan
    sources = list(tmp_path.rglob("kernels/*.py"))
    assert len(sources) == report.kernel_count
    assert all("@triton.jit" in p.read_text() for p in sources)


def test_benchmark_on_cpu_counts_bytes_and_says_timings_need_a_gpu(tmp_path):
    from benchmarks import fusion as bench
    res = bench.main(["--rows", "64", "--seq", "16", "--hidden", "48", "--heads", "2", "--no-loss",
                      "--out", str(tmp_path)])
    assert not res["gpu"] and len(res["patterns"]) == len(PATTERNS)
    for row in res["patterns"]:
        assert 0 < row["fused_fwd_bytes"] < row["eager_fwd_bytes"], row
        assert row["fused_bwd_bytes"] <= row["eager_bwd_bytes"], row
    assert "need one" in (tmp_path / "fusion_results.md").read_text()


# ------------------------------------------------------------------------------------------------------------
# dropout inside the kernels: a mask from (seed, stream, element index)


def _dropout_gpt():
    """GPT with dropout 0.1 on the embedding, the residual branches and the MLP; the attention's own
    dropout (inside sdpa, on tp-sharded heads) at 0."""
    from autoshard.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1))
    for block in model.transformer.h:
        block.attn.dropout = 0.0
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, (ids, ids.roll(-1, 1))


def _tp_dropout_rank(rank, world, seed):
    import autoshard
    model, args = _dropout_gpt()
    pm = autoshard.parallelize(model, autoshard.init_mesh(tp=world), args, fuse=True)
    torch.manual_seed(seed)                   # every rank alike, as Megatron's ranks are
    _, loss = pm(*args)
    loss.backward()
    # numpy arrays travel back by value (a tensor would go through shared memory the rank has left)
    return float(loss.detach()), {n: pm.gather(n, p.grad).numpy() for n, p in pm.local_parameters().items()}


def test_dropout_masks_match_across_tp_ranks_and_the_single_device_program():
    """The masks are a function of the seed and the element's place in the (replicated) activation, so
    tp=2 over gloo gives the tp=1 program's loss and gradients exactly, dropout and all."""
    from tests.harness.distributed import run_distributed
    from tests.harness.simulate import simulate
    model, args = _dropout_gpt()
    torch.manual_seed(7)
    (single,) = simulate(model, 1, args, loss_fn=lambda o: o[1], fuse=True)
    torch.manual_seed(8)
    (other,) = simulate(model, 1, args, loss_fn=lambda o: o[1], fuse=True)
    torch.manual_seed(7)
    (no_dropout,) = simulate(model.eval(), 1, args, loss_fn=lambda o: o[1], fuse=True)
    losses = [float(r[0][1].detach()) for r in (single, other, no_dropout)]
    assert len(set(losses)) == 3                      # the masks do something, and depend on the seed
    ranks = run_distributed(_tp_dropout_rank, 2, 7, timeout=240)
    for loss, grads in ranks:
        assert loss == pytest.approx(losses[0], rel=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(torch.from_numpy(g), single[1][name], atol=1e-6, rtol=1e-5, msg=name)


def test_dropout_kernel_recomputes_its_mask_in_backward():
    from autoshard.kernels.rng import dropout_keep

    def fn(x, seed):
        return (x * dropout_keep(seed, list(x.shape), 0.25, 3).to(x.dtype),)

    x, seed = torch.randn(64, 200), torch.tensor(1234)
    group = compile_group(fn, [x, seed], "dropout", grad_inputs=(0,))
    leaf = x.clone().requires_grad_()
    (y,) = group(leaf, seed)
    y.backward(torch.ones_like(y))
    kept = y != 0
    assert 0.7 < kept.float().mean() < 0.8                                # p = 0.25
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    torch.testing.assert_close(leaf.grad, kept.float() / 0.75)            # the same mask, drawn again
    assert torch.equal(group(x, seed)[0], y.detach())                     # reproducible from the seed
    assert not torch.equal(group(x, torch.tensor(99))[0], y.detach())
    assert group.saved == (1,)                                            # only the seed is kept
    # outside a kernel the op draws the same bits (Philox in torch): fusing or not never changes a mask
    torch.testing.assert_close(fn(x, seed)[0], y.detach(), atol=0, rtol=0)


def _pp_rank(rank, world, dropout):
    import copy

    import autoshard
    from autoshard.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=dropout))
    for block in model.transformer.h:
        block.attn.dropout = 0.0
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    mesh = autoshard.init_mesh(pp=world)
    losses = {}
    for fuse in (False, True):
        pm = autoshard.parallelize(copy.deepcopy(model), mesh, (ids, ids), microbatches=2, fuse=fuse)
        torch.manual_seed(3)
        losses[fuse] = float(pm.step(ids, ids))
        grads = {n: p.grad.full_tensor().numpy() for n, p in pm.named_parameters() if p.grad is not None}
        losses[f"grads {fuse}"] = grads
    return losses


def test_fused_pipeline_stages_match_unfused():
    """pm.step with pp=2: each stage's chunk carries its own fused groups; loss and gradients as unfused.
    With dropout, each stage draws its seed beside a parameter (a value a chunk can recompute)."""
    from tests.harness.distributed import run_distributed
    for rank_result in run_distributed(_pp_rank, 2, 0.0, timeout=240):
        assert rank_result[True] == pytest.approx(rank_result[False], rel=1e-6)
        plain, fused = rank_result["grads False"], rank_result["grads True"]
        assert plain.keys() == fused.keys() and plain
        for name in plain:
            torch.testing.assert_close(torch.from_numpy(fused[name]), torch.from_numpy(plain[name]),
                                       atol=1e-6, rtol=1e-5)
    for rank_result in run_distributed(_pp_rank, 2, 0.1, timeout=240):
        assert rank_result[True] == rank_result[True]            # runs, finite


# ------------------------------------------------------------------------------------------------------------
# cases a review found wrong (each against eager, values and gradients)


def _against_eager(fn, ins, grad_of_sum=False, group=None):
    group = group or compile_group(fn, ins, "case")
    leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in ins]
    refs = [x.clone().requires_grad_(x.is_floating_point()) for x in ins]
    out, ref = group(*leaves), fn(*refs)
    for o, e in zip(out, ref, strict=True):
        torch.testing.assert_close(o, e, atol=1e-5, rtol=1e-5)
    if grad_of_sum:                 # the incoming gradient is an expand (stride 0)
        sum(o.sum() for o in out if o.is_floating_point()).backward()
        sum(e.sum() for e in ref if e.is_floating_point()).backward()
    else:
        grads = [torch.randn_like(e) for e in ref]
        torch.autograd.backward(out, grads)
        torch.autograd.backward(ref, grads)
    for a, e in zip(leaves, refs):
        if e.grad is not None:
            torch.testing.assert_close(a.grad, e.grad, atol=1e-5, rtol=1e-5)


def test_a_per_row_value_reaching_a_full_output_is_broadcast():
    _against_eager(lambda x, h: (x.exp() * h.mean(-1, keepdim=True),), [torch.randn(3, 5), torch.randn(3, 5)])
    _against_eager(lambda x: (x.sum(-1, keepdim=True).expand(3, 5) + 0.0,), [torch.randn(3, 5)])


def test_a_gradient_from_sum_compiles_no_new_variant():
    def fn(x, r, w):
        y = x + r
        return y, F.layer_norm(y, (7,), w)
    ins = [torch.randn(3, 7), torch.randn(3, 7), torch.randn(7)]
    group = compile_group(fn, ins, "case")
    _against_eager(fn, ins, group=group)                          # contiguous incoming gradients
    variants = len(group.backward_kernels.kernels)
    _against_eager(fn, ins, grad_of_sum=True, group=group)        # expanded ones (stride 0)
    assert len(group.backward_kernels.kernels) == variants, "a gradient from sum() compiled another variant"


def test_alpha_casts_and_bool_arithmetic():
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    _against_eager(lambda a, b: (torch.add(a, b, alpha=3) - torch.sub(a, b, alpha=0.5),), [x, y])
    m1, m2 = torch.rand(4, 6) > 0.5, torch.rand(4, 6) > 0.5
    _against_eager(lambda a, p, q: (a * (p.float() + q.float()),), [x, m1, m2])
    _against_eager(lambda a: ((3 * a).long().float() + a,), [x])


def test_keepdim_false_and_broadcast_reductions_are_not_misread():
    with pytest.raises(Unfusable, match="keepdim"):
        compile_group(lambda x: (x - x.sum(-1),), [torch.randn(5, 5)], "square")
    with pytest.raises(Unfusable, match="broadcast"):
        compile_group(lambda x, t: (x + 1, t.sum(0)), [torch.randn(2, 3, 4), torch.randn(3, 4)], "bcast",
                      backward=False)
    with pytest.raises(Unfusable, match="bitwise_not"):
        compile_group(lambda x, i: (x + (~i).float(),), [torch.randn(3, 4), torch.arange(12).view(3, 4)], "inot")


def test_nan_propagates_through_relu_and_maximum():
    x = torch.tensor([[1.0, float("nan"), -2.0, 0.5]])
    y = torch.tensor([[0.0, 1.0, float("nan"), 2.0]])
    out = compile_group(lambda a, b: (torch.relu(a) + torch.maximum(a, b),), [x, y], "nan")(x, y)[0]
    assert torch.equal(out.isnan(), (torch.relu(x) + torch.maximum(x, y)).isnan())


def test_recompute_regions_survive_fusion():
    """Fused kernels stay within a layer's recompute region, so with fuse on every layer is still
    recomputed (the kernel runs again in backward), with the same loss and gradients as without."""
    import copy

    import autoshard
    from autoshard.ir.mesh import MeshSpec
    from autoshard.runtime.module import ParallelModule
    from autoshard.runtime.recompute import Recompute
    from tests.harness.models import batch, build
    model = build("gpt", vocab_size=96, n_layer=2, n_embd=32, dropout=0.1).train()
    args, kwargs = batch("gpt", 96)
    res = {}
    for recompute in (False, True):
        prog = autoshard.compile_rank(model, MeshSpec(tp=1), 0, args, kwargs,
                                      options=autoshard.CompileOptions(recompute=recompute, fuse=True))
        assert prog.gm.meta[M.FUSION_REPORT].groups
        pm = ParallelModule(prog, copy.deepcopy(model))
        regions = sum(isinstance(m, Recompute) for graph in pm.forward_graphs for m in graph.modules())
        torch.manual_seed(3)
        loss = pm(*args)[1]
        loss.backward()
        res[recompute] = (regions, float(loss.detach()), {n: p.grad for n, p in pm.named_parameters()})
    assert res[False][0] == 0 and res[True][0] == 2
    assert res[True][1] == res[False][1]
    assert all(torch.allclose(res[True][2][n], res[False][2][n], rtol=1e-5, atol=1e-6) for n in res[False][2])
