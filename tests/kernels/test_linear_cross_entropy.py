"""The chunked LM head + cross-entropy beyond the GPT cases of ``test_chunked_loss.py``: label smoothing,
sum reduction, padded vocab shards, a head whose ``f`` was not fused (``overlap_grad_allreduce`` off),
mixed precision, and the collectives run against those planned, per chunk.

Each case compares the loss and every gradient with the single-device model and with the unchunked
program (``loss_chunk_rows=None``), at tp=1 and tp=2 in the thread simulator.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.ir import ops
from autoshard.ir.mesh import MeshSpec
from autoshard.passes.chunk_loss import CHUNKED_LOSS
from autoshard.runtime.chunked_loss import ChunkedLinearCrossEntropy
from tests.simulated.test_losses import PIN, Head, assert_exact, inputs, run


def _chunked_nodes(prog):
    return [prog.gm.get_submodule(n.target) for n in prog.gm.graph.nodes if n.op == "call_module"
            and isinstance(prog.gm.get_submodule(n.target), ops.VocabParallelLinearCrossEntropy)]


def _same_as_unchunked(model, t, args, **options):
    """Loss and gradients of the chunked program equal the unchunked program's, rank by rank."""
    chunked = run(model, t, args, **options)
    plain = run(model, t, args, **(options | {"loss_chunk_rows": None}))
    for (out, grads, prog, *_), (pout, pgrads, pprog, *_) in zip(chunked, plain):
        assert _chunked_nodes(prog) and not _chunked_nodes(pprog)
        torch.testing.assert_close(out, pout, rtol=1e-5, atol=1e-6, equal_nan=True)
        for name, g in pgrads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    return chunked


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("smoothing,reduction", [(0.1, "mean"), (0.0, "sum"), (0.2, "sum")])
def test_smoothing_and_sum_with_uneven_ignored_rows_and_a_padded_vocab(t, smoothing, reduction):
    """V=97 at tp=2: 49 rows on rank 0, 48 real + 1 padding on rank 1; 32 rows in chunks of 12 (12, 12, 8)."""
    model = Head(97, smoothing=smoothing, ignore_index=-100, reduction=reduction, bias=False)
    args = inputs(97, ignore=-100, rows_ignored=5)
    options = dict(pins=PIN, loss_chunk_rows=12)
    assert_exact(model, t, args, exact_bytes=True, **options)      # the single-device model; tracer == plan
    for *_, prog, _, _ in _same_as_unchunked(model, t, args, **options):
        (op,) = _chunked_nodes(prog)
        assert (op.chunk, op.chunks, op.label_smoothing) == (12, 3, smoothing)
        assert op.vocab == 97 and op.reduction == {"mean": 1, "sum": 2}[reduction]
        rank_fwd = [c for c in prog.collectives if c.phase == "fwd"]
        assert len(rank_fwd) == (2 * 3 if t == 2 else 0)           # (max, stacked stats) per chunk
        assert all(c.stacked == (3 if smoothing else 2) for c in rank_fwd if c.stacked > 1)


def test_a_head_without_fused_f_is_not_reduced_twice():
    """overlap_grad_allreduce off: the head is a plain linear fed by f, which reduces dh itself."""
    model = Head(97, bias=False)
    args = inputs(97, ignore=-100)
    options = dict(pins=PIN, loss_chunk_rows=12, disable=("overlap_grad_allreduce",))
    assert_exact(model, 2, args, **options)
    for *_, prog, _, _ in _same_as_unchunked(model, 2, args, **options):
        (op,) = _chunked_nodes(prog)
        assert not op.reduce_input_grad
        assert not [c for c in prog.collectives if c.phase == "bwd" and "chunked loss" in c.what]


def test_the_fused_head_moves_its_gradient_all_reduce_into_the_loss():
    """GPT (tied head, hidden states that need a gradient): the ColumnParallelMatmul's f all-reduce is
    now the chunked op's, once per step, and the tracer runs exactly the plan."""
    from autoshard.ir.program import comm_summary
    from tests.kernels.test_chunked_loss import _gpt
    model, ids, tgt = _gpt()
    for out, grads, prog, calls, nbytes in run(model, 2, (ids, tgt), loss_fn=lambda o: o[1], loss_only=True,
                                                loss_chunk_rows=24):
        (op,) = _chunked_nodes(prog)
        assert op.reduce_input_grad
        (rec,) = [c for c in prog.collectives if c.phase == "bwd" and "chunked loss" in c.what]
        assert rec.shape == (64, 32)
        assert (calls, nbytes) == tuple(dict(x) for x in comm_summary(prog.collectives))


def test_mixed_precision_keeps_the_fp32_loss():
    """bf16 compute, fp32 loss (the logits are cast before the loss): the chunked op returns fp32 too."""
    from tests.kernels.test_chunked_loss import _gpt
    model, ids, tgt = _gpt()
    options = dict(loss_fn=lambda o: o[1], mixed_precision="bf16", loss_only=True)
    (out, grads, prog, *_), = run(model, 1, (ids, tgt), loss_chunk_rows=24, **options)
    (pout, pgrads, *_), = run(model, 1, (ids, tgt), loss_chunk_rows=None, **options)
    assert _chunked_nodes(prog) and out[1].dtype == pout[1].dtype == torch.float32
    torch.testing.assert_close(out[1], pout[1], rtol=1e-2, atol=1e-2)
    for name, g in pgrads.items():
        assert float((grads[name] - g).norm() / g.norm()) < 2e-2, name


def test_bf16_at_tp2_matches_the_unchunked_bf16_program():
    """bf16 weights and activations, a padded vocab shard (97 over 2): fp32 statistics, bf16 results."""
    from tests.kernels.test_chunked_loss import _gpt
    model, ids, tgt = _gpt(dtype=torch.bfloat16)
    options = dict(loss_fn=lambda o: o[1], loss_only=True)
    chunked = run(model, 2, (ids, tgt), loss_chunk_rows=24, **options)
    plain = run(model, 2, (ids, tgt), loss_chunk_rows=None, **options)
    for (out, grads, prog, *_), (pout, pgrads, *_) in zip(chunked, plain):
        assert _chunked_nodes(prog) and out[1].dtype == torch.bfloat16
        torch.testing.assert_close(out[1], pout[1], atol=2e-2, rtol=1e-2)
        for name, g in pgrads.items():
            assert grads[name].dtype == torch.bfloat16, name
            assert float((grads[name].double() - g.double()).norm() / g.double().norm()) < 2e-2, name


@pytest.mark.parametrize("t", [1, 2])
def test_a_head_with_a_bias_is_chunked_with_its_bias_gradient(t):
    """GPT-J and Phi put a bias on the LM head: added per chunk, its gradient summed over the chunks (at
    tp=2 the bias is cut by vocab with the head, the padded column of rank 1 included)."""
    model = Head(97, bias=True, smoothing=0.1)
    args = inputs(97, ignore=-100, rows_ignored=3)
    options = dict(pins=PIN, loss_chunk_rows=12)
    assert_exact(model, t, args, **options)
    for *_, prog, _, _ in _same_as_unchunked(model, t, args, **options):
        (record,) = prog.gm.meta[CHUNKED_LOSS].losses
        assert record.rewritten and record.chunks == 3


def test_reduction_none_is_left_alone_and_says_why():
    model = Head(97, reduction="none", bias=False)
    prog = autoshard.compile_rank(model, MeshSpec(tp=1), 0, inputs(97),
                                  options=autoshard.CompileOptions(loss_chunk_rows=12))
    (record,) = prog.gm.meta[CHUNKED_LOSS].losses
    assert not record.rewritten and "reduction='none'" in record.why


def test_the_function_masks_padding_and_smooths_over_the_real_vocab_only():
    """One rank's view: 12 columns of which 10 are real, smoothing over V=10, mean over kept rows."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(9, 8, generator=g, requires_grad=True)
    w = torch.randn(12, 8, generator=g, requires_grad=True)
    target = torch.randint(0, 10, (9,), generator=g)
    target[[1, 4]] = -100
    loss = ChunkedLinearCrossEntropy.apply(h, w, target, None, 0, 10, -100, 1, 4, True, None, 0.1, 10)
    loss.backward()
    hr, wr = h.detach().requires_grad_(), w.detach().requires_grad_()
    ref = F.cross_entropy(hr @ wr[:10].t(), target, label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h.grad, hr.grad)
    torch.testing.assert_close(w.grad, wr.grad)
    assert torch.count_nonzero(w.grad[10:]) == 0                      # padded rows get no gradient


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="loss_chunk_rows"):
        autoshard.CompileOptions(loss_chunk_rows="big")
    with pytest.raises(ValueError, match="loss_chunk_rows"):
        autoshard.CompileOptions(loss_chunk_rows=-4)


def _tp_rank(rank, world):
    """Real gloo collectives: the chunked program (loss_only) against the unchunked one, on the same ranks."""
    from tests.kernels.test_chunked_loss import _gpt
    out = []
    for chunk in (24, None):
        model, ids, tgt = _gpt()
        pm = autoshard.parallelize(model, autoshard.init_mesh(tp=world), (ids, tgt), loss_only=True,
                                   loss_chunk_rows=chunk)
        loss = pm(ids, tgt)[1]
        loss.backward()
        assert bool(_chunked_nodes(pm.program)) == (chunk is not None)
        out.append((float(loss), {n: p.grad.full_tensor().numpy() for n, p in pm.named_parameters()}))
    return out


def test_tp2_over_gloo_equals_the_unchunked_program():
    from tests.harness.distributed import run_distributed
    for (closs, cgrads), (ploss, pgrads) in run_distributed(_tp_rank, 2, timeout=240):
        assert closs == pytest.approx(ploss, rel=1e-6)
        assert cgrads.keys() == pgrads.keys() and cgrads
        for name in cgrads:
            torch.testing.assert_close(torch.from_numpy(cgrads[name]), torch.from_numpy(pgrads[name]),
                                       atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("name,epilogue", [("gemma2", (("div", 3.0), ("tanh", None), ("mul", 3.0))),
                                           ("cohere", (("mul", 0.0625),))])
def test_scaled_and_soft_capped_logits_are_chunked(name, epilogue):
    """Gemma 2's soft cap (``cap * tanh(logits / cap)``) and Cohere's logit scale between the head and the
    loss run per chunk, their derivatives in backward: loss and gradients as the single-device model's."""
    import copy

    import transformers as T

    from tests.harness.parity_checks import rel
    from tests.harness.simulate import simulate
    from tests.models.test_more_families import CASES
    config, attn = CASES[name]
    cfg = config()
    if name == "gemma2":
        cfg.final_logit_softcapping = 3.0         # small enough that the tanh bends the tiny model's logits
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 128, (2, 8), generator=g), torch.randint(0, 128, (2, 8), generator=g)
    labels[0, :3] = -100
    kwargs = dict(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids), use_cache=False)
    ref = copy.deepcopy(model)
    want = ref(**kwargs).loss
    want.backward()
    grads = dict(ref.named_parameters(remove_duplicate=False))
    options = dict(loss_only=True, loss_chunk_rows=5)
    prog = autoshard.compile_rank(model, MeshSpec(tp=2), 0, (), kwargs, options=autoshard.CompileOptions(**options))
    (op,) = _chunked_nodes(prog)
    assert op.epilogue == epilogue and op.chunks == 4
    for out, got, _ in simulate(model, 2, (), kwargs, loss_fn=lambda o: o.loss, **options):
        assert rel(out.loss.detach(), want.detach()) <= 1e-5
        for n, p in grads.items():
            assert rel(got[n], p.grad, 1e-3 * float(p.grad.abs().max())) <= 1e-5, n
