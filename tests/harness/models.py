"""Small models and batches shared by the tests (every rank builds the same weights from the seed)."""
from __future__ import annotations

import torch

from autoshard.models import GPT, GPTConfig


def build(kind: str, **cfg):
    """``("gpt", fused_qkv=..., tie_weights=..., vocab_size=...)`` or ``("hf", vocab_size=...)``."""
    torch.manual_seed(0)
    if kind == "gpt":
        base = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=96)
        return GPT(GPTConfig(**(base | cfg)))
    from transformers import GPT2Config, GPT2LMHeadModel
    base = dict(vocab_size=101, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    attn = cfg.pop("attn", "sdpa")
    hf = GPT2Config(**(base | cfg))
    hf._attn_implementation = attn
    return GPT2LMHeadModel(hf)


def batch(kind, vocab, B=2, T=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (B, T), generator=g)
    tgt = torch.randint(0, vocab, (B, T), generator=g)
    if kind == "gpt":
        return (idx, tgt), {}
    return (), {"input_ids": idx, "labels": tgt}


def loss_and_logits(kind, out):
    return (out[1], out[0]) if kind == "gpt" else (out.loss, out.logits)
