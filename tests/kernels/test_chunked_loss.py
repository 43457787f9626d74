"""The LM head and cross-entropy chunked over tokens (``passes/chunk_loss.py``,
``runtime/chunked_loss.py``): the logits never exist whole, the loss and gradients are the unchunked ones.
"""
from __future__ import annotations

import copy

import pytest
import torch

import autoshard
from autoshard.ir.mesh import MeshSpec
from autoshard.passes.chunk_loss import CHUNKED_LOSS, default_chunk
from autoshard.runtime.chunked_loss import ChunkedLinearCrossEntropy
from tests.harness.simulate import simulate


def _gpt(vocab=97, dtype=torch.float32):
    from autoshard.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=16, n_layer=2, n_head=2, n_embd=32)).to(dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (4, 16), generator=g)
    tgt = ids.roll(-1, 1)
    tgt[0, :5] = -100          # uneven ignored targets
    tgt[2, 3] = -100
    return model, ids, tgt


def _reference(model, ids, tgt):
    ref = copy.deepcopy(model)
    _, loss = ref(ids, tgt)
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("rows", [24, 64])          # 64 rows: 24 leaves a partial last chunk; 64 is one chunk
def test_loss_and_gradients_equal_single_device(t, rows):
    model, ids, tgt = _gpt()
    rloss, rgrads = _reference(model, ids, tgt)
    for out, grads, _ in simulate(model, t, (ids, tgt), loss_fn=lambda o: o[1], loss_only=True, loss_chunk_rows=rows):
        torch.testing.assert_close(out[1].detach(), rloss, atol=1e-6, rtol=1e-6)
        for name, g in grads.items():          # the tied lm_head/wte among them
            torch.testing.assert_close(g, rgrads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_the_graph_has_no_whole_logits_and_the_dump_says_so(tmp_path):
    model, ids, tgt = _gpt()
    prog = autoshard.compile_rank(model, MeshSpec(tp=2), 0, (ids, tgt), options=autoshard.CompileOptions(
        loss_only=True, loss_chunk_rows=24, dump=str(tmp_path)))
    (record,) = prog.gm.meta[CHUNKED_LOSS].losses
    assert record.rewritten and record.rows == 64 and record.chunk == 24 and record.local_vocab == 49
    assert not any(n.op == "call_module" and "column_matmul" in n.target and
                   prog.gm.get_submodule(n.target).shape[-1] == 97 for n in prog.gm.graph.nodes)
    assert sum(c.what == "loss: row max" for c in prog.collectives) == 3            # one per chunk
    plan = (tmp_path / "plan.md").read_text()
    assert "## Chunked loss" in plan and "3 chunks of 24 rows" in plan


def test_auto_leaves_small_logits_whole():
    model, ids, tgt = _gpt()
    prog = autoshard.compile_rank(model, MeshSpec(tp=2), 0, (ids, tgt),
                                  options=autoshard.CompileOptions(loss_only=True))
    (record,) = prog.gm.meta[CHUNKED_LOSS].losses
    assert not record.rewritten and "under the 64 MiB" in record.why


def test_left_alone_when_the_logits_are_returned():
    model, ids, tgt = _gpt()
    prog = autoshard.compile_rank(model, MeshSpec(tp=2), 0, (ids, tgt),
                                  options=autoshard.CompileOptions(loss_chunk_rows=24))
    (record,) = prog.gm.meta[CHUNKED_LOSS].losses
    assert not record.rewritten and "read by more than the loss" in record.why


def test_bf16_matches_the_unchunked_bf16_program():
    model, ids, tgt = _gpt(dtype=torch.bfloat16)
    (plain,) = simulate(model, 1, (ids, tgt), loss_fn=lambda o: o[1], loss_only=True, loss_chunk_rows=None)
    (chunked,) = simulate(model, 1, (ids, tgt), loss_fn=lambda o: o[1], loss_only=True, loss_chunk_rows=16)
    assert chunked[0][1].dtype == torch.bfloat16
    torch.testing.assert_close(chunked[0][1], plain[0][1], atol=2e-2, rtol=1e-2)
    for name in plain[1]:
        g, r = chunked[1][name].double(), plain[1][name].double()
        assert float((g - r).abs().max() / r.abs().max()) < 2e-2, name


def test_every_row_ignored_gives_nan_loss_and_zero_gradient_like_torch():
    h = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(12, 8, requires_grad=True)
    target = torch.full((10,), -100)
    loss = ChunkedLinearCrossEntropy.apply(h, w, target, None, 0, 12, -100, 1, 4)
    ref = torch.nn.functional.cross_entropy(h @ w.t(), target)
    assert torch.isnan(loss) and torch.isnan(ref)
    loss.backward()
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_eval_forward_computes_no_gradient_buffers():
    h, w, target = torch.randn(10, 8), torch.randn(12, 8), torch.randint(0, 12, (10,))
    with torch.no_grad():
        loss = ChunkedLinearCrossEntropy.apply(h, w, target, None, 0, 12, -100, 1, 4)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(h @ w.t(), target))


def test_default_chunk_follows_liger_with_a_floor():
    assert default_chunk(4096, 50304, 768) == 256           # 4096 / 66 -> 64, floored at 256
    assert default_chunk(4096, 25152, 4096) == 1024         # tp=2, h=4096: 7 parts -> 586 -> 1024
    assert default_chunk(100, 50304, 768) == 100            # never more than the rows


def test_default_chunk_on_a_gpu_gives_each_chunk_enough_gemm_work():
    """On a GPU a chunk must outlast the host's cost of launching it: at V=32000, H=1024 Liger's 256 rows
    (0.05 TFLOP a chunk) left an H100 waiting, 2048 (0.4 TFLOP) did not; a large vocab keeps Liger's rule,
    and a chunk's fp32 logits stay within GPU_MAX_CHUNK_BYTES."""
    from autoshard.passes.chunk_loss import GPU_MAX_CHUNK_BYTES, GPU_MIN_CHUNK_FLOPS
    assert default_chunk(8192, 32000, 1024) == 256                      # CPU: Liger's rule
    assert default_chunk(8192, 32000, 1024, gpu=True) == 2048
    assert 6 * 2048 * 32000 * 1024 >= GPU_MIN_CHUNK_FLOPS > 6 * 1024 * 32000 * 1024
    assert default_chunk(8192, 128256, 4096, gpu=True) == 256           # Llama 3's head: Liger's rule is busy enough
    assert default_chunk(65536, 8192, 256, gpu=True) * 8192 * 4 <= GPU_MAX_CHUNK_BYTES
    assert default_chunk(1000, 32000, 1024, gpu=True) == 1000           # never more than the rows


def _pp_rank(rank, world, chunk):
    from autoshard.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32))
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(1))
    tgt = ids.roll(-1, 1)
    tgt[0, :7] = -100
    pm = autoshard.parallelize(model, autoshard.init_mesh(pp=world), (ids, tgt), microbatches=2,
                               loss_chunk_rows=chunk)
    loss = float(pm.step(ids, tgt))
    return loss, {n: p.grad.full_tensor().numpy() for n, p in pm.named_parameters() if p.grad is not None}


def test_pipeline_last_stage_chunks_its_summed_loss():
    """pm.step programs return only the loss, and microbatch_loss makes it a sum: chunk it too."""
    from tests.harness.distributed import run_distributed
    chunked = run_distributed(_pp_rank, 2, 8, timeout=240)
    plain = run_distributed(_pp_rank, 2, None, timeout=240)
    for (cl, cg), (pl, pg) in zip(chunked, plain):
        assert cl == pytest.approx(pl, rel=1e-6)
        assert cg.keys() == pg.keys() and cg
        for name in cg:
            torch.testing.assert_close(torch.from_numpy(cg[name]), torch.from_numpy(pg[name]), atol=1e-6, rtol=1e-5)


def test_an_incoming_gradient_scales_and_a_second_backward_is_a_clear_error():
    h, w = torch.randn(10, 8, requires_grad=True), torch.randn(12, 8, requires_grad=True)
    target = torch.randint(0, 12, (10,))
    loss = ChunkedLinearCrossEntropy.apply(h, w, target, None, 0, 12, -100, 1, 4)
    (loss * 2).backward(retain_graph=True)          # g = 2: the pipeline's 1/count seeds land here too
    rh, rw = torch.autograd.grad(2 * torch.nn.functional.cross_entropy(h @ w.t(), target), (h, w))
    torch.testing.assert_close(h.grad, rh)
    torch.testing.assert_close(w.grad, rw)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_the_loss_keeps_the_replaced_losss_dtype_and_no_grad_skips_the_gradients():
    h, w = torch.randn(10, 8).bfloat16(), torch.randn(12, 8).bfloat16()
    target = torch.randint(0, 12, (10,))
    loss = ChunkedLinearCrossEntropy.apply(h, w, target, None, 0, 12, -100, 2, 4, True, torch.float32)
    assert loss.dtype == torch.float32          # HF casts its logits: the sum is an fp32 number
    ref = torch.nn.functional.cross_entropy((h @ w.t()).float(), target, reduction="sum")
    torch.testing.assert_close(loss, ref, rtol=1e-2, atol=1e-2)
    hg = h.float().requires_grad_()
    with torch.no_grad():
        out = ChunkedLinearCrossEntropy.apply(hg, w.float(), target, None, 0, 12, -100, 1, 4, False)
    assert not out.requires_grad
