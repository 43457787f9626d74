"""Ops that work along some dims keep the shards of the others (``passes/rules_reduce.py``, and
``rules_einsum.py`` for einsum's indices), and selective
recompute finds attention cores that are not spelled Llama's way (``passes/attention.py``).

Each model here is exact against eager in the simulator, and its heads stay sharded through the op: no
forward all-gather. Before these rules each of them was replicated, and GPT-OSS gathered its whole score
matrix every layer for the sinks' ``max(dim=-1)``.
"""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.ir import meta as M
from tests.harness.parity_checks import rel
from tests.harness.simulate import assert_same, simulate
from tests.harness.zoo import build_zoo


class Attention(nn.Module):
    """A causal attention whose scores go through ``scores`` between ``q @ k^T`` and the softmax, and
    whose probabilities go through ``probs`` before the product with ``v``; then an MLP and a loss."""

    def __init__(self, dim=32, heads=4, vocab=48, style="sinks"):
        super().__init__()
        self.heads, self.hd, self.style = heads, dim // heads, style
        self.emb = nn.Embedding(vocab, dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)
        self.sinks = nn.Parameter(torch.randn(heads))               # GPT-OSS: one logit a head, beside the keys
        self.qk_norm = nn.Parameter(torch.ones(self.hd) + 0.1 * torch.randn(self.hd))
        self.up, self.down = nn.Linear(dim, 64), nn.Linear(64, dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def split(self, x):
        b, s, _ = x.shape
        return x.view(b, s, self.heads, self.hd).transpose(1, 2)

    def forward(self, tokens, targets):
        h = self.emb(tokens)
        q, k, v = self.split(self.q(h)), self.split(self.k(h)), self.split(self.v(h))
        s = q.shape[2]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        if self.style == "rms_norm":          # a per-head RMSNorm of q and k (OLMo 2, Qwen 3), as one aten op
            q = F.rms_norm(q, (self.hd,), self.qk_norm, 1e-6)
            k = F.rms_norm(k, (self.hd,), self.qk_norm, 1e-6)
        if self.style == "einsum":            # the products spelled as einsum (Mamba-2's scan is a chain of them)
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(self.hd)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.hd)
        if self.style == "softcap":           # Gemma 2's soft-capping: six ops from the product to the softmax
            scores = torch.tanh(scores / 5.0) * 5.0
        scores = scores.masked_fill(~causal, float("-inf"))
        if self.style == "sinks":
            b = scores.shape[0]
            sink = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, 1)
            logits = torch.cat([scores, sink], dim=-1)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            p = logits.softmax(-1)[..., :-1]
        elif self.style == "triangle":        # a chunked scan's masks and running sums, head by head
            p = scores.softmax(-1)
            p = p + 0.1 * p.cumsum(-1).tril()
            p = p + 0.01 * p.amax(dim=-1, keepdim=True) + 0.01 * p.topk(2, dim=-1).values.sum(-1, keepdim=True)
        else:
            p = scores.softmax(-1)
        if self.style == "einsum":            # heads kept in the output, then a sum over them (a partial)
            a = torch.einsum("bhqk,bhkd->bqhd", p, v).reshape(h.shape)
            a = a + torch.einsum("bhqd->bqd", v).repeat(1, 1, self.heads) * 0.1
        else:
            a = (p @ v).transpose(1, 2).reshape(h.shape)
        h = h + self.o(a)
        h = h + self.down(F.gelu(self.up(h)))
        return F.cross_entropy(self.out(h).flatten(0, 1), targets.flatten())


def _forward_gathers(model, args, t):
    prog = autoshard.compile_rank(model, {"tp": t}, 0, args, {})
    return [c for c in prog.collectives if c.phase == "fwd" and c.kind == "all_gather"], prog


@pytest.mark.parametrize("style", ["sinks", "rms_norm", "triangle", "einsum"])
def test_heads_stay_sharded_through_reductions_and_the_step_is_exact(style):
    torch.manual_seed(0)
    model = Attention(style=style)
    args = (torch.randint(0, 48, (2, 8)), torch.randint(0, 48, (2, 8)))
    gathers, _ = _forward_gathers(model, args, 2)
    assert gathers == [], [(c.node, c.what) for c in gathers]
    assert_same(model, args, 2)
    assert_same(model, args, 4)


@pytest.mark.parametrize("style", ["sinks", "softcap"])
def test_selective_recompute_finds_cores_with_sinks_and_soft_capping(style):
    """The softmax is found through the ops between it and ``q @ k^T`` (five for the sinks' cat and
    max, six for soft-capping): one region, and the step stays exact."""
    torch.manual_seed(0)
    model = Attention(style=style)
    args = (torch.randint(0, 48, (2, 8)), torch.randint(0, 48, (2, 8)))
    prog = autoshard.compile_rank(model, {"tp": 2}, 0, args, {},
                                  options=autoshard.CompileOptions(recompute="selective"))
    plan = prog.gm.meta[M.RECOMPUTE_PLAN]
    assert len(plan.regions) == 1 and not plan.skipped, plan
    assert_same(model, args, 2, recompute="selective")


class BmmAttention(nn.Module):
    """fairseq-style attention (XGLM): heads folded into the batch, ``bmm`` for both products."""

    def __init__(self, dim=32, heads=4, vocab=48):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, targets):
        h = self.emb(tokens)
        b, s, d = h.shape
        q, k, v = (x.reshape(b, s, self.heads, self.hd).transpose(1, 2).reshape(b * self.heads, s, self.hd)
                   for x in self.qkv(h).chunk(3, dim=-1))
        p = torch.bmm(q, k.transpose(1, 2)).softmax(-1)
        a = torch.bmm(p, v).reshape(b, self.heads, s, self.hd).transpose(1, 2).reshape(b, s, d)
        return F.cross_entropy(self.out(h + self.o(a)).flatten(0, 1), targets.flatten())


def test_selective_recompute_keeps_a_core_that_slices_replicated_kv_heads():
    """GPT-OSS at tp=4 (2 kv heads): the kv heads are replicated and each rank slices the ones its query
    head uses, inside the core: a slice forward, its gradient gathered in backward. Recomputing the
    core runs the slice again and no collective, so each layer's core is recomputed (each was left out
    as holding a collective), and the step stays exact."""
    model = build_zoo("gpt_oss")
    if model is None:
        pytest.skip("this transformers has no GPT-OSS")
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 128, (2, 8), generator=g), torch.randint(0, 128, (2, 8), generator=g)
    kwargs = dict(input_ids=ids, labels=labels, use_cache=False)
    prog = autoshard.compile_rank(model, {"tp": 4}, 0, (), kwargs,
                                  options=autoshard.CompileOptions(recompute="selective"))
    plan = prog.gm.meta[M.RECOMPUTE_PLAN]
    assert len(plan.regions) == model.config.num_hidden_layers and not plan.skipped, plan
    ref = copy.deepcopy(model)
    want = ref(**kwargs).loss
    want.backward()
    for rank, (out, grads, _) in enumerate(simulate(model, 4, (), kwargs, loss_fn=lambda o: o.loss,
                                                    recompute="selective")):
        assert rel(out.loss.detach(), want.detach()) <= 1e-5
        for n, p in ref.named_parameters():
            assert rel(grads[n], p.grad, 1e-3) <= 1e-5, (rank, n)


def test_selective_recompute_finds_a_bmm_attention():
    torch.manual_seed(0)
    model = BmmAttention()
    args = (torch.randint(0, 48, (2, 8)), torch.randint(0, 48, (2, 8)))
    for t in (1, 2):
        prog = autoshard.compile_rank(model, {"tp": t}, 0, args, {},
                                      options=autoshard.CompileOptions(recompute="selective"))
        assert len(prog.gm.meta[M.RECOMPUTE_PLAN].regions) == 1, t
    assert_same(model, args, 2, recompute="selective")


class ScalarScan(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).sum().cumsum(0).sum() + self.lin(x).amax(dim=-1).sum()


def test_a_scan_of_a_scalar_stays_replicated():
    """A dim-taking op on a 0-d tensor has no dim to keep sharded: replicated, not a crash."""
    torch.manual_seed(0)
    assert_same(ScalarScan(), (torch.randn(4, 8),), 2)
