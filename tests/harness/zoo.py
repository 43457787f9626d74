"""A wider zoo of causal LMs from ``transformers``, beyond ``tests/harness/families.py`` and
``tests/models/test_more_families.py``: recent dense models (GLM, Helium, EXAONE 4, ERNIE 4.5, Seed-OSS,
Hunyuan, Apertus, SmolLM3, OLMo 3), older ones (GPT-Neo's local attention, CodeGen, MPT's ALiBi, XGLM,
BioGPT, Persimmon, Nemotron), sliding windows, MoE (Qwen3-MoE, OLMoE, GPT-OSS, PhiMoE, GraniteMoE), and
the 2025-26 wave: Llama 4, Gemma 4, multi-head latent attention, shared-expert MoE, and hybrids whose
mixers are Mamba or short convolutions.
Each is built tiny, with every dropout and router jitter at 0 so that a parallel run can be exact.
A family this ``transformers`` lacks is skipped, not failed."""
from __future__ import annotations

import torch

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)

GEMMA4 = dict(COMMON, head_dim=16, sliding_window=4, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
              layer_types=["sliding_attention", "full_attention"])

# Gated-DeltaNet linear attention beside full attention (Qwen3.5, Qwen3-Next)
LINEAR_ATTENTION = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=4,
                        layer_types=["linear_attention", "full_attention"])
SHARED_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)

# name -> (config class name, its keywords, attention implementation)
ZOO = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32), "sdpa"),
    "olmoe": ("OlmoeConfig", dict(COMMON, num_experts=4, num_experts_per_tok=2), "sdpa"),
    "gpt_oss": ("GptOssConfig", dict(COMMON, head_dim=16, **MOE, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"]), "eager"),
    "phimoe": ("PhimoeConfig", dict(COMMON, **MOE), "sdpa"),
    "granitemoe": ("GraniteMoeConfig", dict(COMMON, **MOE), "sdpa"),
    "smollm3": ("SmolLM3Config", dict(COMMON, pad_token_id=0), "sdpa"),
    "glm": ("GlmConfig", dict(COMMON, head_dim=16, pad_token_id=0), "sdpa"),
    "glm4": ("Glm4Config", dict(COMMON, head_dim=16, pad_token_id=0), "sdpa"),
    "helium": ("HeliumConfig", dict(COMMON, head_dim=16), "sdpa"),
    "exaone4": ("Exaone4Config", dict(COMMON), "sdpa"),
    "ernie4_5": ("Ernie4_5Config", dict(COMMON, head_dim=16), "sdpa"),
    "arcee": ("ArceeConfig", dict(COMMON), "sdpa"),
    "seed_oss": ("SeedOssConfig", dict(COMMON, head_dim=16), "sdpa"),
    "hunyuan_dense": ("HunYuanDenseV1Config", dict(COMMON, head_dim=16), "sdpa"),
    "apertus": ("ApertusConfig", dict(COMMON), "sdpa"),
    "olmo3": ("Olmo3Config", dict(COMMON, sliding_window=4), "sdpa"),
    "nemotron": ("NemotronConfig", dict(COMMON), "sdpa"),
    "persimmon": ("PersimmonConfig", dict(COMMON), "sdpa"),
    "mistral_sliding": ("MistralConfig", dict(COMMON, sliding_window=4), "sdpa"),
    "qwen2_sliding": ("Qwen2Config", dict(COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1),
                      "sdpa"),
    "gemma3_sliding": ("Gemma3TextConfig", dict(COMMON, head_dim=16, sliding_window=4), "sdpa"),
    "llama_biases": ("LlamaConfig", dict(COMMON, attention_bias=True, mlp_bias=True), "sdpa"),
    "gpt_neo": ("GPTNeoConfig", dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, window_size=4,
                                     attention_types=[[["global", "local"], 1]], max_position_embeddings=64),
                "eager"),
    "codegen": ("CodeGenConfig", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, rotary_dim=8),
                "sdpa"),
    "mpt": ("MptConfig", dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=64), "eager"),
    "xglm": ("XGLMConfig", dict(vocab_size=128, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128,
                                max_position_embeddings=64), "eager"),
    "biogpt": ("BioGptConfig", dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, max_position_embeddings=64), "sdpa"),
    # 2025-26 families (a sweep of transformers 5.24): Llama 4, Gemma 4, MLA (MiniCPM3, DeepSeek V3.2),
    # shared-expert MoE, and hybrids with Mamba / short-conv layers (Jamba, Bamba, Falcon-H1, Nemotron-H,
    # Zamba2, LFM2).
    "llama4_text": ("Llama4TextConfig", dict(COMMON, head_dim=16, intermediate_size_mlp=128, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=4,
        no_rope_layer_interval=2), "sdpa"),
    # Gemma 4's default: full-attention layers take a wider head (global_head_dim) than the sliding ones
    "gemma4_text": ("Gemma4TextConfig", dict(GEMMA4), "sdpa"),
    "gemma4_text_uniform": ("Gemma4TextConfig", dict(GEMMA4, per_layer_config={}), "sdpa"),
    "cohere2": ("Cohere2Config", dict(COMMON, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"]), "sdpa"),
    "ministral": ("MinistralConfig", dict(COMMON, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"]), "sdpa"),
    "ministral3": ("Ministral3Config", dict(COMMON, head_dim=16), "sdpa"),
    "internlm3": ("InternLM3Config", dict(COMMON), "sdpa"),
    "minicpm3": ("MiniCPM3Config", dict(COMMON, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4), "sdpa"),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(COMMON, head_dim=16, moe_intermediate_size=32, moe_k=2,
        moe_num_experts=4, moe_num_shared_experts=1, moe_layer_start_index=0,
        moe_layer_end_index=1), "sdpa"),
    "glm4_moe": ("Glm4MoeConfig", dict(COMMON, head_dim=16, moe_intermediate_size=32, num_experts_per_tok=2,
        n_shared_experts=1, n_routed_experts=4, first_k_dense_replace=1), "sdpa"),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(COMMON, head_dim=16, num_experts=4, moe_topk=2), "sdpa"),
    "dots1": ("Dots1Config", dict(COMMON, head_dim=16, moe_intermediate_size=32, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1), "sdpa"),
    "exaone": ("ExaoneConfig", dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), "sdpa"),
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(COMMON, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=32), "sdpa"),
    "bitnet": ("BitNetConfig", dict(COMMON), "sdpa"),
    "diffllama": ("DiffLlamaConfig", dict(COMMON), "sdpa"),
    "vaultgemma": ("VaultGemmaConfig", dict(COMMON, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"]), "eager"),
    "deepseek_v32": ("DeepseekV32Config", dict(COMMON, moe_intermediate_size=32, n_shared_experts=1,
        n_routed_experts=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, n_group=1, topk_group=1, num_experts_per_tok=2, index_topk=4,
        index_head_dim=16, index_n_heads=2, num_key_value_heads=4, first_k_dense_replace=1), "sdpa"),
    "minimax_m2": ("MiniMaxM2Config", dict(COMMON, head_dim=16, num_experts_per_tok=2, num_local_experts=4,
        intermediate_size=32), "sdpa"),
    "nanochat": ("NanoChatConfig", dict(COMMON), "sdpa"),
    "flex_olmo": ("FlexOlmoConfig", dict(COMMON, num_experts=4, num_experts_per_tok=2, pad_token_id=0), "sdpa"),
    "lfm2": ("Lfm2Config", dict(COMMON, block_multiple_of=16, layer_types=["conv", "full_attention"]), "sdpa"),
    "jamba": ("JambaConfig", dict(COMMON, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
        expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
        mamba_dt_rank=8, use_mamba_kernels=False), "sdpa"),
    "bamba": ("BambaConfig", dict(COMMON, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
        mamba_d_state=8, mamba_chunk_size=8), "sdpa"),
    "falcon_h1": ("FalconH1Config", dict(COMMON, head_dim=16, mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128,
        mamba_d_state=8, mamba_chunk_size=8), "sdpa"),
    "nemotron_h": ("NemotronHConfig", dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, layers_block_type=["mamba", "attention", "moe", "mlp"],
        ssm_state_size=8, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, chunk_size=8,
        n_routed_experts=4, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
        num_experts_per_tok=2, max_position_embeddings=64), "sdpa"),
    "zamba2": ("Zamba2Config", dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, mamba_d_state=8,
        n_mamba_heads=4, mamba_headdim=32, chunk_size=8, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=4, attention_head_dim=32, max_position_embeddings=64,
        layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1]), "sdpa"),
    # Scans that write into views (``out[:, t] = ...``): made pure at capture (passes/functionalize.py)
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(COMMON, head_dim=16, **LINEAR_ATTENTION), "sdpa"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(COMMON, head_dim=16, **LINEAR_ATTENTION, **SHARED_MOE), "sdpa"),
    "qwen3_next": ("Qwen3NextConfig", dict(COMMON, head_dim=16, **LINEAR_ATTENTION, **SHARED_MOE), "sdpa"),
    "recurrent_gemma": ("RecurrentGemmaConfig", dict(vocab_size=128, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, lru_width=64,
        attention_window_size=4, block_types=["recurrent", "attention"]), "sdpa"),
    # a sweep of transformers 5.24's causal LMs no test had covered: linear attention with MLA (Kimi
    # Linear), lightning attention (MiniMax), pure state-space and recurrent models (Mamba-2,
    # Falcon-Mamba, xLSTM), more hybrids (Granite 4, OLMo hybrid) and MoE (Cohere 2 MoE, AFMoE), and
    # RWKV, whose scan writes into views (functionalized at capture); its eval mode divides its weights in
    # place (``rescale_every``), which capture refuses (tests/unit/test_errors.py), so it is off here
    "kimi_linear": ("KimiLinearConfig", dict(COMMON, pad_token_id=0, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16), "sdpa"),
    "minimax": ("MiniMaxConfig", dict(COMMON, head_dim=16, pad_token_id=0), "sdpa"),
    "mamba2": ("Mamba2Config", dict(COMMON, head_dim=16, pad_token_id=0, num_heads=8, expand=2, n_groups=1), "eager"),
    "falcon_mamba": ("FalconMambaConfig", dict(COMMON, head_dim=16, pad_token_id=0), "eager"),
    "xlstm": ("xLSTMConfig", dict(COMMON, head_dim=16, pad_token_id=0), "eager"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(COMMON, head_dim=16, pad_token_id=0), "sdpa"),
    "olmo_hybrid": ("OlmoHybridConfig", dict(COMMON, head_dim=16, pad_token_id=0), "sdpa"),
    "cohere2_moe": ("Cohere2MoeConfig", dict(COMMON, head_dim=16, pad_token_id=0), "sdpa"),
    "afmoe": ("AfmoeConfig", dict(COMMON, head_dim=16, pad_token_id=0), "sdpa"),
    "rwkv": ("RwkvConfig", dict(COMMON, head_dim=16, pad_token_id=0, rescale_every=0), "eager"),
}
# no softmax attention in any layer (Granite 4's and Kimi Linear's two tiny layers are both linear
# attention): selective recompute has nothing to run again, and says so
ATTENTION_FREE = ("mamba2", "falcon_mamba", "xlstm", "granitemoehybrid", "kimi_linear", "rwkv")


def build_zoo(name: str):
    """A tiny random model of zoo family ``name`` with dropouts and router jitter at 0, or None when this
    ``transformers`` has no such config class."""
    import transformers as T
    cls_name, kwargs, attn = ZOO[name]
    cls = getattr(T, cls_name, None)
    if cls is None:
        return None
    config = cls(**kwargs)
    for c in (config, getattr(config, "attn_config", None), getattr(config, "ffn_config", None)):
        if hasattr(c, "to_dict"):                            # DBRX-style nested configs hold dropouts too
            for key, value in c.to_dict().items():
                if ("dropout" in key or "jitter" in key or key.endswith("_pdrop")) and isinstance(value, float):
                    setattr(c, key, 0.0)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config, attn_implementation=attn)


# Families whose fp32 reference is itself further from an fp64 run than the parallel run is: their
# gradients are held to this bound (relative to the largest entry) instead of 1e-5. Measured worst
# parameter, fp32 single device against fp64: Gemma 4's wide global heads 5e-5 (tp=2 against fp64 1.6e-5);
# DiffLlama's lambda_q1 4.9e-5 (the difference of two softmaxes cancels most of each).
ROUNDING = {"gemma4_text": 1e-4, "diffllama": 1e-4}


def tolerance(name: str) -> float:
    """The gradient bound for family ``name`` (``ROUNDING``, else 1e-5)."""
    return ROUNDING.get(name, 1e-5)
