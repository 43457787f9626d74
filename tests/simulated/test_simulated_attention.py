"""Tier 1 for attention layouts: heads stay sharded through each way models build their attention.

torchtitan's complex rotary, a fused k|v under multi-query, and torch's own ``nn.MultiheadAttention``
(packed q|k|v, batch and heads merged in one dim): exact against eager in the simulator, and planned
in Megatron's layout (no all-gather of q, k or v).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.ir.placement import Shard
from tests.harness.simulate import assert_same


class ComplexRopeLlama(nn.Module):
    """torchtitan's Llama 3 attention in miniature: q, k rotated as complex numbers (``view_as_complex``
    times a complex ``freqs_cis`` buffer, ``view_as_real``, ``flatten``), grouped-query heads, SwiGLU."""

    def __init__(self, dim=32, heads=4, kv_heads=2, vocab=48, seq=8):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.emb = nn.Embedding(vocab, dim)
        self.wq = nn.Linear(dim, heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, 64, bias=False), nn.Linear(dim, 64, bias=False)
        self.w2 = nn.Linear(64, dim, bias=False)
        self.out = nn.Linear(dim, vocab, bias=False)
        freqs = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        angles = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def rotate(self, x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * self.freqs_cis[None, :, None, :]).flatten(3).type_as(x)

    def forward(self, tokens, targets):
        b, s = tokens.shape
        h = self.emb(tokens)
        q = self.rotate(self.wq(h).view(b, s, self.heads, self.hd))
        k = self.rotate(self.wk(h).view(b, s, self.kv_heads, self.hd))
        v = self.wv(h).view(b, s, self.kv_heads, self.hd)
        rep = self.heads // self.kv_heads
        k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
        a = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        h = h + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        h = h + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return F.cross_entropy(self.out(h).flatten(0, 1), targets.flatten())


def test_complex_rotary_keeps_the_heads_sharded():
    """view_as_complex / view_as_real keep every dim but the (real, imaginary) pair: the heads stay
    sharded through torchtitan's complex rotation (no all-gather of q and k), and the step is exact."""
    torch.manual_seed(0)
    model = ComplexRopeLlama()
    args = (torch.randint(0, 48, (2, 8)), torch.randint(0, 48, (2, 8)))
    assert_same(model, args, 2)
    assert_same(model, args, 4)         # 2 kv heads at tp=4: repeated whole, then cut with the query heads
    prog = autoshard.compile_rank(model, {"tp": 2}, 0, args)
    assert not prog.report.unruled, prog.report.unruled          # nothing replicated for want of a rule
    pl = {r.name: r.spec.tp for r in prog.params}
    assert pl["wq.weight"] == pl["wk.weight"] == pl["w1.weight"] == Shard(0) and pl["wo.weight"] == Shard(1), pl
    assert not [c for c in prog.collectives if c.kind == "all_gather"], prog.collectives


class FusedKVMultiQuery(nn.Module):
    """Multi-query attention whose one k|v projection makes both (``kv = Linear(d, 2 * hd)``)."""

    def __init__(self, dim=32, heads=4, vocab=48):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.emb, self.q = nn.Embedding(vocab, dim), nn.Linear(dim, dim, bias=False)
        self.kv, self.o = nn.Linear(dim, 2 * self.hd, bias=False), nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, targets):
        b, s = tokens.shape
        h = self.emb(tokens)
        q = self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = (t.view(b, 1, s, self.hd).expand(b, self.heads, s, self.hd) for t in self.kv(h).split(self.hd, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return F.cross_entropy(self.out(h).flatten(0, 1), targets.flatten())


def test_a_fused_kv_projection_counts_each_kv_head_once():
    """One weight behind both k and v holds every kv head twice: multi-query with a fused k|v has 1 kv
    head, so k|v is replicated (Megatron's kv replication), not cut into k on rank 0 and v on rank 1
    and gathered back (exact either way, but 3 all-gathers a layer)."""
    torch.manual_seed(0)
    model = FusedKVMultiQuery()
    args = (torch.randint(0, 48, (2, 8)), torch.randint(0, 48, (2, 8)))
    assert_same(model, args, 2)
    prog = autoshard.compile_rank(model, {"tp": 2}, 0, args)
    assert "1 kv heads" in prog.report.attention[0], prog.report.attention
    pl = {r.name: r.spec.tp for r in prog.params}
    assert pl["q.weight"] == Shard(0) and pl["o.weight"] == Shard(1) and pl["kv.weight"] != Shard(0), pl
    assert not [c for c in prog.collectives if c.kind == "all_gather"], prog.collectives


class TorchLayersLM(nn.Module):
    """A causal LM from torch's own ``nn.TransformerEncoderLayer``: ``nn.MultiheadAttention`` packs q|k|v
    in one ``in_proj_weight``, unpacks it with ``unflatten(-1, (3, E))`` and merges batch and heads into
    one dim (``view(T, B * heads, head_dim)``) for its bmm-free sdpa."""

    def __init__(self, vocab=48, dim=32, heads=4, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, targets):
        h = self.emb(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return F.cross_entropy(self.out(h).flatten(0, 1), targets.flatten())


def test_torch_multihead_attention_is_cut_by_heads():
    """The packed q|k|v is cut per block and the batch*heads dim holds each batch element's block of
    heads (``Shard(0, blocks=B)``): Megatron's layout, no all-gather, and exact at tp 2 and 4."""
    torch.manual_seed(0)
    model = TorchLayersLM()
    args = (torch.randint(0, 48, (2, 8)), torch.randint(0, 48, (2, 8)))
    assert_same(model, args, 2)
    assert_same(model, args, 4)
    big = (torch.randint(0, 48, (4, 64)), torch.randint(0, 48, (4, 64)))
    prog = autoshard.compile_rank(model, {"tp": 2}, 0, big)   # (the causal mask's triu runs replicated)
    pl = {r.name: r.spec.tp for r in prog.params}
    assert pl["layers.0.self_attn.in_proj_weight"] == Shard(0, blocks=3), pl
    assert pl["layers.0.self_attn.out_proj.weight"] == Shard(1) and pl["layers.0.linear1.weight"] == Shard(0), pl
    assert not [c for c in prog.collectives if c.kind == "all_gather"], prog.collectives
