"""A transformer's sizes, as the planner prices it: layers, widths, heads, vocabulary and sequence
(``ModelShape``), its kinds of layer and how even pipeline cuts mix them, and the built-in GPTs of
Megatron-LM's paper (``BUILTIN``). ``config_reading.model_shape`` reads one off what a user has.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
from dataclasses import dataclass

from autoshard.planner.blocks import Gemm, Mixer


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
    # multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, MiniCPM3): q, and k and v together, each
    # through a low-rank down projection (replicated over tp, as Megatron's MLA keeps it), then up by head
    # (column-parallel). ``head_dim`` is then a q/k head's width (its rotary part included)
    kv_lora_rank: int = 0     # > 0: the attention is MLA
    q_lora_rank: int = 0      # MLA: q's down projection (0: q projected from the stream directly)
    rope_head_dim: int = 0    # MLA: the rotary part of a q/k head (k's, one for all heads, rides the down projection)
    v_head_dim: int = 0       # MLA: a value head's width (0: head_dim)
    attention_extra_width: int = 0   # a projection of the stream beside q, k and v (Qwen3-Next's output gate)
    # MoE models whose layers are not all alike: these layers' MLP is dense, ``dense_ffn`` wide (DeepSeek's
    # first k layers, Qwen2-MoE's mlp_only_layers, Llama 4's every other layer); the fields above describe
    # the others. Read off the model's layers (``model_shape``)
    dense_layers: tuple = ()
    dense_ffn: int = 0
    # hybrids (Jamba, Bamba, Falcon-H1, Nemotron-H, Qwen3-Next, LFM2, RecurrentGemma): a token mixer other
    # than softmax attention (``blocks.Mixer``) on ``mixer_layers`` (all, where empty); softmax attention on
    # every layer but ``attention_free_layers`` (none at all where ``attention`` is False); an MLP on every
    # layer but ``mlp_free_layers`` (each Nemotron-H block is one of the three). Read off the model's layers
    mixer: Mixer | None = None
    mixer_layers: tuple = ()
    attention_free_layers: tuple = ()
    mlp_free_layers: tuple = ()
    attention: bool = True
    # a layer that runs both softmax attention and the mixer runs them side by side on one residual branch
    # (Falcon-H1, Hymba): their row-parallel outputs add before the branch's one all-reduce
    parallel_mixer: bool = False

    def _check_sizes(self):
        # layers may be 0 while a hybrid's shape is read (its layer kinds fill them in); plan() needs one
        for name in ("layers", "hidden", "heads", "kv_heads", "vocab", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < (name != "layers"):
                raise ValueError(f"ModelShape {self.name!r}: {name}={value!r}; give a positive whole number")
        if self.ffn < 0 or self.positions < 0:
            raise ValueError(f"ModelShape {self.name!r}: ffn={self.ffn}, positions={self.positions}; give 0 or more")

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden // self.heads

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """The width of k and of v (their mean under MLA, whose k and v heads differ and are one per head)."""
        if self.kv_lora_rank:
            return self.heads * (self.head_dim + self.value_head_dim) // 2
        return self.kv_heads * self.head_dim

    def attention_gemms(self) -> tuple:
        """The attention's weight matrices, as tensor parallelism splits them: one fused q/k/v projection
        (column-parallel) and the output's (row-parallel); under MLA the two down projections
        (replicated), the up projections (column-parallel) and the output's."""
        return self._attention_gemms

    @functools.cached_property
    def _attention_gemms(self) -> tuple:     # the planner asks for them for every candidate it prices
        h = self.hidden
        if not self.kv_lora_rank:
            return (Gemm(h, self.q_width + 2 * self.kv_width + self.attention_extra_width, "outer"),
                    Gemm(self.q_width, h, "inner"))
        q = ((Gemm(h, self.q_lora_rank, ""), Gemm(self.q_lora_rank, self.q_width, "outer")) if self.q_lora_rank
             else (Gemm(h, self.q_width, "outer"),))
        nope = self.head_dim - self.rope_head_dim
        return q + (Gemm(h, self.kv_lora_rank + self.rope_head_dim, ""),
                    Gemm(self.kv_lora_rank, self.heads * (nope + self.value_head_dim), "outer"),
                    Gemm(self.heads * self.value_head_dim, h, "inner"))

    def token_mixer_gemms(self) -> tuple:
        """The weight matrices that mix tokens in one layer of this (uniform) shape: softmax attention's,
        and the other mixer's where it runs one."""
        return ((self.attention_gemms() if self.attention else ())
                + (self.mixer.gemms if self.mixer is not None else ()))

    @property
    def blocks(self) -> int:
        """Residual blocks a layer of this (uniform) shape runs, each ending in a row-parallel matmul whose
        output tp sums: attention, the other mixer and the MLP, those it has (2: GPT's); attention and the
        mixer one block where they run side by side (``parallel_mixer``)."""
        mixers = int(self.attention) + int(self.mixer is not None)
        return (min(mixers, 1) if self.parallel_mixer else mixers) + int(self.active_ffn > 0)

    @property
    def core_head_dim(self) -> float:
        """A head's width in the attention core, the mean of Q K^T's (q/k) and P V's (v)."""
        return (self.head_dim + self.value_head_dim) / 2

    @property
    def active_ffn(self) -> int:
        """The MLP width a token runs through: its top-k experts' and the shared ones (the dense MLP's)."""
        return self.experts_per_token * self.ffn + self.shared_ffn if self.experts > 1 else self.ffn

    def layer_params(self) -> int:
        """Weights of one transformer layer (biases and norms are a rounding error, and counted as 4h; MLA's
        two low-rank norms too); an MoE layer holds every expert, and its router. Of a model with dense
        layers among MoE ones (``dense_layers``), an MoE layer's."""
        return self._layer_params

    @functools.cached_property
    def _layer_params(self) -> int:
        h = self.hidden
        attention = sum(g.inner * g.outer for g in self.token_mixer_gemms())
        attention += (self.q_lora_rank + self.kv_lora_rank if self.attention else 0) + (
            self.mixer.other_params if self.mixer is not None else 0)
        mlp = self._mlp_matrices() + (h * self.experts if self.experts > 1 else 0)
        return attention + mlp + 4 * h

    def layer_rank_params(self, t: int) -> float:
        """Weights of one layer that one of ``t`` tensor-parallel ranks holds: the matrices tp splits, a
        t-th; those it replicates (MLA's down projections, a router), whole, and the vectors too (norms,
        biases, a mixer's convolution taps and decays: a little over what the runtime holds, which splits
        some of them by channel)."""
        return self._layer_rank_params(t)

    @functools.lru_cache(maxsize=64)
    def _layer_rank_params(self, t: int) -> float:
        split = sum(g.inner * g.outer for g in self.token_mixer_gemms() if g.split)
        replicated = self.layer_params() - split - self._mlp_matrices()
        return (split + self._mlp_matrices()) / t + replicated

    def _mlp_matrices(self) -> int:
        width = self.experts * self.ffn + self.shared_ffn if self.experts > 1 else self.ffn
        return (3 if self.gated else 2) * self.hidden * width

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.positions * self.hidden

    def params(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        layers = sum(len(idx) * kind.layer_params() for kind, idx in self.layer_kinds())
        return layers + self.embedding_params() + head

    def layer_forward_flops(self, tokens: float) -> float:
        """Forward flops of one layer over ``tokens`` tokens of one sequence length (the GEMMs: the
        projections, the attention scores and values, the MLP), as Megatron-LM's paper counts them. Of a
        model with dense layers among MoE ones, an MoE layer's."""
        s = self.seq
        projections = 2 * tokens * sum(g.inner * g.outer for g in self.token_mixer_gemms())
        attention = 2 * 2 * tokens * s * self.heads * self.core_head_dim if self.attention else 0
        mlp = 2 * tokens * (3 if self.gated else 2) * self.hidden * self.active_ffn
        router = 2 * tokens * self.hidden * self.experts if self.experts > 1 else 0
        return projections + attention + mlp + router

    def layer_kinds(self) -> tuple:
        """``(shape, layer indices)`` per kind of layer: every layer, or the MoE layers and the dense ones
        (each kind a uniform ``ModelShape``, which the cost model prices one layer of)."""
        return _layer_kinds(self) if self.layout else ((self, range(self.layers)),)

    @property
    def layout(self) -> bool:
        """Whether its layers are of more than one kind."""
        return bool(self.dense_layers or self.mixer_layers or self.attention_free_layers or self.mlp_free_layers)

    def layer_kind(self, i: int) -> "ModelShape":
        """The kind (a uniform shape) of layer ``i``."""
        if not 0 <= i < self.layers:
            raise IndexError(f"layer {i} of a {self.layers}-layer model")
        return next(kind for kind, idx in self.layer_kinds() if i in idx)

    def __post_init__(self):
        self._check_sizes()
        # the layouts as sorted tuples (the shape is hashed: the cost model caches per shape), in range
        for name in ("dense_layers", "mixer_layers", "attention_free_layers", "mlp_free_layers"):
            given = tuple(sorted(set(getattr(self, name))))
            if any(not 0 <= i < self.layers for i in given):
                raise ValueError(f"ModelShape({name}={given}): layer indices run 0 to {self.layers - 1}")
            object.__setattr__(self, name, given)
        if self.dense_layers and not self.dense_ffn:
            raise ValueError("ModelShape(dense_layers=...) needs dense_ffn, their MLP's width")
        if self.mixer_layers and self.mixer is None:
            raise ValueError("ModelShape(mixer_layers=...) needs mixer=blocks.Mixer(...), what those layers run")

    def stage_mixes(self, p: int) -> tuple:
        """The layers of each kind (``layer_kinds``' order) pipeline stages hold when ``p`` stages cut the
        stack evenly (ceil(layers / p) a stage, the last ones the rest): the distinct mixes, largest
        first. One mix, ``(ceil(layers / p),)``, where the layers are all alike."""
        return _stage_mixes(self, p) if self.layout else ((-(-self.layers // p),),)

    def head_forward_flops(self, tokens: float) -> float:
        return 2 * tokens * self.hidden * self.vocab

    def model_flops(self, tokens: float) -> float:
        """Flops of one training step over ``tokens`` tokens without recompute: forward and backward (3x
        forward), every layer and the LM head: the numerator of model TFLOP/s (MFU)."""
        layers = sum(len(idx) * kind.layer_forward_flops(tokens) for kind, idx in self.layer_kinds())
        return 3 * (layers + self.head_forward_flops(tokens))


@functools.lru_cache(maxsize=256)
def _layer_kinds(shape: ModelShape) -> tuple:
    """Layers grouped by (softmax attention, the other mixer, the MLP: the shape's own, dense, none)."""
    dense, no_mlp = set(shape.dense_layers), set(shape.mlp_free_layers)
    mixer, no_attention = set(shape.mixer_layers), set(shape.attention_free_layers)
    groups = {}
    for i in range(shape.layers):
        key = (shape.attention and i not in no_attention,
               shape.mixer is not None and (not mixer or i in mixer),
               "none" if i in no_mlp else "dense" if i in dense else "own")
        groups.setdefault(key, []).append(i)
    uniform = dataclasses.replace(shape, dense_layers=(), dense_ffn=0, mixer_layers=(), attention_free_layers=(),
                                  mlp_free_layers=())
    out = []
    for (attention, runs_mixer, mlp), idx in groups.items():
        kind = dataclasses.replace(uniform, attention=attention, mixer=shape.mixer if runs_mixer else None)
        if mlp != "own":
            kind = dataclasses.replace(kind, experts=1, experts_per_token=1, shared_ffn=0,
                                       ffn=shape.dense_ffn if mlp == "dense" else 0)
        out.append((kind, tuple(idx)))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _stage_mixes(shape: ModelShape, p: int) -> tuple:
    kinds = shape.layer_kinds()
    per = -(-shape.layers // p)
    mixes = set()
    for r in range(p):
        span = range(r * per, min(shape.layers, (r + 1) * per))
        if len(span):
            mixes.add(tuple(sum(1 for i in idx if i in span) for _, idx in kinds))
    return tuple(sorted(mixes, key=sum, reverse=True))


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
