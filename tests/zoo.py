"""A wider zoo of causal LMs from ``transformers``, beyond ``tests/families.py`` and
``tests/test_more_families.py``: recent dense models (GLM, Helium, EXAONE 4, ERNIE 4.5, Seed-OSS,
Hunyuan, Apertus, SmolLM3, OLMo 3), older ones (GPT-Neo's local attention, CodeGen, MPT's ALiBi, XGLM,
BioGPT, Persimmon, Nemotron), sliding windows, and MoE (Qwen3-MoE, OLMoE, GPT-OSS, PhiMoE, GraniteMoE).
Each is built tiny, with every dropout and router jitter at 0 so that a parallel run can be exact.
A family this ``transformers`` lacks is skipped, not failed."""
from __future__ import annotations

import torch

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)

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
}


def build_zoo(name: str):
    """A tiny random model of zoo family ``name`` with dropouts and router jitter at 0, or None when this
    ``transformers`` has no such config class."""
    import transformers as T
    cls_name, kwargs, attn = ZOO[name]
    cls = getattr(T, cls_name, None)
    if cls is None:
        return None
    config = cls(**kwargs)
    for key, value in config.to_dict().items():
        if ("dropout" in key or "jitter" in key or key.endswith("_pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
