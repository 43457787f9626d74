"""Reading a ``ModelShape`` off what a user has (``model_shape``): the built-in GPT (its config or a model
built from it, on ``meta`` or not), an HF config (a ``PretrainedConfig``, a dict, or a ``config.json``
path) or an HF model. The config's fields give the widths (``_canonical`` maps each family's names
onto HF's common ones); the model's own layers, built on ``meta`` when only a config is given, give
what the fields may not (``layer_reading``); and the parameters it prices are checked against the
model's (``_check_parameters``). Nothing is allocated: a 1T-parameter model is planned from its config.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import logging
import os

import torch

from autoshard.planner import layer_reading
from autoshard.planner.shape import BUILTIN, ModelShape

log = logging.getLogger("autoshard")


def model_shape(model, seq: int | None = None, name: str | None = None) -> ModelShape:
    """The ``ModelShape`` of ``model``: a ``ModelShape``, the built-in ``GPTConfig`` or GPT, an HF config
    (object, dict or ``config.json`` path) or HF model. ``seq`` defaults to the model's context length; a
    learned position table (GPT-2's, OPT's) bounds it."""
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, numbers.Integral) or seq < 1):
        raise ValueError(f"seq={seq!r}: give the sequence length in tokens, a positive whole number")
    if model is None:
        raise TypeError("model=None: pass a ModelShape, a built-in name, a GPTConfig or GPT, an HF config, "
                        "a config.json path or an HF model")
    shape = _model_shape(model, None if seq is None else int(seq), name)
    if shape.positions and shape.seq > shape.positions:
        raise ValueError(f"seq={shape.seq} is longer than {shape.name}'s learned position table ({shape.positions} "
                         f"positions): the model cannot run it; pass seq={shape.positions} or less")
    return shape


def _model_shape(model, seq: int | None, name: str | None) -> ModelShape:
    if isinstance(model, ModelShape):
        return model if seq is None else dataclasses.replace(model, seq=seq)
    if isinstance(model, str) and model in BUILTIN:
        return _model_shape(BUILTIN[model], seq, name)
    if isinstance(model, str) and model == "gpt":          # the built-in GPT's default config, as the CLI's
        from autoshard.models.gpt import GPTConfig
        return _model_shape(GPTConfig(), seq, name)
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isfile(model):
            raise ValueError(f"model {str(model)!r} is neither a built-in ({', '.join(BUILTIN)}) nor a config.json "
                             "file: pass one of those, an HF config or model, a GPTConfig or a ModelShape")
        with open(model) as f:
            return _model_shape(json.load(f), seq, name or os.path.basename(os.path.dirname(os.path.abspath(model))))
    config = getattr(model, "config", model)
    from autoshard.models.gpt import GPTConfig
    if isinstance(config, GPTConfig):
        s = seq or config.block_size
        return ModelShape(name or "gpt", config.n_layer, config.n_embd, config.n_head, config.n_head,
                          4 * config.n_embd, config.vocab_size, s, gated=False, tied=config.tie_weights,
                          positions=config.block_size)
    fields = config if isinstance(config, dict) else (config.to_dict() if hasattr(config, "to_dict") else vars(config))
    if fields.get("is_encoder_decoder") or fields.get("decoder_layers"):
        # their attribute_map names the encoder's sizes: a decoder priced by them is off by its depth
        raise ValueError(f"{fields.get('model_type') or 'this config'} is an encoder-decoder model; the planner "
                         "prices decoder-only stacks: pass a ModelShape(...) of its decoder instead")
    fields = _canonical(fields, config)
    # the user's model, else the config built on meta once: its layers are read, its parameters checked
    whole = model if isinstance(model, torch.nn.Module) else layer_reading.built(fields)
    if whole is not None and hasattr(getattr(whole, "config", None), "to_dict"):
        # what the fields leave out, the model was built with: its config class's defaults
        fields = _canonical({**whole.config.to_dict(), **{k: v for k, v in fields.items() if v is not None}}, whole.config)
    layers = layer_reading.decoder_layers(whole) if whole is not None else []
    hybrid = _uniform(fields, layers_read=bool(layers))
    if (layers and not any(fields.get(k) for k in ("num_attention_heads", "n_head"))
            and not any(layer_reading.parts(layer).attention for layer in layers)):
        fields = dict(fields, num_attention_heads=1)     # a state-space model (Mamba): no attention to size
    if layers and not any(fields.get(k) for k in ("num_hidden_layers", "n_layer")):
        fields = dict(fields, num_hidden_layers=len(layers))     # Nemotron-H's count is its block pattern's
    text = fields.get("text_config")
    if isinstance(text, dict) and not any(fields.get(k) for k in ("hidden_size", "n_embd", "d_model")):
        # a multimodal config (Gemma 3, LLaVA, Qwen2-VL): its language model, which the planner prices; the
        # vision tower's few layers are left out
        return _model_shape(getattr(config, "text_config", None) or text, seq,
                            name or f"{fields.get('model_type') or 'multimodal'} (its text model)")
    shape = _from_hf(fields, seq, name)
    if not layers:      # transformers cannot build the whole model: a one-layer copy's structure, if it can
        one = layer_reading.first_layer(fields)
        layers = [one] if one is not None else []
    shape = layer_reading.with_layers(shape, layers, hybrid, whole)
    _check_parameters(shape, whole, layers)
    return shape


# how far the parameters a ModelShape prices may stray from the model's own before the reading is refused:
# the families that plan are within 2% at their default sizes; a tiny test model's norms and biases,
# which the shape leaves out, are a larger share (Persimmon at hidden 64: 1.3%)
PARAMETER_TOLERANCE = 0.10


def _check_parameters(shape: ModelShape, model, layers: list) -> None:
    """Raise where ``shape`` prices a model whose parameters it does not describe: a part the config
    names in no field the planner reads (a per-layer embedding, an extra tower, a width in a nested
    config) would otherwise be left out of every memory figure without a word. ``model`` is the user's,
    or one built on ``meta`` from the config; None (transformers cannot build it) leaves the shape
    unchecked, and says so. ``layers``: ``model``'s decoder layers (empty: not found). The message
    names where they differ: the first decoder layer the shape misprices, or the ends."""
    if model is None:
        log.warning("autoshard: %s: transformers cannot build this config, so the planner cannot check the %s "
                    "parameters it reads off it against the model's own; pass a ModelShape(...) if they are off",
                    shape.name, f"{shape.params():,}")
        return
    real = sum(p.numel() for p in model.parameters())
    if not real or abs(shape.params() / real - 1) <= PARAMETER_TOLERANCE:
        return
    where = ""
    if layers:
        # each layer against its own kind where the shape has one a layer, else against the first's
        read = len(layers) == shape.layers
        for i, layer in enumerate(layers):
            held = sum(p.numel() for p in layer.parameters())
            priced = shape.layer_kind(i if read else 0).layer_params()
            if abs(priced - held) > PARAMETER_TOLERANCE * held:
                where = (f"its decoder layer {i} holds {held:,} ({type(layer).__name__}), the shape prices "
                         f"{priced:,}: a field the planner does not read changes its layers")
                break
        else:
            stack = {id(p) for layer in layers for p in layer.parameters()}
            outside = sorted(((p.numel(), n) for n, p in model.named_parameters() if id(p) not in stack),
                             reverse=True)[:3]
            where = ("its layers match, its ends do not; the largest parameters outside the decoder layers: "
                     + ", ".join(f"{n} ({k:,})" for k, n in outside))
    raise ValueError(f"{shape.name}: the planner reads {shape.params():,} parameters off its config ({shape}), but "
                     f"the model has {real:,} ({shape.params() / real - 1:+.0%}){'; ' + where if where else ''}. "
                     "The planner prices each decoder layer as attention, a token mixer and an MLP of the widths it "
                     "reads: pass a ModelShape(...) that describes this model")


def _canonical(fields: dict, config) -> dict:
    """``fields`` with HF's canonical names (``num_attention_heads``, ``hidden_size``, ``num_hidden_layers``)
    added where the config stores them under its own (GPT-Neo's ``num_heads``, MPT's ``n_heads`` and
    ``d_model``, XGLM's ``attention_heads``): its class's ``attribute_map``, which a config object's
    ``to_dict()`` and its ``config.json`` leave out. A dict's class is found by its ``model_type``."""
    mapping = getattr(config, "attribute_map", None)
    if mapping is None and fields.get("model_type"):
        try:
            from transformers import CONFIG_MAPPING
            mapping = getattr(CONFIG_MAPPING[fields["model_type"]], "attribute_map", None)
        except (ImportError, KeyError):
            mapping = None
    out = dict(fields)
    for canonical, own in (mapping or {}).items():
        if out.get(canonical) is None and out.get(own) is not None:
            out[canonical] = out[own]
    if out.get("expansion_ratio") and out.get("hidden_size") and not out.get("intermediate_size"):
        out["intermediate_size"] = int(out["expansion_ratio"] * out["hidden_size"])   # MPT's MLP width
    return _nested(out)


# DBRX keeps its experts and their width in ``ffn_config`` and its kv heads in ``attn_config``: the flat
# names ``_from_hf`` reads, from the nested ones. An ``ffn_config`` without ``ffn_hidden_size`` (the width)
# is not read, and ``_uniform`` refuses it
_NESTED = {"ffn_config": {"moe_num_experts": "num_local_experts", "moe_top_k": "num_experts_per_tok",
                          "ffn_hidden_size": ("moe_intermediate_size", "intermediate_size")},
           "attn_config": {"kv_n_heads": "num_key_value_heads"}}
_NESTED_WIDTH = "ffn_hidden_size"


def _nested(fields: dict) -> dict:
    """``fields`` with DBRX's nested sizes (``_NESTED``) copied to the flat names, where they are not set."""
    out = dict(fields)
    for section, names in _NESTED.items():
        nested = out.get(section)
        if not isinstance(nested, dict) or (section == "ffn_config" and nested.get(_NESTED_WIDTH) is None):
            continue
        for own, flats in names.items():
            for flat in (flats,) if isinstance(flats, str) else flats:
                if nested.get(own) is not None and out.get(flat) is None:
                    out[flat] = nested[own]
        act = nested.get("ffn_act_fn")
        if isinstance(act, dict) and act.get("name") and not out.get("hidden_act"):
            out["hidden_act"] = act["name"]
    return out


def _first(fields: dict, *keys, default=None):
    for k in keys:
        if fields.get(k) is not None:
            if isinstance(fields[k], (list, tuple, dict)):
                raise ValueError(f"the config's {k} varies per layer ({fields[k]!r:.60}): the planner prices "
                                 "every layer alike; pass a ModelShape(...) of a representative layer instead")
            return fields[k]
    if default is None:
        raise ValueError(f"the config has none of {keys}: pass a ModelShape(...) instead")
    return default


def _uniform(fields: dict, layers_read: bool = False) -> bool:
    """Whether the config's layers mix tokens other than by softmax attention (Mamba, linear attention,
    short convolutions, RG-LRU: a hybrid, which ``layer_reading`` reads layer by layer). Raise where they
    are what a ``ModelShape`` cannot hold: per-layer overrides or embeddings, or hybrids and dense and MoE
    layers mixed (DeepSeek's first dense layers, Qwen2-MoE's ``mlp_only_layers`` or sparse step, Llama
    4's interleave step) where the model's layers could not be read (``layers_read``: transformers built
    it on meta), which is where ``model_shape`` finds which layer is which. Priced as uniform layers the
    mixes came out 27% over their parameters (a small DeepSeek-V3) or 60% under."""
    why = []
    mixed = [k for k, dense in (("first_k_dense_replace", 0), ("mlp_only_layers", None), ("decoder_sparse_step", 1),
                                ("expert_layer_period", 1), ("moe_layer_freq", 1), ("moe_layer_start_index", 0),
                                ("moe_layer_interval", 1), ("interleave_moe_layer_step", 1))
             if fields.get(k) not in (None, dense, [], ())]
    layers, end = fields.get("num_hidden_layers"), fields.get("moe_layer_end_index")
    if isinstance(end, int) and end >= 0 and isinstance(layers, int) and end < layers - 1:
        mixed.append("moe_layer_end_index")
    if mixed and not layers_read:
        why.append(f"its layers mix dense and MoE MLPs ({', '.join(mixed)}), and transformers cannot build the "
                   "model to read which")
    mixers = sorted({str(t) for key in ("layer_types", "block_types", "layers_block_type")
                     for t in (fields.get(key) or ()) if not _softmax_attention(str(t))})
    hybrid = bool(mixers) or any(k.startswith(("mamba_", "ssm_", "linear_conv", "conv_L")) for k in fields)
    if hybrid and not layers_read:
        why.append("its layers include mixers other than softmax attention ("
                   + (", ".join(mixers) or "state-space") + "), and transformers cannot build the model to read them")
    ffn = fields.get("ffn_config")
    if isinstance(ffn, dict) and ffn.get(_NESTED_WIDTH) is None:
        why.append(f"its MLP's sizes are nested in ffn_config ({sorted(ffn)!r:.80}) without the width it reads "
                   f"there ({_NESTED_WIDTH})")
    overrides = fields.get("per_layer_config")
    if overrides:
        why.append(f"its per_layer_config overrides layers {sorted(overrides)} ({next(iter(overrides.values()))!r:.60})")
    if fields.get("hidden_size_per_layer_input"):
        why.append("it feeds every layer an embedding of its own (hidden_size_per_layer_input, "
                   "vocab_size_per_layer_input), which a ModelShape does not hold")
    if why:
        raise ValueError(f"the planner prices every layer alike, but {' and '.join(why)}: pass a "
                         "ModelShape(...) of a representative layer instead")
    return hybrid


def _softmax_attention(layer_type: str) -> bool:
    """Whether a config's layer type is softmax attention (full, sliding, chunked, local or global)."""
    t = layer_type.lower()
    return "linear" not in t and ("attention" in t or t in ("attention", "full", "global", "local", "sliding"))


def _from_hf(fields: dict, seq, name) -> ModelShape:
    hidden = int(_first(fields, "hidden_size", "n_embd", "d_model"))
    heads = int(_first(fields, "num_attention_heads", "n_head"))
    # grouped-query (Llama's name, ChatGLM's, Falcon's new decoder's), or Falcon's classic multi-query
    kv = int(_first(fields, "num_key_value_heads", "multi_query_group_num", "num_kv_heads", "n_head_kv",
                    default=heads))
    if fields.get("multi_query") and not fields.get("new_decoder_architecture"):
        kv = 1               # Falcon's classic decoder: one k/v head whatever num_kv_heads says

    experts = int(_first(fields, "num_local_experts", "num_experts", "n_routed_experts", default=1) or 1)
    if fields.get("is_moe") is False:      # Doge: experts configured, MoE off
        experts = 1
    ffn = int(_first(fields, *(("moe_intermediate_size",) if experts > 1 else ()), "intermediate_size", "n_inner",
                     "ffn_dim", "ffn_hidden_size", default=4 * hidden) or 4 * hidden)
    shared = int(fields.get("shared_expert_intermediate_size") or fields.get("shared_intermediate_size") or 0) or \
        int(fields.get("n_shared_experts") or 0) * (ffn if experts > 1 else 0)
    activation = str(_first(fields, "hidden_act", "hidden_activation", "activation_function", default="gelu"))
    model_type = str(fields.get("model_type", ""))
    gated = activation in ("silu", "swiglu", "geglu") or model_type in (
        "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
        "phi3", "olmo", "olmo2")
    context = int(_first(fields, "max_position_embeddings", "n_positions", "seq_length", "max_seq_len",
                         default=2048))
    learned = model_type in ("gpt2", "opt", "gpt_bigcode", "gpt_neo", "biogpt")     # a position table of weights
    head_dim = int(fields.get("head_dim") or 0)
    mla = _mla(fields)
    if mla:             # its k and v have a head per q head; its config's head_dim is the rotary part's
        kv, head_dim = heads, mla["attention_head_dim"]
    return ModelShape(name or fields.get("_name_or_path") or model_type or "hf",
                      int(_first(fields, "num_hidden_layers", "n_layer")), hidden, heads, kv, ffn,
                      int(_first(fields, "vocab_size")), int(seq or context), gated=gated,
                      tied=bool(fields.get("tie_word_embeddings", True)), positions=context if learned else 0,
                      attention_head_dim=head_dim if head_dim and head_dim != hidden // heads else 0,
                      experts=experts, experts_per_token=min(experts, int(fields.get("num_experts_per_tok") or 1))
                      if experts > 1 else 1,
                      shared_ffn=shared if experts > 1 else 0,
                      **{k: v for k, v in mla.items() if k != "attention_head_dim"})


def _mla(fields: dict) -> dict:
    """Multi-head latent attention's sizes, as ``ModelShape`` fields, from DeepSeek-V2/V3's names (MiniCPM3
    and Kimi K2 use them too); empty where the attention is not MLA."""
    kv_rank = int(fields.get("kv_lora_rank") or 0)
    if not kv_rank:
        return {}
    rope = int(_first(fields, "qk_rope_head_dim"))
    nope = int(_first(fields, "qk_nope_head_dim"))
    return dict(kv_lora_rank=kv_rank, q_lora_rank=int(fields.get("q_lora_rank") or 0), rope_head_dim=rope,
                v_head_dim=int(_first(fields, "v_head_dim", default=nope)), attention_head_dim=nope + rope)
