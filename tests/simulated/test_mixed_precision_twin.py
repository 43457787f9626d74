"""Mixed precision traces a bf16 twin of the model (``passes/mixed_precision.py:compute_twin``). Its parameters are fake tensors
on the model's own device, so a forward that branches on its device traces the branch the program runs:
HF's MoE layers count tokens per expert with ``histc`` on floats on a CPU and on ints elsewhere (a
``meta`` twin traced the int branch, which a CPU cannot run), and Falcon builds its ALiBi slopes as
tensors on its mask's device (a ``meta`` twin left them without values). Each family's loss at tp=2
against the single-device model under ``torch.autocast`` (bf16 rounds differently in the two: the
training-loop test holds them to the same 2e-3). XGLM adds an fp32 sinusoidal table into its bf16
embeddings, which promotes the stream: the table is cast to bf16 on entry to the program."""
import copy

import pytest
import torch
import torch.nn as nn
import transformers as T

import autoshard

from autoshard.passes.mixed_precision import compute_twin
from tests.harness.families import FamilyConfig, build
from tests.harness.simulate import simulate
from tests.models.test_more_families import CASES

MIXED_RTOL = 2e-3


def _hf_batch():
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 120, (2, 8), generator=g), torch.randint(0, 120, (2, 8), generator=g)
    labels[0, :2] = -100
    return dict(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids), use_cache=False)


def _model(name):
    if name == "xglm":
        from tests.harness.zoo import build_zoo
        return build_zoo("xglm")
    if name == "falcon":      # classic Falcon: ALiBi, multi-query
        return build(FamilyConfig("falcon", layers=2, hidden=64, heads=4, vocab=128, attn_implementation="sdpa"))
    config, attn = CASES[name]
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config(), attn_implementation=attn)


@pytest.mark.parametrize("name", ["mixtral", "falcon", "xglm"])
def test_a_device_branching_model_trains_in_bf16(name):
    model = _model(name)
    kwargs = _hf_batch()
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(**kwargs).loss
    want.backward()
    for out, grads, _ in simulate(model, 2, (), kwargs, loss_fn=lambda o: o.loss, mixed_precision="bf16"):
        assert abs(float(out.loss) - float(want)) <= MIXED_RTOL * abs(float(want)), (name, float(out.loss), float(want))
        assert grads.keys() == dict(ref.named_parameters(remove_duplicate=False)).keys()
        assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())


def test_the_twin_is_weightless_on_the_models_device():
    model = _model("mixtral")
    twin = compute_twin(model, torch.bfloat16)
    p = next(twin.parameters())
    assert p.dtype == torch.bfloat16 and p.device == torch.device("cpu")
    assert type(p.data).__name__ == "FakeTensor"             # no storage: nothing allocated
    assert all(a is b for a, b in zip(twin.buffers(), model.buffers()))   # the model's own buffers, read only
    with torch.device("meta"):
        on_meta = _model("mixtral")
    assert next(compute_twin(on_meta, torch.bfloat16).parameters()).is_meta


class PositionTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(64, 16), nn.Linear(16, 16)
        self.register_buffer("pe", torch.randn(8, 16))

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.pe   # fp32 into bf16 activations: promotes them, so the buffer is cast on entry
        return self.fc(h).sum()


def test_an_fp32_buffer_added_into_the_stream_is_cast_on_entry():
    torch.manual_seed(0)
    model = PositionTable()
    ids = torch.randint(0, 64, (2, 8))
    prog = autoshard.compile_rank(model, {"tp": 2}, 0, (ids,), mixed_precision="bf16")
    casts = [n for n in prog.captured.gm.graph.nodes if n.target is torch.ops.aten._to_copy.default
             and n.args[0].op == "placeholder" and n.args[0].name.endswith("pe")]
    assert len(casts) == 1 and casts[0].kwargs["dtype"] == torch.bfloat16
    assert model.pe.dtype == torch.float32                       # the model's own buffer is untouched
    want = model.to(torch.bfloat16)(ids).float()                 # as the model converted to bf16 computes it
    model.float()
    for out, _, _ in simulate(model, 2, (ids,), mixed_precision="bf16"):
        assert abs(float(out) - float(want)) <= MIXED_RTOL * abs(float(want)), (float(out), float(want))
