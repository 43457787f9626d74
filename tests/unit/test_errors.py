"""Bad input gets a clear error naming the cause and the fix, raised before any collective."""
import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard.passes.capture import CaptureError
from autoshard.passes.plan import PlanError
from autoshard.ir.placement import Shard
from tests.harness.models import batch, build


def test_heads_not_divisible_by_tp():
    model = build("gpt", n_layer=1, n_head=4)
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn' has 4 heads, which tp=3 does not divide.*\[1, 2, 4\]"):
        autoshard.compile_rank(model, {"tp": 3}, 0, *batch("gpt", 96))


def test_unknown_axis_name():
    with pytest.raises(ValueError, match=r"unknown mesh axis name\(s\) \['xp'\]"):
        autoshard.compile_rank(build("gpt", n_layer=1), {"xp": 2}, 0, *batch("gpt", 96))

    class FakeMesh:
        mesh_dim_names = ("model",)
        mesh = torch.arange(2)
    from autoshard.mesh import mesh_spec
    with pytest.raises(ValueError, match="name the mesh axes from"):
        mesh_spec(FakeMesh())


def test_data_axis_compiles_and_pipeline_needs_compile_pipeline():
    prog = autoshard.compile_rank(build("gpt", n_layer=1), {"tp": 2, "dp": 2}, 3, *batch("gpt", 96))
    assert prog.coords == {"dp": 1, "pp": 0, "tp": 1}
    assert {c.axis for c in prog.collectives} == {"tp"}      # graph shapes are per dp replica: no dp op
    with pytest.raises(ValueError, match="compile it with compile_pipeline"):
        autoshard.compile_rank(build("gpt", n_layer=1), {"tp": 2, "pp": 2}, 0, *batch("gpt", 96))


def test_rank_outside_mesh():
    with pytest.raises(ValueError, match="rank 4 is outside a mesh of 4 ranks"):
        autoshard.compile_rank(build("gpt", n_layer=1), {"tp": 4}, 4, *batch("gpt", 96))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.ModuleDict({"gate": Gate()})

    def forward(self, x):
        return self.inner["gate"](x)


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent Python control flow
            return y
        return -y


def test_capture_error_names_module_and_construct():
    with pytest.raises(CaptureError, match=r"'inner.gate' \(Gate\)[\s\S]*hint: .*(torch.where|torch.cond)"):
        autoshard.compile_rank(Branchy(), {"tp": 1}, 0, (torch.randn(2, 4),))


class TokenLoop(nn.Module):
    """Keeps only the tokens its router picks: a size that depends on values (JetMoE's experts)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 1)
        self.expert = nn.Linear(4, 4)

    def forward(self, x):
        chosen = x[self.router(x).squeeze(-1) > 0]
        return self.expert(chosen).sum()


def test_data_dependent_size_is_a_capture_error_naming_the_module():
    # export traces this (an unbacked size), so the refusal is ours: before it, a shape helper failed
    # deep in a pass with no module named
    want = r"the top module \(TokenLoop\) makes a size from tensor values \(aten.index.Tensor[\s\S]*hint"
    with pytest.raises(CaptureError, match=want):
        autoshard.compile_rank(TokenLoop(), {"tp": 2}, 0, (torch.randn(8, 4),))


class SelfScaling(nn.Module):
    """Halves its weight in place on an eval forward, as RWKV's eval-mode rescaling does."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        if not self.training:
            with torch.no_grad():
                self.proj.weight.div_(2)
        return self.proj(x)


def test_a_forward_that_writes_its_weights_is_refused():
    """The captured program would halve the weight again on every call (and a shard of it under tp),
    where a Python flag guards it in the model: refused, naming the parameter, at tp=1 and tp=2."""
    for tp in (1, 2):
        with pytest.raises(CaptureError, match=r"writes its parameter .proj.weight. in place[\s\S]*hint: update the weight outside forward"):
            autoshard.compile_rank(SelfScaling().eval(), {"tp": tp}, 0, (torch.randn(2, 4),), training=False)


class ScalesACopy(nn.Module):
    """Writes in place into a copy of its weight (``contiguous`` of a transpose copies): legitimate."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        w = self.proj.weight.t().contiguous()
        w.mul_(2)
        return x @ w


def test_a_write_into_a_copy_of_a_weight_is_captured():
    x = torch.randn(2, 4)
    model = ScalesACopy()
    prog = autoshard.compile_rank(model, {"tp": 1}, 0, (x,))
    assert prog.captured is not None


def test_rwkv_eval_rescaling_is_refused_with_its_fix():
    """RWKV's eval mode divides its output weights in place under ``no_grad`` (``rescale_every``); export
    keeps that write in a region of its own, which functionalization reveals."""
    import transformers as T
    cfg = T.RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                       intermediate_size=64, context_length=16)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 64, (1, 8))
    with pytest.raises(CaptureError, match=r"writes its parameter 'rwkv.blocks.0.attention.output.weight'[\s\S]*rescale_every = 0"):
        autoshard.compile_rank(model, {"tp": 1}, 0, (), dict(input_ids=ids, labels=ids, use_cache=False), training=False)


def test_bad_pins():
    model = build("gpt", n_layer=1)
    with pytest.raises(PlanError, match=r"not parameters of the model"):
        autoshard.compile_rank(model, {"tp": 2}, 0, *batch("gpt", 96),
                               options=autoshard.CompileOptions(pins={"no.such.weight": Shard(0)}))
    with pytest.raises(PlanError, match=r"cannot pin parameter 'transformer.h.0.ln_1.weight' \(shape \(32,\)\) to S\(1\)"):
        autoshard.compile_rank(model, {"tp": 2}, 0, *batch("gpt", 96),
                               options=autoshard.CompileOptions(pins={"transformer.h.0.ln_1.weight": Shard(1)}))


def test_init_mesh_outside_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="launch with torchrun"):
        autoshard.init_mesh(tp=2)


def test_runtime_rejects_other_shapes_and_structures():
    from autoshard.runtime.module import ParallelModule
    model = build("gpt", n_layer=1)
    args, _ = batch("gpt", 96)
    pm = ParallelModule(autoshard.compile_rank(model, {"tp": 1}, 0, args), model)
    with pytest.raises(ValueError, match=r"input 0 is \(\(3, 8\), torch.int64\), compiled for \(\(2, 8\), torch.int64\)"):
        pm(torch.zeros(3, 8, dtype=torch.long), torch.zeros(3, 8, dtype=torch.long))
    with pytest.raises(autoshard.InputError, match="do not match the example inputs"):
        pm(args[0])


def test_heads_not_divisible_in_eager_attention():
    model = build("gpt", n_layer=1, n_head=4, flash=False)   # matmul -> softmax -> matmul, no sdpa
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn' has 4 heads, which tp=3 does not divide"):
        autoshard.compile_rank(model, {"tp": 3}, 0, *batch("gpt", 96))


def test_mixed_precision_names_an_fp32_input_that_reaches_a_matmul():
    """A float input added into the bf16 activations promotes them to fp32 (an fp32 buffer would be cast
    on entry: ``passes/mixed_precision.py``, tested in ``tests/simulated/test_mixed_precision_twin.py``),
    and the next matmul would meet fp32 activations and bf16 weights: an error naming it, at compile time."""
    class FloatFeatures(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = nn.Embedding(64, 16), nn.Linear(16, 16)

        def forward(self, ids, features):
            h = self.emb(ids) + features        # the user's fp32 tensor promotes the stream
            return self.fc(h).sum()

    with pytest.raises(ValueError, match=r"mixed_precision: 'fc' multiplies .*bfloat16.*float32.*Cast it in the model"):
        autoshard.compile_rank(FloatFeatures(), {"tp": 2}, 0, (torch.randint(0, 64, (2, 8)), torch.randn(2, 8, 16)),
                               options=autoshard.CompileOptions(mixed_precision="bf16"))


def test_cuda_graphs_need_inductor_and_cuda():
    """``cuda_graphs=True`` is torch.compile's "reduce-overhead" mode over each program: without
    ``codegen="inductor"`` the options refuse it, and on a CPU mesh the module does, each naming the fix.
    (The GPU path itself runs in ``tests/gpu_check.py``.)"""
    model = build("gpt", n_layer=1)
    args, _ = batch("gpt", 96, B=2)
    with pytest.raises(ValueError, match="pass codegen='inductor' with it"):
        autoshard.parallelize(model, {"tp": 1}, args, cuda_graphs=True)
    with pytest.raises(ValueError, match="this rank computes on cpu: build the mesh on CUDA"):
        autoshard.parallelize(model, {"tp": 1}, args, cuda_graphs=True, codegen="inductor")


def test_schedule_option_messages_name_the_schedule_the_user_can_pass():
    from autoshard.ir.schedule import interleaved_1f1b
    with pytest.raises(ValueError, match="'auto' chooses v itself"):
        autoshard.compile_options(schedule="auto", virtual_stages=2, microbatches=4)
    with pytest.raises(ValueError, match="use schedule='gpipe' or '1f1b'"):
        interleaved_1f1b(1, 4, 2)


def test_the_errors_a_user_may_catch_are_exported_at_the_top():
    import autoshard
    for name in ("InputError", "CaptureError", "LossError", "PlanError", "PipelineSplitError", "MemoryLimitError",
                 "PipelineError", "RankError"):
        cls = getattr(autoshard, name)
        assert isinstance(cls, type) and issubclass(cls, Exception) and name in autoshard.__all__
    assert issubclass(autoshard.InputError, ValueError)
