"""A transformer's sizes, as the planner prices it: layers, widths, heads, vocabulary and sequence.

``model_shape`` reads them from what a user has: the built-in GPT (its config or a model built from it,
on ``meta`` or not), an HF config (a ``PretrainedConfig``, a dict, or a ``config.json`` path) or an HF
model. Nothing is allocated: a 1T-parameter model is planned from its config alone.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger("autoshard")


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int                  # the MLP's inner width (an MoE's: one expert's)
    vocab: int
    seq: int
    gated: bool = False       # SwiGLU / GeGLU: three MLP matrices instead of two
    tied: bool = True         # the LM head reuses the embedding
    positions: int = 0        # rows of a learned position table (0: rotary or none)
    attention_head_dim: int = 0   # a head's width where the config sets it apart from hidden / heads (Gemma)
    experts: int = 1          # MoE: experts a layer holds (1: a dense MLP)
    experts_per_token: int = 1    # MoE: experts each token runs through (top-k)
    shared_ffn: int = 0       # MoE: the inner width of the experts every token runs through (Qwen2-MoE's)

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def active_ffn(self) -> int:
        """The MLP width a token runs through: its top-k experts' and the shared ones (the dense MLP's)."""
        return self.experts_per_token * self.ffn + self.shared_ffn if self.experts > 1 else self.ffn

    def layer_params(self) -> int:
        """Weights of one transformer layer (biases and norms are a rounding error, and counted as 4h); an
        MoE layer holds every expert, and its router."""
        h = self.hidden
        attention = h * (self.q_width + 2 * self.kv_width) + self.q_width * h
        width = self.experts * self.ffn + self.shared_ffn if self.experts > 1 else self.ffn
        mlp = (3 if self.gated else 2) * h * width + (h * self.experts if self.experts > 1 else 0)
        return attention + mlp + 4 * h

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.positions * self.hidden

    def params(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        return self.layers * self.layer_params() + self.embedding_params() + head

    def layer_forward_flops(self, tokens: float) -> float:
        """Forward flops of one layer over ``tokens`` tokens of one sequence length (the GEMMs: the
        projections, the attention scores and values, the MLP), as Megatron-LM's paper counts them."""
        h, s = self.hidden, self.seq
        projections = 2 * tokens * (h * (self.q_width + 2 * self.kv_width) + self.q_width * h)
        attention = 2 * 2 * tokens * s * self.q_width
        mlp = 2 * tokens * (3 if self.gated else 2) * h * self.active_ffn
        router = 2 * tokens * h * self.experts if self.experts > 1 else 0
        return projections + attention + mlp + router

    def head_forward_flops(self, tokens: float) -> float:
        return 2 * tokens * self.hidden * self.vocab

    def model_flops(self, tokens: float) -> float:
        """Flops of one training step over ``tokens`` tokens without recompute: forward and backward (3x
        forward), every layer and the LM head: the numerator of model TFLOP/s (MFU)."""
        return 3 * (self.layers * self.layer_forward_flops(tokens) + self.head_forward_flops(tokens))


def model_shape(model, seq: int | None = None, name: str | None = None) -> ModelShape:
    """The ``ModelShape`` of ``model``: a ``ModelShape``, the built-in ``GPTConfig`` or GPT, an HF config
    (object, dict or ``config.json`` path) or HF model. ``seq`` defaults to the model's context length."""
    if isinstance(model, ModelShape):
        return model if seq is None else _with_seq(model, seq)
    if isinstance(model, str) and model in BUILTIN:
        return model_shape(BUILTIN[model], seq)
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isfile(model):
            raise ValueError(f"model {str(model)!r} is neither a built-in ({', '.join(BUILTIN)}) nor a config.json "
                             "file: pass one of those, an HF config or model, a GPTConfig or a ModelShape")
        with open(model) as f:
            return model_shape(json.load(f), seq, name or os.path.basename(os.path.dirname(os.path.abspath(model))))
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
    shape = _from_hf(fields, seq, name)
    # the user's model, else the config built on meta once: its first layer is read, its parameters checked
    whole = model if isinstance(model, torch.nn.Module) else _built(fields)
    layer = _decoder_layer(whole) if whole is not None else _first_layer(fields)
    shape = _with_layer_structure(shape, layer)
    _check_parameters(shape, whole, layer)
    return shape


# how far the parameters a ModelShape prices may stray from the model's own before the reading is refused:
# the families that plan are within 2% at their default sizes; a tiny test model's norms and biases,
# which the shape leaves out, are a larger share (Persimmon at hidden 64: 1.3%)
PARAMETER_TOLERANCE = 0.10


def _check_parameters(shape: ModelShape, model, layer) -> None:
    """Raise where ``shape`` prices a model whose parameters it does not describe: a part the config
    names in no field the planner reads (a per-layer embedding, an extra tower, a width in a nested
    config) would otherwise be left out of every memory figure without a word. ``model`` is the user's,
    or one built on ``meta`` from the config; None (transformers cannot build it) leaves the shape
    unchecked, and says so. ``layer``: ``model``'s first decoder layer (None: not found). The message
    names where they differ: each decoder layer, or the ends."""
    if model is None:
        log.warning("autoshard: %s: transformers cannot build this config, so the planner cannot check the %s "
                    "parameters it reads off it against the model's own; pass a ModelShape(...) if they are off",
                    shape.name, f"{shape.params():,}")
        return
    real = sum(p.numel() for p in model.parameters())
    if not real or abs(shape.params() / real - 1) <= PARAMETER_TOLERANCE:
        return
    where = ""
    if layer is not None:
        held = sum(p.numel() for p in layer.parameters())
        if abs(shape.layer_params() / held - 1) > PARAMETER_TOLERANCE:
            where = (f"each decoder layer holds {held:,} ({type(layer).__name__}), the shape prices "
                     f"{shape.layer_params():,}: a field the planner does not read changes its layers")
        else:
            stack = {id(p) for m in model.modules() if type(m) is type(layer) for p in m.parameters()}
            outside = sorted(((p.numel(), n) for n, p in model.named_parameters() if id(p) not in stack),
                             reverse=True)[:3]
            where = ("its layers match, its ends do not; the largest parameters outside the decoder layers: "
                     + ", ".join(f"{n} ({k:,})" for k, n in outside))
    raise ValueError(f"{shape.name}: the planner reads {shape.params():,} parameters off its config ({shape}), but "
                     f"the model has {real:,} ({shape.params() / real - 1:+.0%}){'; ' + where if where else ''}. "
                     "The planner prices a uniform decoder stack: pass a ModelShape(...) that describes this model")


def _built(fields: dict):
    """The model ``fields`` describes, built on ``meta`` (nothing allocated; the caller's RNG left where it
    was), or None where transformers cannot build it."""
    model_type = fields.get("model_type")
    if not model_type:
        return None
    try:
        from transformers import AutoModelForCausalLM, CONFIG_MAPPING
        config = CONFIG_MAPPING[model_type](**{k: v for k, v in fields.items() if k != "model_type"})
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - nothing to compare with
        return None


# what a decoder layer's parameter names say of its MLP: a gate projection (SwiGLU / GeGLU: three matrices),
# and an MLP every token runs through beside an MoE layer's routed experts
_GATES = ("gate_proj", "gate_up_proj", "w1", "w3", "gate_up")
_SHARED = ("shared_expert", "shared_mlp", "shared_experts", "shared_experts_mlp")


def _with_layer_structure(shape: ModelShape, layer) -> ModelShape:
    """``shape`` with its MLP read off the model's first decoder layer (the model's own, or one built on
    ``meta`` from a one-layer copy of its config: nothing allocated): whether it is gated (a ``gate_proj``,
    whatever the activation is called: Gemma's ``gelu_pytorch_tanh`` GeGLU, BitNet's ``relu2``), and the
    width of a shared expert the config names in no field ``_from_hf`` knows (Llama 4's, Hunyuan's, Ernie
    4.5's). Layouts where the first layer is not every layer's (dense layers before MoE ones, MoE every
    other layer) are refused by ``_uniform`` first. Unchanged where there is no layer to read."""
    if layer is None:
        return shape
    names = [n for n, _ in layer.named_parameters()]
    mlp = [n for n in names if not n.startswith(("self_attn", "attention", "attn", "self_attention"))]
    gated = any(part in _GATES for n in mlp for part in n.split(".")) or shape.gated
    shared = shape.shared_ffn
    if shape.experts > 1 and not shared:
        widths = [p.shape[0] for n, p in layer.named_parameters()
                  if any(s in n.split(".") for s in _SHARED) and n.endswith(("up_proj.weight", "gate_proj.weight",
                                                                               "w1.weight", "fc1.weight"))]
        shared = int(widths[0]) if widths else 0
    return dataclasses.replace(shape, gated=gated, shared_ffn=shared)


def _first_layer(fields: dict):
    """The first decoder layer of the model ``fields`` describes, built on ``meta`` with one layer (None
    where transformers is missing, has no such model, or cannot build it that small)."""
    layers = fields.get("num_hidden_layers")
    # per-layer lists (layer_types, no_rope_layers, moe_layers) must match the one layer: the config's
    # own defaults take their place
    one = {k: v for k, v in fields.items() if k not in ("layer_types", "moe_layers", "mlp_only_layers")
           and not (isinstance(v, (list, tuple)) and layers and len(v) == layers)}
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if key in one:
            one[key] = 1
    model = _built(one)
    return None if model is None else _decoder_layer(model)


def _decoder_layer(model):
    """The first of ``model``'s decoder layers: the first module of a class HF names in
    ``_no_split_modules`` (its decoder layer), else the first element of a ``ModuleList`` called
    ``layers``, ``h`` or ``blocks``; None if neither is found."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            return module
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and name.split(".")[-1] in ("layers", "h", "blocks"):
            return module[0]
    return None


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


def _uniform(fields: dict) -> None:
    """Raise where the config's layers are not alike or its attention is not the planner's: multi-head
    latent attention (DeepSeek-V2/V3's low-rank q/kv), or dense and MoE layers mixed (DeepSeek's first
    dense layers, Qwen2-MoE's ``mlp_only_layers`` or sparse step, Jamba's expert period). Priced as
    uniform layers those came out 27% over their parameters (a small DeepSeek-V3) or 60% under."""
    why = []
    if fields.get("kv_lora_rank") or fields.get("q_lora_rank"):
        why.append("its attention is multi-head latent attention (kv_lora_rank / q_lora_rank)")
    mixed = [k for k, dense in (("first_k_dense_replace", 0), ("mlp_only_layers", None), ("decoder_sparse_step", 1),
                                ("expert_layer_period", 1), ("moe_layer_freq", 1), ("moe_layer_start_index", 0),
                                ("moe_layer_interval", 1), ("interleave_moe_layer_step", 1))
             if fields.get(k) not in (None, dense, [], ())]
    layers, end = fields.get("num_hidden_layers"), fields.get("moe_layer_end_index")
    if isinstance(end, int) and end >= 0 and isinstance(layers, int) and end < layers - 1:
        mixed.append("moe_layer_end_index")
    if mixed:
        why.append(f"its layers mix dense and MoE MLPs ({', '.join(mixed)})")
    mixers = sorted({str(t) for key in ("layer_types", "block_types", "layers_block_type")
                     for t in (fields.get(key) or ()) if not _softmax_attention(str(t))})
    if mixers or any(k.startswith(("mamba_", "ssm_", "linear_conv", "conv_L")) for k in fields):
        why.append("its layers include mixers other than softmax attention ("
                   + (", ".join(mixers) or "state-space") + ")")
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


def _softmax_attention(layer_type: str) -> bool:
    """Whether a config's layer type is softmax attention (full, sliding, chunked, local or global)."""
    t = layer_type.lower()
    return "linear" not in t and ("attention" in t or t in ("attention", "full", "global", "local", "sliding"))


def _from_hf(fields: dict, seq, name) -> ModelShape:
    _uniform(fields)
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
    return ModelShape(name or fields.get("_name_or_path") or model_type or "hf",
                      int(_first(fields, "num_hidden_layers", "n_layer")), hidden, heads, kv, ffn,
                      int(_first(fields, "vocab_size")), int(seq or context), gated=gated,
                      tied=bool(fields.get("tie_word_embeddings", True)), positions=context if learned else 0,
                      attention_head_dim=head_dim if head_dim and head_dim != hidden // heads else 0,
                      experts=experts, experts_per_token=min(experts, int(fields.get("num_experts_per_tok") or 1))
                      if experts > 1 else 1,
                      shared_ffn=shared if experts > 1 else 0)


def _with_seq(shape: ModelShape, seq: int) -> ModelShape:
    import dataclasses
    return dataclasses.replace(shape, seq=seq)


def _gpt(name, layers, hidden, heads, vocab=51200, seq=2048) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, heads, 4 * hidden, vocab, seq, positions=seq)


# The GPT models of Megatron-LM's SC'21 paper (Narayanan et al., Table 1: vocabulary 51,200, sequence 2048)
BUILTIN = {s.name: s for s in (
    _gpt("gpt-1.7b", 24, 2304, 24), _gpt("gpt-3.6b", 30, 3072, 32), _gpt("gpt-7.5b", 36, 4096, 32),
    _gpt("gpt-18b", 40, 6144, 48), _gpt("gpt-39b", 48, 8192, 64), _gpt("gpt-76b", 60, 10240, 80),
    _gpt("gpt-145b", 80, 12288, 96), _gpt("gpt-310b", 96, 16384, 128), _gpt("gpt-530b", 105, 20480, 128),
    _gpt("gpt-1t", 128, 25600, 160),
    # and the two of Korthikanti et al. (arXiv 2205.05198) that SC'21 has not: 22B, and GPT-3's 175B
    _gpt("gpt-22b", 48, 6144, 64), _gpt("gpt-175b", 96, 12288, 96))}
