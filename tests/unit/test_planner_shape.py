"""How the planner reads a model's sizes (``autoshard/planner/config_reading.py``): the built-in GPT, HF configs as
objects, dicts, ``config.json`` files and ``meta`` models, checked against the parameters the model holds;
and the layouts it refuses, each with the reason."""
import dataclasses
import json
import logging

import pytest
import torch

from autoshard.models.gpt import GPT, GPTConfig
from autoshard.planner.config_reading import model_shape
from autoshard.planner.shape import BUILTIN


def test_shapes_from_the_builtin_gpt_on_meta_and_an_hf_config(tmp_path, caplog):
    cfg = GPTConfig(n_layer=3, n_embd=64, n_head=4, vocab_size=96, block_size=32)
    with torch.device("meta"):
        model = GPT(cfg)
    shape = model_shape(model)
    real = sum(p.numel() for p in model.parameters())
    assert (shape.layers, shape.hidden, shape.heads, shape.seq) == (3, 64, 4, 32)
    assert abs(shape.params() - real) / real < 0.02           # biases and norms are 4h a layer
    llama = {"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
             "intermediate_size": 1376, "num_hidden_layers": 4, "vocab_size": 1000, "hidden_act": "silu",
             "max_position_embeddings": 256, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama))
    s = model_shape(str(path), seq=128)
    assert (s.kv_heads, s.ffn, s.gated, s.tied, s.seq) == (2, 1376, True, False, 128)
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in llama.items() if k != "model_type"}))
    real = sum(p.numel() for p in hf.parameters())
    assert abs(model_shape(hf).params() - real) / real < 0.02
    assert model_shape("gpt-1t", seq=1024) == dataclasses.replace(BUILTIN["gpt-1t"], seq=1024)   # a built-in's name
    with pytest.raises(ValueError, match="'gpt-2t' is neither a built-in .*gpt-1t.* nor a config.json"):
        model_shape("gpt-2t")
    # layers the planner cannot price alike are an error that says why, not a shape off by a quarter
    # hybrids whose layers transformers cannot build to read (a layer_types list shorter than the stack)
    hybrid = dict(llama, model_type="qwen3_next", layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ValueError, match=r"mixers other than softmax attention \(linear_attention\), and transformers cannot"):
        model_shape(hybrid)
    with pytest.raises(ValueError, match=r"mixers other than softmax attention \(state-space\), and transformers cannot"):
        model_shape(dict(llama, model_type="no_such_ssm", mamba_d_state=16))
    # MoE on some layers only, where transformers cannot build the model to read which layers
    with pytest.raises(ValueError, match=r"mix dense and MoE MLPs \(first_k_dense_replace\), and transformers cannot"):
        model_shape(dict(llama, model_type="no_such_moe", num_local_experts=4, first_k_dense_replace=1))
    # an encoder-decoder's attribute_map names its encoder's sizes; a per-layer width is not one width
    with pytest.raises(ValueError, match="mbart is an encoder-decoder model"):
        model_shape(transformers.MBartConfig())
    with pytest.raises(ValueError, match="intermediate_size varies per layer"):
        model_shape(dict(llama, model_type="gemma3n_text", intermediate_size=[256, 512]))
    # Gemma 4's heterogeneous layers (transformers' per_layer_config) and per-layer embeddings
    with pytest.raises(ValueError, match=r"per_layer_config overrides layers \['01'\].* an embedding of its own \(hidden_size_per_layer_input"):
        model_shape(dict(llama, model_type="gemma4_text", per_layer_config={"01": {"head_dim": 128}},
                         hidden_size_per_layer_input=16, vocab_size_per_layer_input=1000))
    # whatever the config's fields miss, a model with parameters its shape does not price is refused,
    # naming the largest ones outside the decoder layers (here a tower added beside the stack)
    with torch.device("meta"):
        towered = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in llama.items() if k != "model_type"}))
        towered.model.tower = torch.nn.Linear(2048, 2048)
    with pytest.raises(ValueError, match=r"reads [\d,]+ parameters off its config .*, but the model has [\d,]+ \(-\d+%\).*model\.tower\.weight \(4,194,304\)"):
        model_shape(towered)
    # a layer past the first that holds more than its kind is named (here layer 1's MLP, four times as wide)
    with torch.device("meta"):
        widened = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in llama.items() if k != "model_type"}))
        mlp = widened.model.layers[1].mlp
        mlp.up_proj, mlp.gate_proj = (torch.nn.Linear(p.in_features, 4 * p.out_features, bias=False) for p in (mlp.up_proj, mlp.gate_proj))
        mlp.down_proj = torch.nn.Linear(4 * mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    with pytest.raises(ValueError, match=r"its decoder layer 1 holds [\d,]+ \(LlamaDecoderLayer\)"):
        model_shape(widened)
    # a nested ffn_config under names the planner does not read (DBRX's own are read: the test below);
    # CTRL's layer width in dff, which no field the planner reads names: refused by its layers' parameters
    with pytest.raises(ValueError, match="nested in ffn_config"):
        model_shape(dict(llama, model_type="dbrx", ffn_config={"n_experts": 4, "width": 128}))
    with pytest.raises(ValueError, match=r"its decoder layer 0 holds [\d,]+ \(EncoderLayer\), the shape prices"):
        model_shape(transformers.CTRLConfig(n_layer=2, n_embd=64, n_head=4, dff=512, vocab_size=100))
    # a config transformers cannot build is priced unchecked, and says so
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        model_shape(dict(llama, model_type="no_such_model"))
    assert "cannot check" in caplog.text
    # building the one-layer probe leaves the caller's RNG where it was
    torch.manual_seed(0)
    state = torch.get_rng_state()
    model_shape(transformers.DiffLlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=128, vocab_size=128))
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("form", ["object", "dict", "meta model"])
def test_dbrx_nested_configs_are_read(form):
    """DBRX keeps its experts, their width and activation in ``ffn_config`` and its kv heads in
    ``attn_config``: read through them, a DBRX of 132B's proportions prices the parameters its ``meta``
    model has (the check in ``model_shape`` compares them)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DbrxConfig(
        d_model=384, n_heads=6, n_layers=3, max_seq_len=512, vocab_size=1000,
        attn_config=dict(kv_n_heads=2, clip_qkv=8, rope_theta=500000),
        ffn_config=dict(ffn_hidden_size=672, moe_num_experts=16, moe_top_k=4, ffn_act_fn={"name": "silu"}))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    given = {"object": config, "dict": config.to_dict(), "meta model": model}[form]
    shape = model_shape(given)
    assert (shape.kv_heads, shape.ffn, shape.experts, shape.experts_per_token, shape.gated) == (2, 672, 16, 4, True)
    assert shape.params() == pytest.approx(sum(p.numel() for p in model.parameters()), rel=0.01)
    # one expert: a dense MLP of ffn_hidden_size
    dense = transformers.DbrxConfig(d_model=384, n_heads=6, n_layers=3, vocab_size=1000,
                                    attn_config=dict(kv_n_heads=2, rope_theta=10000),
                                    ffn_config=dict(ffn_hidden_size=672, moe_num_experts=1, moe_top_k=1))
    assert (model_shape(dense).experts, model_shape(dense).ffn) == (1, 672)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gemma", "falcon", "falcon_new", "qwen3", "gpt_neo", "mpt",
                                    "xglm", "llama4_text", "bitnet"])
def test_hf_shapes_count_the_parameters_the_model_has(family, tmp_path):
    """``model_shape`` of an HF config holds the parameters the model built from it holds (on ``meta``):
    an MoE layer every expert and its router (Mixtral), shared experts too (Qwen2-MoE); a head width set
    apart from hidden / heads (Gemma, Qwen3); Falcon's classic multi-query decoder one k/v head whatever
    ``num_kv_heads`` says, its new decoder the groups it names. A token's flops run through top-k experts."""
    import transformers as T
    small = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, vocab_size=512)
    cfg = {"mixtral": lambda: T.MixtralConfig(**small, intermediate_size=384, num_key_value_heads=2, num_local_experts=4,
                                              num_experts_per_tok=2),
           "qwen2_moe": lambda: T.Qwen2MoeConfig(**small, moe_intermediate_size=128, shared_expert_intermediate_size=320,
                                                 num_experts=6, num_experts_per_tok=2, num_key_value_heads=4),
           "gemma": lambda: T.GemmaConfig(**small, intermediate_size=512, head_dim=64, num_key_value_heads=1),
           "falcon": lambda: T.FalconConfig(**small, multi_query=True, num_kv_heads=8),
           "falcon_new": lambda: T.FalconConfig(**small, new_decoder_architecture=True, num_kv_heads=2),
           "qwen3": lambda: T.Qwen3Config(**small, intermediate_size=512, head_dim=48, num_key_value_heads=2),
           # their own names for heads, width and depth (HF's attribute_map), and a learned position table
           "gpt_neo": lambda: T.GPTNeoConfig(hidden_size=256, num_layers=2, num_heads=8, vocab_size=512,
                                             attention_types=[[["global", "local"], 1]]),
           "mpt": lambda: T.MptConfig(d_model=256, n_layers=2, n_heads=8, vocab_size=512, expansion_ratio=4),
           "xglm": lambda: T.XGLMConfig(d_model=256, num_layers=2, attention_heads=8, vocab_size=512, ffn_dim=1024),
           # a shared expert no field names (Llama 4), a gated MLP whatever its activation (BitNet's relu2):
           # read off the first layer, built on meta from a one-layer copy of the config
           "llama4_text": lambda: T.Llama4TextConfig(**small, intermediate_size=128, intermediate_size_mlp=256,
                                                     num_local_experts=4, num_experts_per_tok=1, num_key_value_heads=2,
                                                     head_dim=32),
           "bitnet": lambda: T.BitNetConfig(**small, intermediate_size=512, num_key_value_heads=2),
           }[family]()
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(cfg)
    real = sum(p.numel() for p in model.parameters())
    shape = model_shape(cfg, seq=128)
    assert abs(shape.params() - real) <= 0.01 * real, (shape, real)
    cfg.save_pretrained(tmp_path)            # config.json holds the family's own names only
    assert model_shape(str(tmp_path / "config.json"), seq=128).params() == shape.params()
    if family == "falcon":
        assert shape.kv_heads == 1
    if shape.experts > 1:      # forward flops of a token: its top-k experts (and the shared ones), not all E
        dense = dataclasses.replace(shape, experts=1, experts_per_token=1, shared_ffn=0,
                                    ffn=shape.experts_per_token * shape.ffn + shape.shared_ffn)
        router = 2 * 128 * shape.hidden * shape.experts
        assert shape.layer_forward_flops(128) == pytest.approx(dense.layer_forward_flops(128) + router)
