"""Tiny random-weight HF causal LMs of every supported family, their batches, and a seeded config fuzzer.

    cfg = FamilyConfig("llama", heads=4, kv_heads=2, vocab=97)
    model = build(cfg)                              # torch.manual_seed(0), from_config, dropouts 0
    kwargs = batch(cfg.vocab, B=2, T=8, seed=1)     # input_ids, labels, attention_mask, use_cache=False
    cfg = draw(random.Random(seed))                 # a config transformers can build

Nothing is downloaded: every model comes from ``AutoModelForCausalLM.from_config``. ``run_tp`` is
``tests/harness/simulate.py:simulate`` with the capture shared by every rank and every tp size (export is the
slow part of a compile), and ``compare`` checks a tp run against the single-device model with the
conventions of ``tests/distributed/test_parity.py``.
"""
from __future__ import annotations

import copy
import dataclasses
import random
import re
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = ["gpt2", "opt", "gpt_neox", "gptj", "llama", "mistral", "qwen2", "gemma", "phi", "phi3", "falcon",
            "falcon_new", "bloom", "gpt_bigcode"]
# transformers 5.23 builds GPT-J and BLOOM with eager attention only (sdpa is a ValueError at build)
EAGER_ONLY = {"gptj", "bloom"}
GQA = {"llama", "mistral", "qwen2", "gemma", "phi", "phi3", "falcon_new"}     # any divisor of the heads
MQA_SWITCH = {"falcon", "gpt_bigcode"}                                 # multi_query: 1 kv head, or all
POSITIONS = 64


@dataclass(frozen=True)
class FamilyConfig:
    """One tiny model. ``None`` means the family's own default.

    kv_heads: GQA families take any divisor of ``heads``; falcon (classic) and gpt_bigcode take 1
    (multi-query) or ``heads``; the others have none. ``norm`` is the family's norm/residual layout:
    opt and bloom "pre"/"post"; gpt_neox and falcon "parallel"/"sequential"; phi "qk" (q/k layernorm);
    falcon_new "ln1"/"ln2" (one or two layernorms in front of the parallel block). ``mlp`` is the MLP's
    activation. ``extra`` holds other config keywords as ``(key, value)`` pairs (kept hashable).
    ``loss``: "hf" passes ``labels=`` and uses HF's loss; "outside" computes ``F.cross_entropy`` on the
    returned logits (ignore_index=-100).
    """
    family: str
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int | None = None
    vocab: int = 128
    tie_word_embeddings: bool | None = None
    bias: bool | None = None
    norm: str | None = None
    mlp: str | None = None
    extra: tuple = ()
    attn_implementation: str = "sdpa"
    dtype: str = "float32"
    loss: str = "hf"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def describe(self) -> str:
        kv = "" if self.kv_heads is None else f" kv={self.kv_heads}"
        opts = [f"{k}={v}" for k, v in (("tie", self.tie_word_embeddings), ("bias", self.bias),
                                          ("norm", self.norm), ("mlp", self.mlp)) if v is not None]
        opts += [f"{k}={v}" for k, v in self.extra]
        return (f"{self.family} L={self.layers} H={self.hidden} nh={self.heads}{kv} V={self.vocab} "
                f"{self.attn_implementation} {self.dtype} loss={self.loss}" + (" " + " ".join(opts) if opts else ""))


def _opt(value, default):
    return default if value is None else value


def hf_config(cfg: FamilyConfig):
    """The transformers config object for ``cfg`` (every dropout 0, positions up to ``POSITIONS``)."""
    import transformers as T

    f, H, L, NH, V = cfg.family, cfg.hidden, cfg.layers, cfg.heads, cfg.vocab
    kv, extra = cfg.kv_heads, dict(cfg.extra)
    tie = {} if cfg.tie_word_embeddings is None else {"tie_word_embeddings": cfg.tie_word_embeddings}
    if f not in GQA | MQA_SWITCH and kv not in (None, NH):
        raise ValueError(f"{f} has no grouped or multi-query attention (kv_heads={kv})")
    if f in ("gpt2", "gptj", "gpt_bigcode"):
        cls = {"gpt2": T.GPT2Config, "gptj": T.GPTJConfig, "gpt_bigcode": T.GPTBigCodeConfig}[f]
        kw = dict(vocab_size=V, n_positions=POSITIONS, n_embd=H, n_layer=L, n_head=NH, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        if cfg.mlp:
            kw["activation_function"] = cfg.mlp
        if f == "gptj":
            kw["rotary_dim"] = extra.pop("rotary_dim", min(8, cfg.head_dim))
        if f == "gpt_bigcode":
            kw["multi_query"] = _opt(kv, 1) == 1
            if kv not in (None, 1, NH):
                raise ValueError(f"gpt_bigcode is multi-query (1 kv head) or multi-head ({NH}), not {kv}")
        return cls(**kw, **tie, **extra)
    if f == "opt":
        kw = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, ffn_dim=4 * H, num_attention_heads=NH,
                  max_position_embeddings=POSITIONS, word_embed_proj_dim=extra.pop("word_embed_proj_dim", H),
                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                  do_layer_norm_before=_opt(cfg.norm, "pre") == "pre", enable_bias=_opt(cfg.bias, True))
        if cfg.mlp:
            kw["activation_function"] = cfg.mlp
        return T.OPTConfig(**kw, **tie, **extra)
    if f == "gpt_neox":
        rope = {"rope_theta": 10000.0, "partial_rotary_factor": extra.pop("partial_rotary_factor", 0.25),
                "rope_type": "default"}
        return T.GPTNeoXConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                               intermediate_size=4 * H, max_position_embeddings=POSITIONS, attention_dropout=0.0,
                               hidden_dropout=0.0, use_parallel_residual=_opt(cfg.norm, "parallel") == "parallel",
                               attention_bias=_opt(cfg.bias, True), hidden_act=_opt(cfg.mlp, "gelu"),
                               rope_parameters=rope, **tie, **extra)
    if f in ("llama", "mistral", "qwen2", "gemma", "phi", "phi3"):
        cls = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config,
               "gemma": T.GemmaConfig, "phi": T.PhiConfig, "phi3": T.Phi3Config}[f]
        kw = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=L, num_attention_heads=NH,
                  num_key_value_heads=_opt(kv, NH), max_position_embeddings=POSITIONS, attention_dropout=0.0)
        if f not in ("phi", "phi3"):
            kw["head_dim"] = cfg.head_dim
        if f == "phi3":   # fused q|k|v and gate|up, sliced; its default pad id (32000) is outside a tiny vocab
            kw.update(pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0)
        if cfg.mlp:
            kw["hidden_act"] = cfg.mlp
        if cfg.bias is not None:
            if f not in ("llama", "gemma"):
                raise ValueError(f"{f} has no bias switch")
            kw["attention_bias"] = cfg.bias
        if f == "phi":
            kw.update(resid_pdrop=0.0, embd_pdrop=0.0, qk_layernorm=cfg.norm == "qk")
            kw["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default",
                                     "partial_rotary_factor": extra.pop("partial_rotary_factor", 0.5)}
        return cls(**kw, **tie, **extra)
    if f in ("falcon", "falcon_new"):
        kw = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                  max_position_embeddings=POSITIONS, hidden_dropout=0.0, attention_dropout=0.0,
                  bias=_opt(cfg.bias, False))
        if cfg.mlp:
            kw["activation"] = cfg.mlp
        if f == "falcon":
            if kv not in (None, 1, NH):
                raise ValueError(f"falcon (classic) is multi-query (1 kv head) or multi-head ({NH}), not {kv}")
            kw.update(multi_query=_opt(kv, 1) == 1, parallel_attn=_opt(cfg.norm, "parallel") == "parallel")
        else:  # Falcon-40B/180B: grouped qkv [kv, nh/kv + 2, hd], parallel attention and MLP
            kw.update(new_decoder_architecture=True, num_kv_heads=_opt(kv, NH),
                      num_ln_in_parallel_attn=2 if _opt(cfg.norm, "ln2") == "ln2" else 1)
        return T.FalconConfig(**kw, **tie, **extra)
    if f == "bloom":
        return T.BloomConfig(vocab_size=V, hidden_size=H, n_layer=L, n_head=NH, hidden_dropout=0.0,
                             attention_dropout=0.0,
                             apply_residual_connection_post_layernorm=_opt(cfg.norm, "pre") == "post",
                             **tie, **extra)
    raise ValueError(f"unknown family {f!r}; one of {FAMILIES}")


def build(cfg: FamilyConfig) -> nn.Module:
    """The model, seeded (``torch.manual_seed(0)``), in train mode with every dropout at 0."""
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=cfg.attn_implementation,
                                             dtype=cfg.torch_dtype)
    model = model.to(cfg.torch_dtype)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    model.train()
    return model


def batch(vocab: int, B: int = 2, T: int = 8, seed: int = 1, pad: int = 2) -> dict:
    """HF keyword inputs: random ids, independent random labels (not the ids) with some -100, and an
    attention mask whose last row is left-padded by ``pad`` tokens (their labels are -100 too)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = torch.randint(0, vocab, (B, T), generator=g)
    labels[0, T // 2] = -100
    mask = torch.ones(B, T, dtype=torch.long)
    if pad:
        mask[-1, :pad] = 0
        labels[-1, :pad] = -100
    assert not torch.equal(labels, ids)
    return dict(input_ids=ids, labels=labels, attention_mask=mask, use_cache=False)


def outside_loss(labels: torch.Tensor):
    """Next-token cross-entropy computed from the returned logits, outside the model."""
    def loss_fn(out):
        logits = out.logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
    return loss_fn


def call_for(cfg: FamilyConfig, kwargs: dict):
    """``(kwargs, loss_fn)`` for the config's loss variant: HF's loss from ``labels=``, or labels withheld
    from the model and the loss computed outside."""
    if cfg.loss == "hf":
        return kwargs, (lambda out: out.loss)
    kw = {k: v for k, v in kwargs.items() if k != "labels"}
    return kw, outside_loss(kwargs["labels"])


# ------------------------------------------------------------------------------------------------------------
# running a tp program in the simulator and comparing it with the single-device model

def capture_model(model, kwargs):
    from autoshard.passes.capture import capture
    return capture(model, (), dict(kwargs))


def run_tp(model, t: int, kwargs: dict, loss_fn, captured=None, **options):
    """``tests/harness/simulate.py:train_ranks`` on keyword inputs, with one capture for every rank: per
    rank (output, loss, {param name incl. tied aliases: full gradient})."""
    from tests.harness.simulate import train_ranks
    captured = captured or capture_model(model, kwargs)
    return [(out, loss, grads) for out, loss, grads, _ in train_ranks(model, t, (), kwargs, loss_fn, captured, **options)]


def reference(model, kwargs, loss_fn):
    """The single-device model (a copy): output, loss, {every parameter name incl. tied aliases: grad}."""
    ref = copy.deepcopy(model)
    out = ref(**copy.deepcopy(kwargs))
    loss = loss_fn(out)
    loss.backward()
    return out, loss.detach(), {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False)}


def rel(a, b, floor=1e-12):
    """Max-abs error relative to the reference's max-abs (at least ``floor``), as test_parity.py."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / max(float(b.abs().max()), floor))


def errors(ref, results) -> dict:
    """Relative errors of every rank's loss, logits and gradients against ``reference``'s ``ref``.

    Every parameter (tied names included) must be on both sides with a gradient on both or neither. An
    analytically zero gradient (a key bias, softmax ignores it) is rounding noise: it is measured against
    a thousandth of the model's largest gradient (test_parity.py's floor)."""
    rout, rloss, rgrads = ref
    floor = 1e-3 * max(float(g.abs().max()) for g in rgrads.values() if g is not None)
    errs = {}
    for rank, (out, loss, grads) in enumerate(results):
        assert set(grads) == set(rgrads), f"rank {rank}: gradients of {sorted(set(grads) ^ set(rgrads))} on one side only"
        errs[f"rank {rank} loss"] = rel(loss, rloss)
        logits = getattr(out, "logits", None)
        if logits is not None:
            errs[f"rank {rank} logits"] = rel(logits, rout.logits)
        for name, g in rgrads.items():
            assert (grads[name] is None) == (g is None), f"rank {rank} grad {name}: one side has none"
            if g is not None:
                assert grads[name].shape == g.shape, f"rank {rank} grad {name}: {grads[name].shape} != {g.shape}"
                errs[f"rank {rank} grad {name}"] = rel(grads[name], g, floor)
    return errs


# ------------------------------------------------------------------------------------------------------------
# the fuzzer

ACTIVATIONS = {
    "gpt2": ["gelu_new", "relu", "gelu", "silu"], "opt": ["relu", "gelu"], "gpt_neox": ["gelu", "gelu_new", "relu"],
    "gptj": ["gelu_new", "relu"], "llama": ["silu", "gelu", "relu"], "mistral": ["silu", "gelu"],
    "qwen2": ["silu", "gelu"], "gemma": ["gelu_pytorch_tanh"], "phi": ["gelu_new", "gelu", "relu"],
    "phi3": ["silu", "gelu"],
    "falcon": ["gelu", "relu"], "falcon_new": ["gelu", "relu"], "bloom": [None],  # BLOOM: gelu, no switch
    "gpt_bigcode": ["gelu_pytorch_tanh", "gelu", "relu"],
}
NORMS = {"opt": ["pre", "post"], "bloom": ["pre", "post"], "gpt_neox": ["parallel", "sequential"],
         "falcon": ["parallel", "sequential"], "falcon_new": ["ln2", "ln1"], "phi": [None, "qk"]}
BIAS = {"opt", "gpt_neox", "llama", "gemma", "falcon", "falcon_new"}
HIDDEN_HEADS = [(32, 2), (32, 4), (48, 4), (64, 4), (64, 8), (96, 4), (96, 6), (128, 8), (64, 2), (48, 2)]
VOCABS = [97, 101, 128, 96, 113, 64]


def _extra(rng: random.Random, family: str, head_dim: int, hidden: int) -> tuple:
    if family == "gpt2":
        return tuple((k, rng.random() < 0.3) for k in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"))
    if family == "opt" and rng.random() < 0.3:
        return (("word_embed_proj_dim", hidden // 2),)   # project_in / project_out around the decoder
    if family == "gpt_neox":
        return (("partial_rotary_factor", rng.choice([0.25, 0.5, 1.0])),)
    if family == "gptj":
        return (("rotary_dim", rng.choice([d for d in (4, 8, head_dim) if d <= head_dim])),)
    if family == "phi":
        return (("partial_rotary_factor", rng.choice([0.5, 1.0])),)
    if family == "mistral" and rng.random() < 0.4:
        return (("sliding_window", 4),)
    if family == "llama" and rng.random() < 0.4:
        return (("mlp_bias", True),)
    return ()


def draw_any(rng: random.Random) -> FamilyConfig:
    """One config, not checked against transformers (``draw`` checks and redraws)."""
    family = rng.choice(FAMILIES)
    hidden, heads = rng.choice(HIDDEN_HEADS)
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    kv = None
    if family in GQA:
        kv = rng.choice(divisors)
    elif family in MQA_SWITCH:
        kv = rng.choice([1, heads])
    # sdpa is drawn for every family: GPT-J and BLOOM reject it at build, which draw() counts
    attn = rng.choice(["sdpa", "eager"])
    dtype = "bfloat16" if rng.random() < 0.15 else "float32"
    # bf16 only with smooth activations: ReLU's derivative jumps at 0, so two bf16 summation orders flip
    # units and move a tiny model's gradients by up to 30% (test_fuzz.py); ReLU is checked in fp32
    mlps = [a for a in ACTIVATIONS[family] if dtype == "float32" or a != "relu"]
    return FamilyConfig(
        family=family, layers=rng.choice([1, 2]), hidden=hidden, heads=heads, kv_heads=kv,
        vocab=rng.choice(VOCABS), tie_word_embeddings=rng.choice([True, False]),
        bias=rng.choice([True, False]) if family in BIAS else None,
        norm=rng.choice(NORMS[family]) if family in NORMS else None,
        mlp=rng.choice(mlps), extra=_extra(rng, family, hidden // heads, hidden),
        attn_implementation=attn, dtype=dtype, loss=rng.choice(["hf", "outside"]))


def draw(rng: random.Random, rejected: Counter | None = None, max_tries: int = 50) -> FamilyConfig:
    """A config transformers can build (its model is built once to check). Draws it rejects are redrawn and
    counted in ``rejected`` by ``"family: ErrorType: message"``."""
    for _ in range(max_tries):
        cfg = draw_any(rng)
        try:
            build(cfg)
        except Exception as e:  # noqa: BLE001 -- transformers' own validation, any type
            if rejected is not None:
                rejected[f"{cfg.family} {cfg.attn_implementation}: {type(e).__name__}: {str(e).splitlines()[0][:100]}"] += 1
            continue
        return cfg
    raise RuntimeError(f"no buildable config in {max_tries} draws")


def names_module_or_op(message: str, model: nn.Module) -> bool:
    """Whether an error message names a module or parameter of ``model``, or an ATen op."""
    names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters()]
    return any(n in message for n in names if "." in n or len(n) > 3) or bool(re.search(r"aten[.:]", message))


def with_(cfg: FamilyConfig, **changes) -> FamilyConfig:
    return dataclasses.replace(cfg, **changes)
