"""Identical blocks are planned once (``passes/block_fold.py``): the shard ILP of a deep model has the
variables of a few blocks, and its plan is the plan of the whole ILP, node for node."""
import pytest
import torch
import transformers as T

import autoshard
import autoshard.passes.block_fold as block_fold
from autoshard.ir import meta as M
from autoshard.models import GPT, GPTConfig


def _plan(model, args, kwargs, tp, fold, monkeypatch):
    monkeypatch.setattr(block_fold, "FOLD_MIN_LAYERS", 6 if fold else 10**9)
    prog = autoshard.compile_rank(model, {"tp": tp}, 0, args, kwargs, options=autoshard.CompileOptions(loss_only=True))
    return prog.report, [(n.name, repr(M.SPEC.get(n, None)), repr(M.STRATEGY.get(n, None))) for n in prog.gm.graph.nodes]


def _gpt(layers):
    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=32, vocab_size=101, n_layer=layers, n_head=4, n_embd=64))
    idx = torch.randint(0, 101, (2, 32))
    return model, (idx, idx), {}


def _llama(layers):
    cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 16))
    return model, (), dict(input_ids=ids, labels=ids, use_cache=False)


@pytest.mark.parametrize("make,tp", [(_gpt, 2), pytest.param(_gpt, 4, marks=pytest.mark.slow), (_llama, 2)])
def test_folded_plan_is_the_whole_plan_with_a_depth_free_ilp(make, tp, monkeypatch):
    shallow = _plan(*make(12), tp, True, monkeypatch)[0]
    (folded, plan), (whole, want) = _plan(*make(16), tp, True, monkeypatch), _plan(*make(16), tp, False, monkeypatch)
    assert plan == want
    assert folded.objective == pytest.approx(whole.objective, rel=1e-9)
    assert folded.variables == shallow.variables < whole.variables / 3      # the ILP no longer grows with depth


def test_short_models_are_planned_whole(monkeypatch):
    model, args, kwargs = _gpt(4)
    (folded, _), (whole, _) = _plan(model, args, kwargs, 2, True, monkeypatch), _plan(model, args, kwargs, 2, False, monkeypatch)
    assert folded.variables == whole.variables
