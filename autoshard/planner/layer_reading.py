"""What a model's decoder layers say that its config's fields may not: read off the model (the user's,
or the config built on ``meta``: nothing allocated) for ``model_shape``.

- the MLP: whether it is gated (a ``gate_proj``, whatever the activation is called), and the width of a
  shared expert no field names (Llama 4's, Hunyuan's, Ernie 4.5's);
- a kv-head count the config names and the model ignores (Persimmon's attention is multi-head);
- which layers of an MoE model run a dense MLP, and how wide (DeepSeek's first k, Qwen2-MoE's
  ``mlp_only_layers``, Llama 4's interleave step), whichever field placed them;
- for hybrids (Jamba, Bamba, Falcon-H1, Nemotron-H, Qwen3-Next, LFM2, RecurrentGemma): which layers run
  softmax attention, which another token mixer (``blocks.Mixer``, read off the first one), and which an
  MLP at all (each Nemotron-H block is one of the three).

A layer's parts are its direct children: softmax attention is a module whose class names attention
but not linear, delta-rule or lightning attention; an MLP is one named or classed as an MLP, feed-forward
or MoE block, or holding experts (and a bare ``Linear``, OPT's ``fc1``); norms hold vectors only;
anything else holding matrices is the mixer.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from autoshard.planner.blocks import Gemm, Mixer

log = logging.getLogger("autoshard")

# what a decoder layer's parameter names say of its MLP: a gate projection (SwiGLU / GeGLU: three matrices),
# and an MLP every token runs through beside an MoE layer's routed experts
GATES = ("gate_proj", "gate_up_proj", "w1", "w3", "gate_up")
SHARED = ("shared_expert", "shared_mlp", "shared_experts", "shared_experts_mlp")
_MLP_NAMES = ("mlp", "feed_forward", "mlp_block", "ffn", "block_sparse_moe", "moe")
_MLP_CLASSES = ("MLP", "Mlp", "FeedForward", "MoE", "Moe", "Expert")
_NOT_SOFTMAX = ("Linear", "Delta", "Lightning")
# what a mixer's class says it is (before the MLP's names: Qwen3.5-MoE's is a "Qwen3_5MoeGatedDeltaNet")
_MIXER_CLASSES = ("Mamba", "Mixer", "DeltaNet", "Delta", "Conv", "Recurrent", "Rglru", "LRU", "Ssm", "SSM",
                  "Lightning", "Rwkv", "LSTM")


def built(fields: dict):
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


def first_layer(fields: dict):
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
    model = built(one)
    layers = decoder_layers(model) if model is not None else []
    return layers[0] if layers else None


def decoder_layers(model) -> list:
    """``model``'s decoder layers in order: the elements of a ``ModuleList`` (``layers``, ``h`` or
    ``blocks``) of the classes HF names in ``_no_split_modules`` (a hybrid's layers are of two classes:
    Jamba's attention and Mamba layers), else the modules of the first such class the model holds, else
    the elements of a ``ModuleList`` so named; empty if none is found."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    named = [m for n, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) and n.split(".")[-1] in ("layers", "h", "blocks")]
    for stack in named:
        if blocks and all(type(layer).__name__ in blocks for layer in stack):
            return list(stack)
    found = [module for module in model.modules() if type(module).__name__ in blocks]
    if found:
        return [module for module in found if type(module) is type(found[0])]
    return list(named[0]) if named else []


def has_experts(module) -> bool:
    """Whether a module holds a mixture of experts: parameters under an ``experts``."""
    return any("experts" in name.split(".") for name, _ in module.named_parameters())


@dataclass
class LayerParts:
    """One decoder layer's direct children by role."""
    attention: list
    mixer: list
    mlp: list

    @property
    def moe(self) -> bool:
        return any(has_experts(m) for m in self.mlp)


def parts(layer, hybrid: bool = True, prefix: str = "") -> LayerParts:
    """``layer``'s children by role (the module docstring's rules), read off their class names less the
    model's ``prefix`` (``RecurrentGemmaMlp`` is an MLP, ``Qwen3_5MoeGatedDeltaNet`` a mixer). A child
    none of them names is the mixer in a ``hybrid``, else part of the MLP."""
    out = LayerParts([], [], [])
    for name, child in layer.named_children():
        held = list(child.parameters())
        if not held or all(p.dim() < 2 for p in held):
            continue                                            # a norm (or nothing)
        cls = type(child).__name__
        cls = cls[len(prefix):] if prefix and cls.startswith(prefix) else cls
        # a learned decay is a recurrence's, whatever the class says (RWKV's "SelfAttention": time_decay)
        decays = any("decay" in n.split(".")[-1] for n, _ in child.named_parameters())
        if "Attention" in cls and not decays and not any(k in cls for k in _NOT_SOFTMAX):
            out.attention.append(child)
        elif has_experts(child):
            out.mlp.append(child)
        elif decays or any(k in cls for k in _MIXER_CLASSES):
            out.mixer.append(child)
        elif name in _MLP_NAMES or any(k in cls for k in _MLP_CLASSES) or isinstance(child, torch.nn.Linear):
            out.mlp.append(child)
        else:
            (out.mixer if hybrid else out.mlp).append(child)
    return out


def model_prefix(model) -> str:
    """The prefix HF gives every class of ``model``'s family: ``Jamba`` of ``JambaForCausalLM``."""
    name = type(model).__name__
    for tail in ("ForCausalLM", "LMHeadModel", "Model"):
        if tail in name:
            return name[:name.index(tail)]
    return ""


def with_layers(shape, layers: list, hybrid: bool, model=None):
    """``shape`` completed from the decoder ``layers`` of ``model`` (see the module docstring). ``hybrid``:
    the config says some layers mix tokens other than by softmax attention (else every layer is taken
    to run attention and an MLP, and only its MLP's structure is read)."""
    if not layers:
        return shape
    prefix = model_prefix(model) if model is not None else ""
    split = [parts(layer, hybrid, prefix) for layer in layers]
    if not hybrid and any(p.mixer for p in split):    # a mixer's class says so where the config does not
        hybrid = True                                   # (LFM2's default config lists no layer types)
        split = [parts(layer, hybrid, prefix) for layer in layers]
    if hybrid:
        _refuse_shared(layers, model)
    moe = [i for i, p in enumerate(split) if p.moe]
    with_mlp = [i for i, p in enumerate(split) if p.mlp]
    # the MLP's structure off an MoE layer where the model has one (DeepSeek's first layers are dense)
    mlp_layer = moe[0] if moe and shape.experts > 1 else (with_mlp[0] if with_mlp else 0)
    shape = _with_mlp_structure(shape, split[mlp_layer].mlp)
    with_attention = [i for i, p in enumerate(split) if p.attention]
    if with_attention:
        shape = _with_attention_heads(shape, split[with_attention[0]].attention)
    if len(layers) != shape.layers:
        if model is not None and (hybrid or moe):     # not a one-layer copy's (first_layer)
            log.warning("autoshard: %s: the config says %d decoder layers, the model holds %d; the planner prices "
                        "every layer as the first of its kind (pass a ModelShape(...) with the layout if that is off)",
                        shape.name, shape.layers, len(layers))
        return shape
    everywhere = set(range(len(layers)))
    changes = {}
    if shape.experts > 1 and moe:
        dense = tuple(i for i in with_mlp if i not in set(moe))
        if dense:
            changes.update(dense_layers=dense, dense_ffn=_dense_width(shape, split[dense[0]].mlp))
    if hybrid:
        if shape.experts == 1 and with_mlp:       # off the MLP itself: LFM2 rounds its width, RecurrentGemma halves it
            changes["ffn"] = _dense_width(shape, split[with_mlp[0]].mlp)
        mixer_layers = tuple(i for i, p in enumerate(split) if p.mixer)
        attention = tuple(i for i, p in enumerate(split) if p.attention)
        if mixer_layers:
            changes["mixer"] = _mixer(split[mixer_layers[0]].mixer, shape.hidden)
            changes["mixer_layers"] = () if set(mixer_layers) == everywhere else mixer_layers
            # a layer holding both runs them side by side (Falcon-H1's and Hymba's: no hybrid stacks the
            # two in one layer one after the other)
            changes["parallel_mixer"] = bool(set(mixer_layers) & set(attention))
        if not attention:
            changes["attention"] = False
        elif set(attention) != everywhere:
            changes["attention_free_layers"] = tuple(sorted(everywhere - set(attention)))
        if not with_mlp:                          # Mamba's blocks: a mixer and nothing else
            changes.update(ffn=0, experts=1, experts_per_token=1, shared_ffn=0)
        elif set(with_mlp) != everywhere:
            changes["mlp_free_layers"] = tuple(sorted(everywhere - set(with_mlp)))
    return dataclasses.replace(shape, **changes) if changes else shape


def _with_mlp_structure(shape, mlp: list):
    """Whether the MLP is gated (Gemma's GeGLU, BitNet's relu2 read alike), and an unnamed shared
    expert's width."""
    names = [n for m in mlp for n, _ in m.named_parameters()]
    gated = any(part in GATES for n in names for part in n.split(".")) or shape.gated
    shared = shape.shared_ffn
    if shape.experts > 1 and not shared:
        widths = [p.shape[0] for m in mlp for n, p in m.named_parameters()
                  if any(s in n.split(".") for s in SHARED) and n.endswith(("up_proj.weight", "gate_proj.weight",
                                                                              "w1.weight", "fc1.weight"))]
        shared = int(widths[0]) if widths else 0
    return dataclasses.replace(shape, gated=gated, shared_ffn=shared)


def _with_attention_heads(shape, attention: list):
    """``shape`` with a k/v head per q head where the config names kv heads its model does not use
    (Persimmon's attention is multi-head whatever ``num_key_value_heads`` says): the layer's attention
    matrices hold what multi-head attention would and not what the config's groups would; and with the
    width of a projection of the stream the attention holds beyond q, k and v (Qwen3-Next's output
    gate, as wide as q), where its matrices hold that many more columns of h."""
    if not attention or shape.kv_lora_rank:
        return shape
    held = sum(p.numel() for m in attention for p in m.parameters() if p.dim() == 2)

    def priced(s):
        return sum(g.inner * g.outer for g in s.attention_gemms())
    # a named k projection says the kv heads outright (an output gate as wide as q adds exactly what
    # multi-head k and v would where kv = heads / 2: Qwen3-Next's)
    k = [m.k_proj for m in attention if isinstance(getattr(m, "k_proj", None), torch.nn.Linear)]
    if k and k[0].out_features % shape.head_dim == 0:
        shape = dataclasses.replace(shape, kv_heads=k[0].out_features // shape.head_dim)
    elif shape.kv_heads != shape.heads:
        mha = dataclasses.replace(shape, kv_heads=shape.heads)
        if held != priced(shape) and held == priced(mha):
            return mha
    extra = held - priced(shape)
    if extra > 0 and extra % shape.hidden == 0:
        return dataclasses.replace(shape, attention_extra_width=extra // shape.hidden)
    return shape


def _dense_width(shape, mlp: list) -> int:
    weights = sum(p.numel() for m in mlp for p in m.parameters() if p.dim() == 2)
    return round(weights / ((3 if shape.gated else 2) * shape.hidden))


def _mixer(modules: list, hidden: int) -> Mixer:
    """The token mixer ``modules`` make, as ``blocks.Mixer``: each matrix a GEMM (the one back to the
    stream row-parallel, the rest column-parallel), the rest held; the widest projection of the stream
    its scan's width. A square matrix is the one back to the stream where its module says so by name
    (RWKV's ``output``: its four matrices are all h x h)."""
    gemms, other = [], 0
    for m in modules:
        for name, p in m.named_parameters():
            if p.dim() == 2:
                out, inner = p.shape
                back = out == hidden and (inner != hidden or name.split(".")[-2:-1] in (["output"], ["out_proj"],
                                                                                      ["o_proj"]))
                gemms.append(Gemm(int(inner), int(out), "inner" if back else "outer"))
            else:
                other += p.numel()
    widths = [g.outer for g in gemms if g.inner == hidden] or [g.outer for g in gemms] or [hidden]
    return Mixer(type(modules[0]).__name__, tuple(gemms), other, max(widths))


def _refuse_shared(layers: list, model) -> None:
    """A parameter two layers hold (Zamba's one transformer block, run at several depths) is one set of
    weights priced once per layer, and a layer that nests other decoder layers (Zamba2's hybrid layer: a
    Mamba layer and that shared block) is not one kind of layer: raise instead."""
    kinds = {type(layer).__name__ for layer in layers} | {
        name for name in getattr(model, "_no_split_modules", None) or () if name.endswith(("Layer", "Block"))}
    for i, layer in enumerate(layers):
        nested = sorted({type(m).__name__ for m in layer.modules() if m is not layer and type(m).__name__ in kinds})
        if nested:
            raise ValueError(f"decoder layer {i} ({type(layer).__name__}) runs other decoder layers ({', '.join(nested)}), "
                             "as Zamba's hybrid layers run a shared transformer block: the planner prices one mixer and "
                             "one MLP a layer; pass a ModelShape(...) of a representative layer instead")
    seen = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            j = seen.setdefault(id(p), i)
            if j != i:
                raise ValueError(f"layers {j} and {i} share the parameter {name} (a block run at several depths, "
                                 "as Zamba's shared transformer): the planner prices each layer's own weights; pass a "
                                 "ModelShape(...) of a representative layer instead")
