"""Activation recompute (``passes/recompute.py``, ``runtime/recompute.py``): one region per layer found
from the graph, each keeping only its input; exact against the single-device model (dropout included,
bit for bit against the same program without recompute), and HF's activation (gradient) checkpointing
flag honoured. The pipeline and dp runs are in ``tests/distributed/test_pipeline.py``."""
import copy

import pytest
import torch
import transformers as T

import autoshard
from autoshard.ir import meta as M
from autoshard.ir.mesh import MeshSpec
from autoshard.runtime.module import ParallelModule
from autoshard.runtime.recompute import Recompute
from tests.harness.models import batch, build
from tests.harness.parity_checks import rel
from tests.harness.simulate import simulate


def _single_rank(model, args, kwargs, recompute, seed=5):
    """(loss, grads, bytes saved for backward outside the parameters, Recompute modules) on one rank."""
    prog = autoshard.compile_rank(model, MeshSpec(tp=1), 0, args, kwargs,
                                  options=autoshard.CompileOptions(recompute=recompute))
    pm = ParallelModule(prog, copy.deepcopy(model))
    params = {p.untyped_storage().data_ptr() for p in pm.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t.numel() * t.element_size())
        return t
    torch.manual_seed(seed)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = pm(*args, **kwargs)[1]
    loss.backward()
    regions = sum(isinstance(m, Recompute) for graph in pm.forward_graphs for m in graph.modules())
    return float(loss.detach()), {n: p.grad for n, p in pm.named_parameters()}, sum(saved), regions, prog


def test_each_layer_is_recomputed_bit_for_bit_with_dropout_and_keeps_less():
    model = build("gpt", vocab_size=96, n_layer=3, n_embd=64, dropout=0.2).train()
    args, kwargs = batch("gpt", 96, B=4, T=16)
    plain, again = _single_rank(model, args, kwargs, False), _single_rank(model, args, kwargs, True)
    assert plain[3] == 0 and again[3] == 3                  # one region per layer, found from the graph
    regions = again[4].gm.meta[M.RECOMPUTE_PLAN].regions
    assert [r.layer for r in regions] == [0, 1, 2]
    assert again[0] == plain[0]                            # the same dropout masks drawn again in backward
    assert all(torch.equal(again[1][n], plain[1][n]) for n in plain[1])
    assert again[2] < 0.5 * plain[2], (again[2], plain[2])  # measured: 0.45 of the bytes kept for backward


def test_recompute_at_tp2_matches_the_single_device_model():
    model = build("gpt", vocab_size=97, n_layer=2)
    args, kwargs = batch("gpt", 97)
    ref = copy.deepcopy(model)
    want = ref(*args)[1]
    want.backward()
    for rank, (out, grads, _) in enumerate(simulate(model, 2, args, kwargs, loss_fn=lambda o: o[1], recompute=True)):
        assert rel(out[1].detach(), want.detach()) <= 1e-5
        for n, p in ref.named_parameters():
            assert rel(grads[n], p.grad) <= 1e-5, (rank, n)


def _llama():
    cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg).train()


def test_hf_gradient_checkpointing_is_honoured_and_exact():
    model = _llama()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=ids, labels=ids.clone(), attention_mask=torch.ones_like(ids), use_cache=False)
    prog = autoshard.compile_rank(model, MeshSpec(tp=2), 0, (), kwargs)         # recompute="auto"
    assert [r.layer for r in prog.gm.meta[M.RECOMPUTE_PLAN].regions] == [0, 1]
    off = autoshard.compile_rank(model, MeshSpec(tp=2), 0, (), kwargs, options=autoshard.CompileOptions(recompute=False))
    assert M.RECOMPUTE_PLAN not in off.gm.meta
    ref = copy.deepcopy(model)
    out = ref(**kwargs)
    out.loss.backward()
    for rank, (o, grads, _) in enumerate(simulate(model, 2, (), kwargs, loss_fn=lambda o: o.loss)):
        assert rel(o.loss.detach(), out.loss.detach()) <= 1e-5
        for n, p in ref.named_parameters():
            assert rel(grads[n], p.grad) <= 1e-5, (rank, n)


def test_a_plain_model_is_not_recomputed_and_the_dump_says_what_is(tmp_path):
    model = build("gpt", vocab_size=96, n_layer=2)
    args, kwargs = batch("gpt", 96)
    assert M.RECOMPUTE_PLAN not in autoshard.compile_rank(model, MeshSpec(tp=2), 0, args, kwargs).gm.meta
    autoshard.compile_rank(model, MeshSpec(tp=2), 0, args, kwargs,
                           options=autoshard.CompileOptions(recompute=True, dump=str(tmp_path)))
    text = (tmp_path / "plan.md").read_text()
    assert "## Activation recompute" in text and "2 regions run again in backward" in text
    with pytest.raises(ValueError, match="recompute='yes'"):
        autoshard.CompileOptions(recompute="yes")
    # the planner's names (Plan.recompute, plan.md's "recompute=full") are accepted as they are printed
    assert autoshard.CompileOptions(recompute="full").recompute is True
    assert autoshard.CompileOptions(recompute="none").recompute is False


class _CountingBlock(torch.nn.Module):
    """A layer that updates a buffer in place (a call counter, as running statistics do)."""
    def __init__(self, d):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return x + torch.relu(self.fc(x))


class _Counting(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(32, d), torch.nn.Linear(d, 32)
        self.layers = torch.nn.ModuleList(_CountingBlock(d) for _ in range(2))

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


def test_a_layer_that_writes_in_place_is_not_recomputed_and_says_so():
    model = _Counting()
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="writes in place"):
        prog = autoshard.compile_rank(model, MeshSpec(tp=1), 0, (idx, idx), {},
                                      options=autoshard.CompileOptions(recompute=True))
    plan = prog.gm.meta[M.RECOMPUTE_PLAN]
    assert not plan.regions and len(plan.skipped) == 2
    pm = ParallelModule(prog, copy.deepcopy(model))
    pm(idx, idx).backward()                           # runs, and counts each layer's call once
    assert [float(v) for k, v in pm.state_dict().items() if k.endswith("calls")] == [1.0, 1.0]


@pytest.mark.parametrize("flash", [False, True])
def test_selective_recompute_reruns_only_attention_cores_bit_for_bit_with_dropout(flash):
    """recompute='selective': one region per attention core (q @ k^T to the product with v, or the SDPA
    call), the same dropout masks drawn again, the same loss and gradients bit for bit as without
    recompute, and fewer bytes kept: the scores, their softmax and its dropout mask (on CPU SDPA keeps
    less to begin with)."""
    model = build("gpt", vocab_size=96, n_layer=3, n_embd=64, dropout=0.2, flash=flash).train()
    args, kwargs = batch("gpt", 96, B=4, T=16)
    plain, full = _single_rank(model, args, kwargs, False), _single_rank(model, args, kwargs, True)
    core = _single_rank(model, args, kwargs, "selective")
    plan = core[4].gm.meta[M.RECOMPUTE_PLAN]
    assert plan.kind == "selective" and [r.layer for r in plan.regions] == [0, 1, 2] and core[3] == 3
    assert all(r.nodes < 40 for r in plan.regions)           # the core, not the layer
    assert core[0] == plain[0]
    assert all(torch.equal(core[1][n], plain[1][n]) for n in plain[1])
    assert full[2] < core[2] < plain[2], (full[2], core[2], plain[2])


def test_selective_recompute_at_tp2_matches_the_single_device_model():
    model = build("gpt", vocab_size=97, n_layer=2, flash=False)
    args, kwargs = batch("gpt", 97)
    ref = copy.deepcopy(model)
    want = ref(*args)[1]
    want.backward()
    for rank, (out, grads, _) in enumerate(simulate(model, 2, args, kwargs, loss_fn=lambda o: o[1],
                                                    recompute="selective")):
        assert rel(out[1].detach(), want.detach()) <= 1e-5
        for n, p in ref.named_parameters():
            assert rel(grads[n], p.grad) <= 1e-5, (rank, n)
