"""Hand-written Megatron tensor parallelism: a nanoGPT assembled from Megatron-Core's own TP layers.

Megatron-Core's ``GPTModel`` needs CUDA (TransformerEngine or its fused kernels), so the GPT is built from
the tensor-parallel building blocks, exactly as Megatron's GPT uses them (Shoeybi et al. 2019):

- token embedding: ``VocabParallelEmbedding`` (rows split by vocab, all-reduce forward);
- attention: one fused QKV ``ColumnParallelLinear`` (gather_output=False; its input-gradient all-reduce
  runs backward) + plain ``F.scaled_dot_product_attention`` over the local heads + ``RowParallelLinear``
  (input_is_parallel=True; all-reduce forward, bias added after it);
- MLP: ``ColumnParallelLinear`` -> GELU(tanh) -> ``RowParallelLinear``;
- LM head: ``ColumnParallelLinear`` (bias-free) fed the embedding weight when tied
  (``skip_weight_param_allocation``, as Megatron does with ``shared_embedding_or_output_weight``);
- loss: ``vocab_parallel_cross_entropy`` on the vocab-sharded logits, then the mean.

Position embedding and LayerNorms are plain torch modules, replicated, as in Megatron.

Weights are copied from the single-device autoshard GPT and sliced per rank here. The fused ``c_attn``
weight (3h x h, rows q|k|v) becomes, on rank r, ``[q_r; k_r; v_r]`` where ``q_r`` are the rows of this
rank's heads: the local QKV output splits into q, k, v of h/tp each. (Megatron's own checkpoint layout
interleaves q/k/v per head group; any per-rank order gives the same math, this one keeps slicing simple.)

Activations are batch-first ``[b, s, h]`` like the autoshard GPT (Megatron's own models use ``[s, b, h]``;
without sequence parallelism the layers do not care, and this keeps the attention code identical).
Requires ``vocab_size % tp == 0`` (Megatron pads the vocabulary instead, which would change the loss).
"""
from __future__ import annotations

import os
import warnings

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # silences Megatron's async-allreduce advice
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed. Falling back ..."
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                               vocab_parallel_cross_entropy)

import torch
import torch.nn as nn
import torch.nn.functional as F


def _init(_w):  # weights are copied from the reference model; Megatron's init is switched off
    return None


class MegatronAttention(nn.Module):
    def __init__(self, cfg, mcfg, tp):
        super().__init__()
        self.h_local = cfg.n_embd // tp
        self.hs = cfg.n_embd // cfg.n_head
        self.qkv = ColumnParallelLinear(cfg.n_embd, 3 * cfg.n_embd, config=mcfg, init_method=_init, bias=cfg.bias,
                                        gather_output=False)
        self.proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, config=mcfg, init_method=_init, bias=cfg.bias,
                                      input_is_parallel=True, skip_bias_add=False)

    def forward(self, x):
        B, T, _ = x.shape
        y, _ = self.qkv(x)
        q, k, v = (t.view(B, T, -1, self.hs).transpose(1, 2) for t in y.split(self.h_local, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, self.h_local)
        out, _ = self.proj(y)
        return out


class MegatronMLP(nn.Module):
    def __init__(self, cfg, mcfg):
        super().__init__()
        self.fc = ColumnParallelLinear(cfg.n_embd, 4 * cfg.n_embd, config=mcfg, init_method=_init, bias=cfg.bias,
                                       gather_output=False)
        self.proj = RowParallelLinear(4 * cfg.n_embd, cfg.n_embd, config=mcfg, init_method=_init, bias=cfg.bias,
                                      input_is_parallel=True, skip_bias_add=False)

    def forward(self, x):
        y, _ = self.fc(x)
        out, _ = self.proj(F.gelu(y, approximate="tanh"))
        return out


class MegatronBlock(nn.Module):
    def __init__(self, cfg, mcfg, tp):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = MegatronAttention(cfg, mcfg, tp)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MegatronMLP(cfg, mcfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MegatronGPT(nn.Module):
    def __init__(self, cfg, tp):
        super().__init__()
        if cfg.vocab_size % tp:
            raise ValueError(f"vocab_size={cfg.vocab_size} is not divisible by tp={tp}")
        if cfg.dropout:
            raise ValueError("the benchmark's Megatron GPT has no dropout (parity needs dropout=0)")
        mcfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                   perform_initialization=False, params_dtype=torch.float32,
                                   sequence_parallel=False, gradient_accumulation_fusion=False)
        self.cfg = cfg
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, init_method=_init, config=mcfg)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList([MegatronBlock(cfg, mcfg, tp) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = ColumnParallelLinear(cfg.n_embd, cfg.vocab_size, config=mcfg, init_method=_init, bias=False,
                                            gather_output=False, skip_weight_param_allocation=cfg.tie_weights)

    def forward(self, idx, targets):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits, _ = self.lm_head(x, weight=self.wte.weight if self.cfg.tie_weights else None)
        loss = vocab_parallel_cross_entropy(logits, targets).mean()
        return None, loss


def _rows(w, r, tp):
    n = w.shape[0] // tp
    return w[r * n:(r + 1) * n]


def _cols(w, r, tp):
    n = w.shape[1] // tp
    return w[:, r * n:(r + 1) * n]


@torch.no_grad()
def load_from_gpt(mg: MegatronGPT, sd: dict, r: int, tp: int):
    """Copy this rank's slices of the single-device GPT's state dict ``sd`` into ``mg``."""
    cfg = mg.cfg
    h = cfg.n_embd

    def put(dst, src):
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"shape mismatch copying weights: {tuple(src.shape)} -> {tuple(dst.shape)}")
        dst.copy_(src)

    put(mg.wte.weight, _rows(sd["transformer.wte.weight"], r, tp))
    put(mg.wpe.weight, sd["transformer.wpe.weight"])
    for i, blk in enumerate(mg.h):
        p = f"transformer.h.{i}"
        for ln in ("ln_1", "ln_2"):
            put(getattr(blk, ln).weight, sd[f"{p}.{ln}.weight"])
            if cfg.bias:
                put(getattr(blk, ln).bias, sd[f"{p}.{ln}.bias"])
        if f"{p}.attn.c_attn.weight" in sd:
            qkv_w = sd[f"{p}.attn.c_attn.weight"].split(h, dim=0)
            qkv_b = sd[f"{p}.attn.c_attn.bias"].split(h, dim=0) if cfg.bias else None
        else:
            qkv_w = [sd[f"{p}.attn.{n}_proj.weight"] for n in "qkv"]
            qkv_b = [sd[f"{p}.attn.{n}_proj.bias"] for n in "qkv"] if cfg.bias else None
        put(blk.attn.qkv.weight, torch.cat([_rows(w, r, tp) for w in qkv_w]))
        put(blk.attn.proj.weight, _cols(sd[f"{p}.attn.c_proj.weight"], r, tp))
        put(blk.mlp.fc.weight, _rows(sd[f"{p}.mlp.c_fc.weight"], r, tp))
        put(blk.mlp.proj.weight, _cols(sd[f"{p}.mlp.c_proj.weight"], r, tp))
        if cfg.bias:
            put(blk.attn.qkv.bias, torch.cat([_rows(b, r, tp) for b in qkv_b]))
            put(blk.attn.proj.bias, sd[f"{p}.attn.c_proj.bias"])
            put(blk.mlp.fc.bias, _rows(sd[f"{p}.mlp.c_fc.bias"], r, tp))
            put(blk.mlp.proj.bias, sd[f"{p}.mlp.c_proj.bias"])
    put(mg.ln_f.weight, sd["transformer.ln_f.weight"])
    if cfg.bias:
        put(mg.ln_f.bias, sd["transformer.ln_f.bias"])
    if not cfg.tie_weights:
        put(mg.lm_head.weight, _rows(sd["lm_head.weight"], r, tp))


def build_megatron_gpt(model, tp: int, device) -> MegatronGPT:
    """Megatron's model-parallel state (TP=tp, PP=1) on the default process group, and this rank's GPT."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    r = parallel_state.get_tensor_model_parallel_rank()
    mg = MegatronGPT(model.config, tp)
    load_from_gpt(mg, {k: v.detach().cpu() for k, v in model.state_dict().items()}, r, tp)
    return mg.to(device)
