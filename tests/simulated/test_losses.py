"""Losses as users write them: vocab-parallel and exact, or replicated with the logits gathered and
``plan.md`` saying so. Never silently wrong.

Every case runs all ranks in threads (``tests/harness/simulate.py``) and compares the loss and every parameter
gradient with the single-device model; the plan is checked for the strategy each loss node got and for
exactly the loss collectives, and the runtime's tracer for running exactly those.

Tolerances: fp32 ``rtol=1e-5`` (the sharded loss sums the vocab in another order). bf16: the loss with
torch's bf16 default (``rtol=1.6e-2``: two bf16 ulps; the vocab-parallel loss reduces in fp32 and
rounds once, the single-device bf16 one rounds its log-softmax too, so they may differ by an ulp), and
each gradient to 3e-2 of its norm: bf16 keeps 8 significant bits, and the single-device bf16 gradients
are themselves ~1e-2 (in norm) from the fp32 model's, so a tp run that sums in another order can only
be held to that scale.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.ir import meta as M
from autoshard.ir import ops
from autoshard.ir.mesh import MeshSpec
from autoshard.ir.placement import R, Shard
from autoshard.ir.program import comm_summary
from autoshard.runtime.module import ParallelModule
from tests.harness.models import batch, build
from tests.harness.simulate import run_ranks

PIN = {"head.weight": Shard(0)}   # vocab-parallel head: at these tiny sizes the planner may prefer another


class Head(nn.Module):
    """An LM head and the loss as users write it: ``F.cross_entropy`` on ``(-1, V)`` logits with any of
    label smoothing, ignore_index and reduction, plus an optional z-loss on ``logsumexp`` of the logits."""

    def __init__(self, vocab=97, smoothing=0.0, ignore_index=-100, reduction="mean", z_loss=0.0, weight=False,
                 bias=True):
        super().__init__()
        self.head = nn.Linear(16, vocab, bias=bias)
        self.vocab, self.smoothing, self.ignore_index = vocab, smoothing, ignore_index
        self.reduction, self.z_loss = reduction, z_loss
        self.register_buffer("weight", torch.rand(vocab) + 0.5 if weight else None)

    def forward(self, x, targets):
        logits = self.head(x)
        loss = F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1), weight=self.weight,
                               ignore_index=self.ignore_index, reduction=self.reduction,
                               label_smoothing=self.smoothing)
        if self.z_loss:
            loss = loss + self.z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean()
        return loss


def inputs(vocab, ignore=None, rows_ignored=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, 16, generator=g).to(dtype)
    targets = torch.randint(0, vocab, (4, 8), generator=g)
    if ignore is not None:
        targets[0, :rows_ignored] = ignore          # HF pads shifted labels with -100
        targets[2, -1] = ignore
    return x, targets


def run(model, t, args, loss_fn=None, **options):
    """Every rank of tp=t in threads: per rank (output, {name: full grad}, program, tracer calls, bytes)."""
    opts = autoshard.CompileOptions(**options)
    programs = [autoshard.compile_rank(model, {"tp": t}, r, args, options=opts) for r in range(t)]

    def rank_main(r, comms):
        pm = ParallelModule(programs[r], model, comms)
        pm.reset_comm_counts()
        out = pm(*copy.deepcopy(args))
        (loss_fn(out) if loss_fn else out.sum()).backward()
        calls, nbytes = pm.comm_counts()   # before gathering the gradients for the comparison
        grads = {n: pm.gather(n, p.grad) for n, p in pm.local_parameters().items()}
        grads.update({alias: grads[main] for alias, main in pm.aliases.items()})  # tied names too
        return out, grads, programs[r], dict(calls), dict(nbytes)

    return run_ranks(MeshSpec(tp=t), rank_main)


def reference(model, args, loss_fn=None):
    ref = copy.deepcopy(model)
    out = ref(*copy.deepcopy(args))
    (loss_fn(out) if loss_fn else out.sum()).backward()
    return out, {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}


def assert_exact(model, t, args, loss_fn=None, bf16=False, exact_bytes=True, **options):
    """Loss and every gradient equal the single-device model's on every rank; the tracer ran the plan
    (call for call, and byte for byte unless ``exact_bytes=False``: a gather of a padded shard moves the
    padding too, which the plan's bytes leave out)."""
    want, want_grads = reference(model, args, loss_fn)
    results = run(model, t, args, loss_fn, **options)
    for rank, (out, grads, prog, calls, nbytes) in enumerate(results):
        got, ref = (loss_fn(out), loss_fn(want)) if loss_fn else (out, want)
        if bf16:
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, ref, equal_nan=True, msg=lambda m: f"rank {rank} loss: {m}")
        else:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, equal_nan=True,
                                       msg=lambda m: f"rank {rank} loss: {m}")
        assert set(grads) == set(want_grads)
        for name, g in want_grads.items():
            if bf16:
                assert grads[name].dtype == torch.bfloat16, name
                err = (grads[name].float() - g.float()).norm() / g.float().norm()
                assert err < 3e-2, f"rank {rank} grad {name}: {float(err):.3g} of its norm"
            else:
                torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} grad {name}: {m}")
        planned_calls, planned_bytes = comm_summary(prog.collectives)
        assert calls == dict(planned_calls), f"rank {rank}"
        assert nbytes == dict(planned_bytes) or not exact_bytes, f"rank {rank}"
    return results


def loss_nodes(prog):
    """{op record type or aten op name: [node]} of the losses in a compiled program."""
    out = {}
    for n in prog.gm.graph.nodes:
        if n.op == "call_module":
            out.setdefault(type(prog.gm.get_submodule(n.target)).__name__, []).append(n)
        elif n.op == "call_function":
            out.setdefault(str(n.target), []).append(n)
    return out


def loss_collectives(prog):
    return [(c.phase, c.kind, c.shape, c.stacked, c.itemsize) for c in prog.collectives]


# --- ignore_index -------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("ignore", [-100, 5])
def test_ignore_index_is_exact(t, ignore):
    """HF's -100 padding, and a custom ignore_index that is a real class (5 also appears as a target)."""
    model = Head(97, ignore_index=ignore)
    x, targets = inputs(97, ignore=ignore)
    assert_exact(model, t, (x, targets), pins=PIN)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_every_row_ignored(reduction, smoothing):
    """All rows ignored: torch gives NaN for the mean (0/0) with a zero gradient, 0 for the sum; so must
    we (a product ``0 * (g / 0)`` would make every gradient NaN)."""
    model = Head(96, smoothing=smoothing, reduction=reduction)
    x, targets = inputs(96, ignore=-100, rows_ignored=8)
    targets.fill_(-100)
    results = assert_exact(model, 2, (x, targets), pins=PIN)
    out = results[0][0]
    assert out.isnan() if reduction == "mean" else not out.any()
    assert all(not g.any() for g in results[0][1].values())


# --- label smoothing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("vocab", [96, 97])                       # 97: the last rank's shard is padded
@pytest.mark.parametrize("reduction, ignore", [("mean", None), ("mean", -100), ("sum", -100), ("none", 7)])
def test_label_smoothing_is_vocab_parallel_and_exact(t, vocab, reduction, ignore):
    # without a bias the logits are the head's fresh matmul output, which the loss overwrites in place
    model = Head(vocab, smoothing=0.1, reduction=reduction, ignore_index=-100 if ignore is None else ignore,
                 bias=vocab == 97)
    args = inputs(vocab, ignore=ignore)
    w = torch.linspace(0.5, 1.5, 32)
    loss_fn = (lambda out: (out * w).sum()) if reduction == "none" else None   # a non-uniform upstream grad
    results = assert_exact(model, t, args, loss_fn, pins=PIN)
    prog = results[-1][2]   # the last rank: the padded one at V=97
    (ce,) = loss_nodes(prog)["VocabParallelCrossEntropy"]
    record = prog.gm.get_submodule(ce.target)
    assert M.STRATEGY.get(ce).lowering == "vocab_parallel_cross_entropy"
    assert (record.label_smoothing, record.vocab, record.stats, record.inplace) == (0.1, vocab, 3, vocab == 96)
    assert record.valid == vocab - (t - 1) * -(-vocab // t)
    # exactly the loss's two all-reduces, the statistics stacked into the second, in fp32
    assert loss_collectives(prog) == [("fwd", "all_reduce", (32,), 1, 4), ("fwd", "all_reduce", (32,), 3, 4)]


def test_without_smoothing_the_loss_stacks_two_stats():
    prog = autoshard.compile_rank(Head(97), {"tp": 2}, 0, inputs(97), options=autoshard.CompileOptions(pins=PIN))
    assert loss_collectives(prog) == [("fwd", "all_reduce", (32,), 1, 4), ("fwd", "all_reduce", (32,), 2, 4)]


# --- z-loss -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("vocab", [96, 97])
def test_z_loss_logsumexp_is_vocab_parallel_and_exact(t, vocab, tmp_path):
    model = Head(vocab, smoothing=0.1, z_loss=1e-2)
    results = assert_exact(model, t, inputs(vocab, ignore=-100), pins=PIN, dump=str(tmp_path))
    prog = results[-1][2]
    (lse,) = loss_nodes(prog)["VocabParallelLogsumexp"]
    assert M.STRATEGY.get(lse).lowering == "vocab_parallel_logsumexp"
    assert M.SPEC.get(lse.args[0]).tp == Shard(2)                # the logits were not gathered for it
    assert loss_collectives(prog) == [("fwd", "all_reduce", (32,), 1, 4), ("fwd", "all_reduce", (32,), 3, 4),
                                      ("fwd", "all_reduce", (4, 8), 1, 4), ("fwd", "all_reduce", (4, 8), 1, 4)]
    plan = (tmp_path / "plan.md").read_text()
    loss = plan[plan.index("## Loss"):plan.index("## Fallbacks")]
    assert "`cross_entropy_loss` cross_entropy (reduction=mean, ignore_index=-100, label_smoothing=0.1" in loss
    assert "`logsumexp` logsumexp over dims [2]: **vocab-parallel**" in loss
    assert "replicated" not in loss and "gather" not in loss.replace("never gathered", "")


def test_logsumexp_rule_on_kept_and_reduced_dims():
    """A sharded reduced dim takes the lowering (padded too); a sharded kept dim runs the op locally."""
    from autoshard.passes.capture import capture
    from autoshard.passes.rules import RuleContext, strategies_for

    class Lse(nn.Module):
        def forward(self, x):
            return torch.logsumexp(x, dim=-1, keepdim=True).sum()

    gm = capture(Lse(), (torch.randn(4, 6, 97),)).gm
    node = next(n for n in gm.graph.nodes if "logsumexp" in str(n.target))
    got = {(s.ins[0], s.out, s.lowering) for s in strategies_for(node, RuleContext(MeshSpec(tp=2)))}
    assert got == {(R, R, None), (Shard(0), Shard(0), None), (Shard(1), Shard(1), None),
                   (Shard(2), R, "vocab_parallel_logsumexp")}


# --- a loss the lowering does not cover: replicated, gathered, and said so ------------------------------
@pytest.mark.parametrize("t", [2, 4])
def test_class_weights_gather_the_logits_and_plan_says_so(t, tmp_path):
    model = Head(97, smoothing=0.1, weight=True)
    results = assert_exact(model, t, inputs(97, ignore=-100), pins=PIN, dump=str(tmp_path), exact_bytes=True)
    prog = results[0][2]
    assert "VocabParallelCrossEntropy" not in loss_nodes(prog)
    padded = -(-97 // t) * t   # a gather of a padded shard moves the padding too
    assert [(c.phase, c.kind, c.shape) for c in prog.collectives] == [("fwd", "all_gather", (32, padded))]
    plan = (tmp_path / "plan.md").read_text()
    assert ("**replicated**, because the vocab-parallel lowering does not apply (class weights). Its input is "
            "whole on every rank: `redistribute_0` gathers `view`: all_gather fwd") in plan


def test_probability_targets_are_not_taken_for_indices():
    """Soft targets (a float (N, V) tensor) must not be read as class indices by the lowering."""
    class Soft(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(16, 96)

        def forward(self, x, probs):
            return F.cross_entropy(self.head(x), probs)

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(32, 16, generator=g), torch.softmax(torch.randn(32, 96, generator=g), -1))
    results = assert_exact(Soft(), 2, args, pins=PIN)
    assert "VocabParallelCrossEntropy" not in loss_nodes(results[0][2])


# --- a loss computed outside the model from returned logits -------------------------------------------
@pytest.mark.parametrize("t", [2, 4])
def test_loss_outside_the_model_on_returned_logits(t, tmp_path):
    """The user calls the model for logits and writes the loss (smoothing, -100, z-loss) themselves: the
    returned logits are gathered, so the loss is exact; plan.md says the output is gathered."""
    model = build("gpt", n_layer=1, vocab_size=97)
    (idx, targets), _ = batch("gpt", 97)
    targets = targets.clone()
    targets[:, -2:] = -100

    def loss_fn(out):
        logits = out[0]
        ce = F.cross_entropy(logits.view(-1, 97), targets.view(-1), label_smoothing=0.1)
        return ce + 1e-3 * torch.logsumexp(logits, -1).pow(2).mean()

    results = assert_exact(model, t, (idx, targets), loss_fn, dump=str(tmp_path), exact_bytes=True)
    prog = results[0][2]
    logits_out = prog.gm.graph.output_node().args[0][0]
    assert [(c.kind, c.shape) for c in prog.collectives if c.node == logits_out.name and c.phase == "fwd"] == \
        [("all_gather", (2, 8, -(-97 // t) * t))]   # the padded vocab travels padded
    plan = (tmp_path / "plan.md").read_text()
    assert "(2, 8, 97) is made whole by" in plan and "a loss computed from it outside the model" in plan


# --- a real causal LM's own loss: HF shifts the labels and pads them with -100 ------------------------
def test_hf_causal_lm_loss_with_padded_labels():
    model = build("hf", vocab_size=101)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 101, (2, 8), generator=g)
    labels = ids.clone()
    labels[0, -3:] = -100
    want = copy.deepcopy(model)(input_ids=ids, labels=labels).loss
    prog = autoshard.compile_rank(model, {"tp": 2}, 0, (), dict(input_ids=ids, labels=labels),
                                  options=autoshard.CompileOptions(loss_only=True))
    assert "VocabParallelCrossEntropy" in loss_nodes(prog)
    from tests.harness.simulate import simulate
    for out, _, _ in simulate(model, 2, (), dict(input_ids=ids, labels=labels), loss_fn=lambda o: o.loss,
                              loss_only=True):
        torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)


# --- bf16 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [2, 4])
def test_bf16_loss_reduces_in_fp32(t):
    """A bf16 model: loss and gradients within bf16 tolerance of the single-device bf16 model, returned in
    bf16; the loss statistics travel in fp32 (the tracer's bytes equal the plan's 4-byte statistics)."""
    model = Head(97, smoothing=0.1, z_loss=1e-2).to(torch.bfloat16)
    results = assert_exact(model, t, inputs(97, ignore=-100, dtype=torch.bfloat16), bf16=True, pins=PIN)
    assert {c.itemsize for c in results[0][2].collectives} == {4}


def test_bf16_gpt_matches_single_device_bf16():
    model = build("gpt", n_layer=2, vocab_size=97).to(torch.bfloat16)
    args, _ = batch("gpt", 97)
    results = assert_exact(model, 2, args, loss_fn=lambda out: out[1], bf16=True, loss_only=True)
    prog = results[0][2]
    ce = loss_nodes(prog)["VocabParallelCrossEntropy"]
    assert len(ce) == 1 and M.STRATEGY.get(ce[0]).lowering == "vocab_parallel_cross_entropy"
    assert isinstance(prog.gm.get_submodule(ce[0].target), ops.VocabParallelCrossEntropy)
