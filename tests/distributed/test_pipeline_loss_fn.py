"""``loss_fn=``: torch.distributed.pipelining's convention for a model that returns logits. The loss is
compiled in after the model (``loss_fn(output, target)``, with ``target`` a keyword of the call), so a
mean-reduced cross-entropy is still exact over microbatches with uneven ignored targets."""
import copy

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.ir.options import CompileOptions, PipelineOptions
from tests.harness.distributed import run_distributed
from tests.harness.family_pipeline_checks import worst_gradient


def _llama():
    import transformers as T
    cfg = T.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def next_token_loss(output, target):
    """What a torch pipelining user writes: the logits against the shifted targets, -100 ignored."""
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def nll_spelled_out(output, target):
    """Cross-entropy as log_softmax then nll_loss: the same loss, rewritten alike (passes/microbatch_loss.py)."""
    return F.nll_loss(F.log_softmax(output.logits, -1).flatten(0, 1), target.flatten(), ignore_index=-100)


LOSSES = {"cross_entropy": next_token_loss, "nll": nll_spelled_out}


def _batch():
    g = torch.Generator().manual_seed(2)
    ids, target = torch.randint(0, 96, (4, 8), generator=g), torch.randint(0, 96, (4, 8), generator=g)
    target[0, :7] = -100                       # microbatch 0 holds far fewer targets than microbatch 1
    return ids, target


def _parity(rank, world, dims, loss_name="cross_entropy"):
    loss_fn = LOSSES[loss_name]
    model = _llama()
    ids, target = _batch()
    ref = copy.deepcopy(model)
    want = loss_fn(ref(input_ids=ids, use_cache=False), target)
    want.backward()
    mesh = autoshard.init_mesh(**dims)
    local = autoshard.local_batch(dict(input_ids=ids, use_cache=False, target=target), mesh)  # dp's rows
    pm = autoshard.parallelize(model, mesh, (), local, microbatches=2, loss_fn=loss_fn)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    loss = float(pm.step(**local))
    worst = worst_gradient(pm, dict(ref.named_parameters()))
    evaluated = float(pm.eval_batch(**local))   # its own program
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt.step(), ref_opt.step()
    opt.zero_grad(), ref_opt.zero_grad()
    second = float(pm.step(**local))
    again = loss_fn(ref(input_ids=ids, use_cache=False), target)
    return dict(loss=loss, want=float(want), worst=worst, second=second, again=float(again), eval=evaluated,
                forward_restored="forward" not in model.__dict__)


@pytest.mark.parametrize("dims,loss_name", [({"pp": 2}, "cross_entropy"), ({"pp": 2, "tp": 2}, "cross_entropy"),
                                            ({"pp": 2}, "nll"), ({"dp": 2}, "nll")])
def test_loss_fn_on_a_pipeline_matches_the_single_device_loss(dims, loss_name):
    for r in run_distributed(_parity, 2 * dims.get("tp", 1), dims, loss_name, timeout=300):
        assert abs(r["loss"] - r["want"]) <= 1e-5 * r["want"], r       # not the mean of microbatch means
        assert r["worst"] < 1e-5 and r["forward_restored"], r
        assert abs(r["eval"] - r["want"]) <= 1e-5 * r["want"], r        # no dropout: eval = train loss
        assert abs(r["second"] - r["again"]) <= 1e-5 * r["again"], r   # after an AdamW step too


def test_loss_fn_without_a_target_says_how_to_pass_one():
    ids, _ = _batch()
    with pytest.raises(ValueError, match=r"needs target=.*pm.step\(x, target=y\)"):
        autoshard.compile_pipeline(_llama(), {"pp": 2}, 0, (), dict(input_ids=ids), CompileOptions(
            loss_fn=next_token_loss, pipeline=PipelineOptions(microbatches=2)))
    with pytest.raises(ValueError, match="not callable"):
        CompileOptions(loss_fn="cross_entropy")


def _forward_without_target(rank, world):
    model = _llama()
    ids, target = _batch()
    pm = autoshard.parallelize(copy.deepcopy(model), autoshard.init_mesh(tp=world), (),
                               dict(input_ids=ids, use_cache=False, target=target), loss_fn=next_token_loss)
    loss = float(pm(input_ids=ids, use_cache=False, target=target))
    pm.eval()
    logits = pm(input_ids=ids, use_cache=False).logits       # no target=: the model's own output
    with torch.no_grad():
        want = model.eval()(input_ids=ids, use_cache=False).logits
    return dict(loss=loss, want=float(next_token_loss(model(input_ids=ids, use_cache=False), target)),
                logits=float((logits - want).abs().max()))


def test_a_call_without_target_returns_the_models_output():
    """With loss_fn=, pm(x, target=y) is the loss; pm(x) (an eval loop reading logits) runs the model alone."""
    (r,) = run_distributed(_forward_without_target, 1, timeout=300)
    assert abs(r["loss"] - r["want"]) <= 1e-5 * r["want"] and r["logits"] < 1e-5, r


class TakesTarget(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, target=None):
        return self.lin(x)


def test_loss_fn_refuses_a_model_whose_forward_takes_target_itself():
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match="forward has a 'target' parameter of its own"):
        autoshard.compile_pipeline(TakesTarget(), {"pp": 1}, 0, (x,), {"target": x}, CompileOptions(
            loss_fn=lambda out, y: F.mse_loss(out, y), pipeline=PipelineOptions(microbatches=2)))
