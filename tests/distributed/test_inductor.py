"""``codegen="inductor"``: each rank's program through torch.compile, exact against the single-device model.

On CPU Inductor emits C++ rather than Triton, but the handoff is the same: the bound program with its
collectives as functional collectives (``runtime/traceable.py``), forward and backward traced by dynamo,
compiled by Inductor. The composites of the vocab-parallel losses are checked against the eager
autograd functions first, without processes.
"""
import copy

import pytest
import torch

import autoshard
from autoshard.ir import meta as M
from autoshard.runtime import traceable
from autoshard.runtime.losses import VocabParallelCrossEntropy, VocabParallelLogsumexp
from tests.harness.distributed import run_distributed
from tests.harness.models import batch, build, loss_and_logits
from tests.harness.parity_checks import adamw_errors, gradient_errors, rel
from tests.harness.pipeline_checks import run_configs

ONE = traceable.ONE_RANK     # a one-rank group: the functional collectives are the identity


class _One:
    size, rank, group = 1, 0, None

    def all_reduce(self, x, phase, op=None):
        return x


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_the_composite_cross_entropy_is_the_eager_one(smoothing, reduction):
    torch.manual_seed(0)
    logits = torch.randn(12, 10, dtype=torch.float64)
    target = torch.randint(0, 7, (12,))
    target[[2, 5]] = -100
    outs = []
    for composite in (True, False):
        x = logits.clone().requires_grad_()
        if composite:   # 7 real classes, 3 padded columns (a vocab tp does not divide)
            loss = traceable.cross_entropy(x, target, ONE, 0, 7, -100, reduction, smoothing, 7)
        else:
            loss = VocabParallelCrossEntropy.apply(x, target, _One(), 0, 7, -100, reduction, False, smoothing, 7)
        (loss.sum() if reduction == 0 else loss).backward()
        outs.append((loss.detach(), x.grad))
    assert rel(outs[0][0], outs[1][0]) < 1e-6
    assert rel(outs[0][1], outs[1][1]) < 1e-6
    assert float(outs[0][1][:, 7:].abs().max()) == 0.0     # padded columns take no gradient


def test_the_composite_logsumexp_is_the_eager_one():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 9, dtype=torch.float64)

    class Op:
        dims, keepdim, dim, valid = (-1,), False, 2, 7
    outs = []
    for composite in (True, False):
        xx = x.clone().requires_grad_()
        out = traceable._vocab_parallel_logsumexp(Op, _One(), xx) if composite else \
            VocabParallelLogsumexp.apply(xx, _One(), Op.dims, Op.keepdim, Op.dim, Op.valid)
        (out * torch.arange(12.0, dtype=out.dtype).reshape(3, 4)).sum().backward()
        outs.append((out.detach(), xx.grad))
    assert rel(outs[0][0], outs[1][0]) < 1e-6 and rel(outs[0][1], outs[1][1]) < 1e-6   # both in fp32


def _tp_parity(rank, world, kind, sequence_parallel=False, dropout=0.0):
    import torch._dynamo.utils as dynamo_utils
    vocab = 97 if kind == "gpt" else 101      # 97: padded vocab shards at tp=2
    model = build(kind, vocab_size=vocab, **({"embd_pdrop": dropout, "resid_pdrop": dropout} if dropout else {}))
    ref = copy.deepcopy(model)
    args, kwargs = batch(kind, vocab)
    pm = autoshard.parallelize(model, autoshard.init_mesh(tp=world), args, kwargs, loss_only=True,
                               codegen="inductor", sequence_parallel=sequence_parallel)
    graph = pm.forward_graphs[0]
    calls = iter(range(100, 200))

    def both():       # each side seeded alike: with dropout on, the single device's masks on every rank
        seed = next(calls)
        torch.manual_seed(seed)
        loss = loss_and_logits(kind, pm(*args, **kwargs))[0]
        torch.manual_seed(seed)
        return loss, loss_and_logits(kind, ref(*args, **kwargs))[0]
    loss, rloss = both()
    loss.backward()
    rloss.backward()
    errs = {"loss": rel(loss.detach(), rloss.detach()), **gradient_errors(pm, ref)}

    def step():
        for loss in both():
            loss.backward()
    errs.update(adamw_errors(pm, ref, step, 3))
    return dict(errs=errs, compiled=type(graph).__name__, breaks=sum(dynamo_utils.counters["graph_break"].values()),
                fusion=getattr(pm.program.gm.meta.get(M.FUSION_REPORT), "why", None))


@pytest.mark.parametrize("kind,sequence_parallel,dropout", [pytest.param("gpt", False, 0.0, marks=pytest.mark.slow),
                                                            ("hf", False, 0.0), ("hf", False, 0.1), ("gpt", True, 0.0)])
def test_inductor_at_tp2_is_exact(kind, sequence_parallel, dropout):
    """The GPT with sequence parallelism: its gather (all-gather forward, reduce-scatter backward) as
    functional collectives too, so the program still compiles whole (the plain GPT at tp=2, the same
    program without the gathers, is slow). HF GPT-2 with embedding and residual dropout: the single
    device's masks (Inductor compiles with fallback_random, torch's own generator)."""
    for r in run_distributed(_tp_parity, 2, kind, sequence_parallel, dropout, timeout=600):
        assert r["compiled"] == "OptimizedModule"
        assert r["breaks"] == 0, "the program should compile as whole graphs"
        assert "codegen='inductor'" in r["fusion"]      # Inductor fuses: autoshard's own kernels stand aside
        bad = {k: v for k, v in r["errs"].items() if v > 1e-5}
        assert not bad, bad


def test_inductor_pipeline_and_data_parallel_are_exact():
    """pp=2 x tp=2, and dp=2 x pp=2 with ZeRO-1: the dp buckets' hooks on the step's leaves fire from the
    compiled backward as from the eager one."""
    configs = [("gpt", {"pp": 2, "tp": 2}, {"microbatches": 4, "codegen": "inductor"}, {"vocab_size": 97}),
               ("gpt", {"dp": 2, "pp": 2}, {"microbatches": 2, "zero": 1, "codegen": "inductor"}, {"vocab_size": 97})]
    for per_rank in run_distributed(run_configs, 4, configs, timeout=900):
        for r in per_rank:
            assert max(r["losses"]) < 1e-5 and max(r["grads"]) < 1e-5 and r["final"] < 1e-5, r
