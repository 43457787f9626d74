"""Pipeline compilation without processes: the cuts, the balancer, the loss rewrite and the errors."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.ir.options import CompileOptions, CostModel, PipelineOptions
from autoshard.passes.microbatch_loss import LossError
from autoshard.passes.pipeline_split import PipelineSplitError
from autoshard.planner.memory_ladder import MemoryLimitError
from tests.harness import families
from tests.harness.models import batch, build
from tests.harness.family_pipeline_checks import aux_loss_reference, mixtral_with_aux_loss
from tests.harness.pipeline_checks import ragged_batch


def compile_pp(model, args, kwargs=None, mesh=None, rank=0, **pipeline):
    options = CompileOptions(pipeline=PipelineOptions(**({"microbatches": 2} | pipeline)))
    return autoshard.compile_pipeline(model, mesh or {"pp": 2}, rank, args, kwargs, options)


def test_cuts_follow_the_residual_stream_and_cover_every_parameter_once():
    model = build("gpt", n_layer=4)
    prog = compile_pp(model, *batch("gpt", 96, B=4))
    assert len(prog.chunks) == 2 and prog.plan.how == "balanced"
    c0, c1 = prog.chunks
    assert c0.inputs[0].kind != "boundary" and c1.inputs[0].kind == "boundary"
    assert c0.out_shape == c1.in_shape == (2, 8, 32)          # one microbatch of the residual stream
    names = set(dict(model.named_parameters()))
    assert set(c0.param_names) | set(c1.param_names) == names   # the tied head under the embedding's name
    assert prog.ties() == {"transformer.wte.weight": [0, 1]}   # the tied embedding and head: both stages
    assert set(c0.param_names) & set(c1.param_names) == {"transformer.wte.weight"}
    layers = [set(c.layers) for c in prog.plan.costs]
    assert layers[0] | layers[1] == {0, 1, 2, 3} and len(layers[0] & layers[1]) <= 1   # at most one layer cut in two


def test_pipeline_cuts_override_and_uneven_layers():
    options = CompileOptions(pipeline=PipelineOptions(microbatches=2, cuts=(1,)))
    prog = autoshard.compile_pipeline(build("gpt", n_layer=5), {"pp": 2}, 0, *batch("gpt", 96, B=4), options)
    assert prog.plan.how == "pipeline_cuts"
    assert [c.layers for c in prog.plan.costs] == [(0,), (1, 2, 3, 4)]
    with pytest.raises(PipelineSplitError, match=r"pipeline_cuts has 2 entries; pp x v = 2 stages need 1"):
        autoshard.compile_pipeline(build("gpt", n_layer=5), {"pp": 2}, 0, *batch("gpt", 96, B=4),
                                   CompileOptions(pipeline=PipelineOptions(microbatches=2, cuts=(1, 2))))
    with pytest.raises(PipelineSplitError, match=r"increasing layer indices in 1..4"):
        autoshard.compile_pipeline(build("gpt", n_layer=5), {"pp": 2}, 0, *batch("gpt", 96, B=4),
                                   CompileOptions(pipeline=PipelineOptions(microbatches=2, cuts=(5,))))


def test_compile_only_entry_points_take_parallelizes_keywords():
    """compile_rank and compile_pipeline take the keywords parallelize takes (one builder makes the options),
    so a compile-only dump is the program parallelize would run; giving both forms is an error."""
    args = batch("gpt", 96, B=4)
    prog = autoshard.compile_pipeline(build("gpt", n_layer=5), {"pp": 2}, 0, *args, microbatches=2, pipeline_cuts=[1])
    assert prog.plan.how == "pipeline_cuts" and [c.layers for c in prog.plan.costs] == [(0,), (1, 2, 3, 4)]
    assert prog.options.pipeline.microbatches == 2
    inter = autoshard.compile_pipeline(build("gpt", n_layer=4), {"pp": 2}, 0, *args, microbatches=2,
                                       schedule="interleaved", virtual_stages=2)
    assert len(inter.chunks) == 4 and [c.index for c in inter.own] == [0, 2]    # pp x v chunks; rank 0 runs two
    plain = autoshard.compile_pipeline(build("gpt", n_layer=4), {"pp": 2}, 0, *args, microbatches=2,
                                       schedule="interleaved")        # v left out: Megatron's smallest, 2
    assert len(plain.chunks) == 4 and plain.options.pipeline.virtual_stages == 2
    tp = autoshard.compile_rank(build("gpt", n_layer=1), {"tp": 2}, 0, *batch("gpt", 96), loss_only=True)
    assert tp.options.loss_only and tp.options.pipeline is None
    with pytest.raises(TypeError, match="as keywords .*loss_only.* or as options=, not both"):
        autoshard.compile_rank(build("gpt", n_layer=1), {"tp": 2}, 0, *batch("gpt", 96), CompileOptions(),
                               loss_only=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'microbatch'"):
        autoshard.compile_pipeline(build("gpt", n_layer=1), {"pp": 2}, 0, *args, microbatch=2)


def test_balancer_shortens_the_stages_of_a_heavy_head():
    """GPT-2 small's vocabulary (50304) on a narrow model (h=256): the LM head and its loss cost several
    layers, so the cost model gives the last stage fewer layers than a uniform split, and predicts a
    faster step. Compiled on ``meta``: the sizes are real, nothing is allocated."""
    with torch.device("meta"):
        model = build("gpt", n_layer=8, vocab_size=50304, n_embd=256, n_head=4, block_size=128)
    args, kwargs = batch("gpt", 50304, B=8, T=128)
    prog = compile_pp(model, args, kwargs, mesh={"pp": 4}, microbatches=8)
    layers = [set(c.layers) for c in prog.plan.costs]
    assert set().union(*layers) == set(range(8)) and len(layers[-1]) < 2
    assert prog.plan.uniform is not None and prog.plan.predicted_step < prog.plan.uniform["step"]
    # the rest is balanced too (not only the slowest stage): no stage holds most of the layers
    assert max(len(s) for s in layers) <= 4


def test_memory_limit_is_respected_or_refused():
    model = build("gpt", n_layer=4)
    args, kwargs = batch("gpt", 96, B=4)
    free = compile_pp(model, args, kwargs)
    limit = max(free.plan.predicted_peak_bytes.values()) * 1.5
    bounded = compile_pp(model, args, kwargs, memory_limit=limit)
    assert max(bounded.plan.predicted_peak_bytes.values()) <= limit * 1.01
    # the memory ladder (as parallelize runs it) refuses first, naming what is missing
    with pytest.raises(MemoryLimitError, match="does not fit: the smallest, full recompute, needs"):
        compile_pp(model, args, kwargs, memory_limit=1000)
    # the stage balancer's own bound, where the ladder has chosen already (parallelize's calls)
    with pytest.raises(PipelineSplitError, match="no 2-stage split fits memory_limit"):
        autoshard.compile_pipeline(model, {"pp": 2}, 0, args, kwargs, CompileOptions(
            pipeline=PipelineOptions(microbatches=2, memory_limit=1000)), _memory_chosen=True)


def test_loss_rewrite_counts_targets_and_falls_back_with_a_reason():
    model = build("gpt", n_layer=1)
    args, kwargs = ragged_batch("gpt", 96, 4, 8, seed=3)
    prog = compile_pp(model, args, kwargs)
    assert prog.loss.exact and "ignore_index=-100" in prog.loss.reason
    labels = args[1]
    counts = [float(prog.loss.count(labels[i * 2:(i + 1) * 2])) for i in range(2)]
    assert counts == [float((labels[:2] != -100).sum()), float((labels[2:] != -100).sum())]

    class Scaled(nn.Module):   # a loss the rewrite does not analyse: 2 x mean cross-entropy
        def __init__(self):
            super().__init__()
            self.inner = build("gpt", n_layer=1)

        def forward(self, idx, targets):
            logits, _ = self.inner(idx)
            return 2 * F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    prog = compile_pp(Scaled(), args, kwargs, mesh={"pp": 1})
    assert not prog.loss.exact and "aten.mul" in prog.loss.reason


def test_fallback_is_the_mean_of_microbatch_means():
    torch.manual_seed(0)

    class MSE(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, y):
            return F.mse_loss(self.lin(x), y)
    model = MSE()
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pm = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (x, y), microbatches=2)
    with pytest.warns(UserWarning, match="mean of its 2 microbatch losses"):   # the step program's compile
        loss = pm.step(x, y)
    expected = (F.mse_loss(model.lin(x[:2]), y[:2]) + F.mse_loss(model.lin(x[2:]), y[2:])) / 2
    assert torch.allclose(loss, expected.detach())


def test_rotary_tables_are_recomputed_not_sent():
    cfg = families.FamilyConfig("llama", hidden=32, heads=4, kv_heads=2, layers=2)
    model = families.build(cfg)
    kwargs = families.batch(cfg.vocab, B=4)
    prog = compile_pp(model, (), kwargs, cuts=(1,))            # a layer on each stage
    for k in (0, 1):    # each stage computes its own rotary table and mask; only the residual crosses
        assert {"cos", "sin"} <= set(prog.plan.recomputed[k])
    assert [i.kind for i in prog.chunks[1].inputs].count("boundary") == 1


def test_clear_errors():
    args, kwargs = batch("gpt", 96, B=4)
    with pytest.raises(ValueError, match=r"a batch of 4 rows cannot be split into microbatches=3"):
        compile_pp(build("gpt", n_layer=2), args, kwargs, microbatches=3)
    with pytest.raises(ValueError, match="multiple of pp=2"):
        compile_pp(build("gpt", n_layer=2), args, kwargs, microbatches=1, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ValueError, match="needs schedule='interleaved'"):
        PipelineOptions(virtual_stages=2)
    with pytest.raises(ValueError, match="schedule='pipedream'"):
        PipelineOptions(schedule="pipedream")
    with pytest.raises(PipelineSplitError, match=r"at most \d+ stages; asked for pp x v = 64"):
        compile_pp(build("gpt", n_layer=1), torch.zeros(64, 8, dtype=torch.long).chunk(1) + (args[1].repeat(16, 1),),
                   None, mesh={"pp": 32}, microbatches=32, schedule="interleaved", virtual_stages=2)
    with pytest.raises(LossError, match="returns 0 scalar outputs"):
        compile_pp(build("gpt", n_layer=1), (args[0],), None)


def test_cost_model_prices_the_split():
    slow_memory = CostModel(memory_bandwidth=1e6)
    options = CompileOptions(cost_model=slow_memory, pipeline=PipelineOptions(microbatches=2))
    prog = autoshard.compile_pipeline(build("gpt", n_layer=2), {"pp": 2}, 0, *batch("gpt", 96, B=4), options)
    assert prog.plan.predicted_step > 1e-3      # bytes-bound ops dominate at 1 MB/s


def test_each_rank_materialises_only_its_stages_also_from_meta():
    """A model built on meta: each pipeline rank creates only its own stages' parameters (no process
    group needed to build the module), and pm(...) says to call pm.step."""
    from autoshard.runtime.module import ParallelModule
    with torch.device("meta"):
        model = build("gpt", n_layer=4, tie_weights=False)
    args, kwargs = batch("gpt", 96, B=4)
    names = set(dict(model.named_parameters()))
    held = []
    for rank in (0, 1):
        prog = compile_pp(model, args, kwargs, rank=rank)
        pm = ParallelModule(prog, model)
        mine = set(pm.local_parameters())
        assert mine == set(prog.own[0].param_names) and not any(p.is_meta for p in pm.parameters())
        held.append(mine)
        with pytest.raises(TypeError, match=r"call pm.step"):
            pm(*args)
    assert held[0] | held[1] == names and not held[0] & held[1]
    assert set(pm.state_dict()) >= held[1]        # the model's own names


def test_recompute_is_priced_in_the_stage_plan():
    """With activation recompute a layer keeps only its input: the balancer sees less activation memory
    and one more forward per layer in backward (the dump's predictions and memory_limit follow)."""
    model = build("gpt", n_layer=4)
    args = batch("gpt", 96, B=4)
    plans = {}
    for recompute in (False, True):
        options = CompileOptions(pipeline=PipelineOptions(microbatches=2), recompute=recompute)
        plans[recompute] = autoshard.compile_pipeline(model, {"pp": 2}, 0, *args, options).plan
    plain, again = plans[False], plans[True]
    assert sum(c.activation_bytes for c in again.costs) < 0.5 * sum(c.activation_bytes for c in plain.costs)
    assert all(c.recompute_seconds == 0 for c in plain.costs)
    assert all(0 < c.recompute_seconds < c.forward_seconds for c in again.costs)   # layers, not the head
    assert again.predicted_step > plain.predicted_step


@pytest.mark.parametrize("as_tensor", [False, True])
def test_hf_num_items_in_batch_loss_is_summed_over_microbatches(as_tensor):
    """HF's Trainer passes ``num_items_in_batch``: the model's loss is then a summed cross-entropy divided
    by that one number, so the microbatches' losses add up (the mean of microbatch means would halve it at
    m=2). One process, tp=1, two microbatches with uneven ignored targets: the loss and every gradient."""
    import transformers as T
    cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 128, (4, 8), generator=g), torch.randint(0, 128, (4, 8), generator=g)
    labels[0, :6] = -100
    n = int((labels[:, 1:] != -100).sum())
    kw = dict(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids), use_cache=False,
              num_items_in_batch=torch.tensor(n) if as_tensor else n)
    ref = copy.deepcopy(model)
    want = ref(**kw).loss
    want.backward()
    pm = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (), kw, microbatches=2)
    got = pm.step(**kw)
    assert pm.runner.program.loss.exact and "num_items_in_batch" in pm.runner.program.loss.reason
    assert abs(float(got) - float(want)) <= 1e-6 * abs(float(want))
    grads = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("num_items", [None, "int", "tensor"])
def test_moe_aux_loss_plus_cross_entropy_is_exact_for_the_cross_entropy_term(num_items):
    """Mixtral with ``output_router_logits=True`` returns ``loss = ce + coef * aux_loss`` and ``aux_loss``:
    pm.step picks the loss the other scalar feeds, makes its cross-entropy term the whole batch's (uneven
    ignored targets over microbatches) and averages the auxiliary term over microbatches, as Megatron does.
    With HF's ``num_items_in_batch`` (the Trainer passes it to an MoE model too) the cross-entropy is a sum
    over that number, summed over microbatches: before, this loss fell back to the mean of microbatch
    means and came out about halved at m=2. One process, tp=1, m=2 (a pp=2 gloo run gave the same)."""
    model, kw = mixtral_with_aux_loss()
    if num_items is not None:
        n = int((kw["labels"][:, 1:] != -100).sum())
        kw["num_items_in_batch"] = torch.tensor(n) if num_items == "tensor" else n
    ref = copy.deepcopy(model)
    want = aux_loss_reference(ref, kw)
    want.backward()
    pm = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (), kw, microbatches=2)
    got = pm.step(**kw)
    rewrite = pm.runner.program.loss
    assert rewrite.exact and rewrite.scale_input and "plus other terms" in rewrite.reason
    assert ("num_items_in_batch" in rewrite.reason) == (num_items is not None)
    assert abs(float(got) - float(want)) <= 1e-6 * abs(float(want))
    grads = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        if grads[name].grad is not None:
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7)


def test_a_cut_value_renamed_by_a_later_rewrite_is_found_by_its_tag(monkeypatch):
    """Stage plans name the values they cut at. A rewrite that replaces such a node under another name
    (copying its meta, as decompose_bias and overlap_grad_allreduce do) lost the cut before: "did not
    survive the rewrite passes". The pipeline_split tag finds the replacement."""
    from autoshard.ir import meta as M
    from autoshard.passes import manager

    def rename_cut_values(gm, ctx):
        for n in [n for n in gm.graph.nodes if M.CUT.has(n)]:
            with gm.graph.inserting_after(n):
                twin = gm.graph.call_function(torch.ops.aten.clone.default, (n,))
            twin.meta = dict(n.meta)
            n.replace_all_uses_with(twin, delete_user_cb=lambda u: u is not twin)
            n._rename(f"{n.name}_replaced")
        gm.recompile()
        return gm

    model = build("gpt", n_layer=4)
    at = next(i for i, p in enumerate(manager.PASSES) if p.name == "tp_rewrite") + 1
    monkeypatch.setattr(manager, "PASSES", manager.PASSES[:at] + [manager.Pass("rename", rename_cut_values, "test")]
                        + manager.PASSES[at:])
    prog = compile_pp(model, *batch("gpt", 96, B=4))
    c0, c1 = prog.chunks
    assert c0.out_shape == c1.in_shape == (2, 8, 32)


def test_a_boundary_whole_on_every_tp_rank_is_marked_for_scatter_gather():
    """``Chunk.in_replicated`` / ``out_replicated`` tell the runtime which transfers it may send as tp
    slices (``runtime/scatter_gather.py``): the residual stream at pp=2 x tp=2, not its sequence shard under
    SP. ``scatter_gather`` takes True, False or "auto" (not 1: a truthy int would read as off)."""
    args = batch("gpt", 96, B=4)
    whole = autoshard.compile_pipeline(build("gpt", n_layer=2), {"pp": 2, "tp": 2}, 0, *args, microbatches=2)
    assert [(c.in_replicated, c.out_replicated) for c in whole.chunks] == [(False, True), (True, False)]
    sp = autoshard.compile_pipeline(build("gpt", n_layer=2), {"pp": 2, "tp": 2}, 0, *args, microbatches=2,
                                    sequence_parallel=True)
    assert [(c.in_replicated, c.out_replicated) for c in sp.chunks] == [(False, False), (False, False)]
    assert sp.chunks[1].in_shape == (2, 4, 32)                    # a sequence shard: 1/t already
    with pytest.raises(ValueError, match="scatter_gather='yes'"):
        autoshard.compile_pipeline(build("gpt", n_layer=2), {"pp": 2}, 0, *args, microbatches=2, scatter_gather="yes")
    with pytest.raises(ValueError, match="scatter_gather=1"):
        autoshard.compile_pipeline(build("gpt", n_layer=2), {"pp": 2}, 0, *args, microbatches=2, scatter_gather=1)


def test_the_balancer_prices_a_send_as_the_runtime_makes_it():
    """A boundary transfer costs a tp rank 1/t of the bytes under SP (a sequence shard) and under
    scatter/gather (plus the receivers' all-gather over tp), the whole boundary otherwise: the stage
    balancer and ``pipeline.md``'s simulation price it so (``stage_prices.boundary_link``)."""
    from autoshard.passes.stage_prices import boundary_link
    cm = CostModel(p2p_bandwidth=10e9, p2p_latency=1e-5, bandwidth=100e9, latency=2e-6)
    nbytes = 4e6

    def send(link):
        return link.p2p_latency + nbytes / link.p2p_bandwidth
    assert boundary_link(cm, 1, True, True) is cm and boundary_link(cm, 4, False, False) is cm
    assert send(boundary_link(cm, 4, True, False)) == pytest.approx(1e-5 + nbytes / 4 / 10e9)
    assert send(boundary_link(cm, 4, False, True)) == pytest.approx(1e-5 + nbytes / 4 / 10e9        # its slice
                                                                    + 3 * 2e-6 + 3 / 4 * nbytes / 100e9)  # ring
    args = batch("gpt", 96, B=4)
    p2p = {}
    for sp in (False, True):
        for sg in (False, True):
            prog = autoshard.compile_pipeline(build("gpt", n_layer=2), {"pp": 2, "tp": 2}, 0, *args, microbatches=2,
                                              sequence_parallel=sp, scatter_gather=sg, cost_model=cm)
            p2p[sp, sg] = prog.plan.simulation.p2p
    boundary = 2 * 8 * 32 * 4                                       # a microbatch of the stream, fp32
    assert p2p[False, False] == pytest.approx(1e-5 + boundary / 10e9)
    assert p2p[True, False] == p2p[True, True] == pytest.approx(1e-5 + boundary / 2 / 10e9)
    assert p2p[False, True] == pytest.approx(1e-5 + 2e-6 + boundary / 2 / 10e9 + boundary / 2 / 100e9)


def test_the_forward_and_step_programs_of_one_call_share_one_trace():
    """At pp=1 parallelize compiles the forward program and pm.step a step program for the same batch
    (one microbatch): the module's CaptureCache traces the model once for both, and again only for a
    new mode or shape. The step is still the single-device model's loss and gradients."""
    model = build("hf")
    _, kw = batch("hf", 101, B=2, T=8)
    kw |= {"attention_mask": torch.ones_like(kw["input_ids"]), "use_cache": False}
    ref = copy.deepcopy(model)
    want = ref(**kw).loss
    want.backward()
    pm = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (), kw)
    assert pm.captures.traced == 1
    got = pm.step(**kw)
    assert pm.captures.traced == 1                      # the forward program's trace
    assert abs(float(got) - float(want)) <= 1e-6 * float(want)
    grads = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7)
    pm.eval()
    assert abs(float(pm(**kw).loss) - float(want)) <= 1e-6 * float(want)
    assert pm.captures.traced == 2                      # eval mode: a trace of its own ...
    assert abs(float(pm.eval_batch(**kw)) - float(want)) <= 1e-6 * float(want)
    assert pm.captures.traced == 2                      # ... shared by the eval step
    _, short = batch("hf", 101, B=2, T=6)
    pm.eval_batch(**short)
    assert pm.captures.traced == 3                      # another shape


def test_capture_cache_keys_on_what_a_trace_depends_on():
    from autoshard.captures import CaptureCache
    from autoshard.ir.options import CompileOptions
    model = build("gpt")
    (idx, tgt), _ = batch("gpt", 96)
    cache, plain = CaptureCache(limit=8), CompileOptions()
    first = cache.get(model, (idx, tgt), None, plain, True)
    assert cache.get(model, (idx + 1, tgt), {}, plain, True) is first          # other values, same trace
    others = [cache.get(model, (idx[:, :4].contiguous(), tgt[:, :4].contiguous()), None, plain, True),  # shape
              cache.get(model, (idx, tgt), None, plain, False),                  # mode
              cache.get(model, (idx,), None, plain, True),                       # structure
              cache.get(model, (idx, tgt), None, CompileOptions(mixed_precision="bf16"), True)]
    with torch.no_grad():                                                        # grad mode
        others.append(cache.get(model, (idx, tgt), None, plain, True))
    assert len({id(c) for c in [first, *others]}) == 6 and cache.traced == 6
    assert others[-2].gm is not first.gm and cache.get(model, (idx, tgt), None, plain, True) is first


def test_a_module_built_from_a_step_program_without_a_compiler_steps_and_says_what_pm_call_needs():
    """ParallelModule(program, model) of a compile-only pp=1 step program: pm.step runs it (exactly);
    pm(...) has no compiler to make a forward program, and says so."""
    from autoshard.runtime.module import ParallelModule
    model = build("gpt")
    (x, y), _ = batch("gpt", 96, B=4)
    prog = autoshard.compile_pipeline(model, {"tp": 1}, 0, (x, y), microbatches=2)
    pm = ParallelModule(prog, copy.deepcopy(model))
    ref = copy.deepcopy(model)
    assert abs(float(pm.step(x, y)) - float(ref(x, y)[1])) <= 1e-6 * float(ref(x, y)[1])
    with pytest.raises(TypeError, match="without a compiler.*pm.step"):
        pm(x, y)


def test_parallelize_says_what_it_compiled_and_where_the_time_went(caplog):
    model = build("gpt")
    (x, y), _ = batch("gpt", 96, B=4)
    with caplog.at_level("INFO", logger="autoshard"):
        autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (x, y))
    line = next(r.getMessage() for r in caplog.records if "compiled the" in r.getMessage())
    assert "forward program for dp=1 pp=1 tp=1" in line and "passes" in line and "plan " in line, line
