"""The chunked LM head's cross-entropy kernels (``kernels/cross_entropy.py``) in Triton's interpreter:
fp32 exact against the composed ops and torch's cross_entropy, bf16 against an fp32 reference, with
padded vocab columns, ignore_index and label smoothing, and inside a tp=2 program on gloo."""
import copy

import pytest
import torch

from autoshard.runtime.chunked_loss import ChunkedLinearCrossEntropy
from tests.harness.parity_checks import rel


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _head_and_loss(h, w, target, kernel, chunk=5, valid=None, eps=0.0, reduction=1):
    hl, wl = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    valid = valid or w.shape[0]
    loss = ChunkedLinearCrossEntropy.apply(hl, wl, target, None, 0, valid, -100, reduction, chunk, True, None, eps,
                                           valid, True, None, (), kernel)
    loss.backward()
    return loss.detach(), hl.grad, wl.grad


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("reduction", [1, 2])
def test_the_kernels_are_the_composed_ops_in_fp32(eps, reduction):
    torch.manual_seed(0)
    h, w = torch.randn(13, 16), torch.randn(11, 16)     # 11 rows of the head: 9 real classes, 2 padded
    target = torch.randint(0, 9, (13,))
    target[[3, 7]] = -100
    fused = _head_and_loss(h, w, target, True, valid=9, eps=eps, reduction=reduction)
    composed = _head_and_loss(h, w, target, False, valid=9, eps=eps, reduction=reduction)
    for a, b in zip(fused, composed):
        assert rel(a, b) < 1e-5, (a, b)
    assert float(fused[2][9:].abs().max()) == 0.0           # padded rows of the head take no gradient
    ref = torch.nn.functional.cross_entropy(h @ w[:9].t(), target, label_smoothing=eps,
                                            reduction="mean" if reduction == 1 else "sum")
    assert rel(fused[0], ref) < 1e-5


def test_bf16_against_an_fp32_reference():
    torch.manual_seed(0)
    h, w = torch.randn(16, 32), torch.randn(24, 32)
    target = torch.randint(0, 24, (16,))
    got = _head_and_loss(h.bfloat16(), w.bfloat16(), target, True, chunk=6)
    want = _head_and_loss(h, w, target, False, chunk=6)
    assert rel(got[0].float(), want[0]) < 2e-2
    assert rel(got[1].float(), want[1]) < 5e-2 and rel(got[2].float(), want[2]) < 5e-2


def _tp2(rank, world):
    import autoshard
    from tests.harness.models import batch, build
    model = build("gpt", vocab_size=97)
    ref = copy.deepcopy(model)
    (idx, tgt), _ = batch("gpt", 97, B=4)
    tgt[0, :3] = -100
    pm = autoshard.parallelize(model, autoshard.init_mesh(tp=world), (idx, tgt), loss_only=True, fuse=True,
                               loss_chunk_rows=8)
    ops = [m for m in pm.program.gm.modules() if type(m).__name__ == "VocabParallelLinearCrossEntropy"]
    loss = pm(idx, tgt)[1]
    loss.backward()
    rloss = ref(idx, tgt)[1]
    rloss.backward()
    from tests.harness.parity_checks import gradient_errors
    return dict(kernel=[op.kernel for op in ops], loss=rel(loss.detach(), rloss.detach()),
                grads=max(gradient_errors(pm, ref).values()))


def test_the_kernels_in_a_tp2_program_match_the_single_device_model():
    from tests.harness.distributed import run_distributed
    for r in run_distributed(_tp2, 2, timeout=600):
        assert r["kernel"] == [True], r
        assert r["loss"] < 1e-5 and r["grads"] < 1e-5, r
