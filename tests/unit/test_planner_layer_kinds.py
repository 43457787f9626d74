"""The planner on models whose layers are not all alike, and on multi-head latent attention.

DeepSeek-V3 (and Kimi K2, GLM-4.5, dots.llm1) run their first layers with a dense MLP and the rest with
experts; Qwen2-MoE names dense layers in ``mlp_only_layers``; Llama 4 Maverick puts experts on every
other layer. ``model_shape`` reads which layers are dense off the model (built on ``meta``), and the
cost model prices the busiest pipeline stage's own mix of them. MLA (DeepSeek-V2/V3, MiniCPM3) projects
q and k/v through low-rank down projections that tensor parallelism replicates.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autoshard.planner import DGX_H100, ModelShape, plan, predict
from autoshard.planner.cost import Candidate, _rank_params
from autoshard.planner.report import plan_md
from autoshard.planner.config_reading import model_shape

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, vocab_size=512)


def _configs():
    T = transformers
    return {
        # MLA with a q rank, 1 dense layer first, shared expert
        "deepseek_v3": (T.DeepseekV3Config(**SMALL, intermediate_size=512, moe_intermediate_size=64,
                                           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                           first_k_dense_replace=1, q_lora_rank=96, kv_lora_rank=64,
                                           qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=1,
                                           topk_group=1), (0,)),
        # MLA without a q rank (DeepSeek-V2-Lite's), 2 dense layers first
        "deepseek_v2": (T.DeepseekV2Config(**SMALL, intermediate_size=512, moe_intermediate_size=64,
                                           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
                                           first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=64,
                                           qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=48), (0, 1)),
        "qwen2_moe": (T.Qwen2MoeConfig(**SMALL, intermediate_size=640, moe_intermediate_size=64, num_experts=4,
                                       num_experts_per_tok=2, shared_expert_intermediate_size=128,
                                       mlp_only_layers=[1, 2]), (1, 2)),
        "llama4_text": (T.Llama4TextConfig(**SMALL, intermediate_size=128, intermediate_size_mlp=768,
                                           num_local_experts=4, num_experts_per_tok=1, num_key_value_heads=2,
                                           head_dim=32, interleave_moe_layer_step=2), (0, 2)),
        "minicpm3": (T.MiniCPM3Config(**SMALL, intermediate_size=512, q_lora_rank=96, kv_lora_rank=64,
                                      qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32), ()),
    }


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "qwen2_moe", "llama4_text", "minicpm3"])
def test_dense_layers_and_mla_are_read_off_the_model(family, tmp_path):
    cfg, dense = _configs()[family]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    shape = model_shape(cfg, seq=128)
    assert shape.dense_layers == dense
    # every parameter priced: MLA's down and up projections, the dense layers' own width
    real = sum(p.numel() for p in model.parameters())
    assert abs(shape.params() - real) <= 0.01 * real, (shape, real)
    if dense:
        layer = model.model.layers[dense[0]]
        mlp = sum(p.numel() for n, p in layer.named_parameters() if n.split(".")[0] in ("mlp", "feed_forward"))
        assert shape.dense_ffn * 3 * shape.hidden == mlp
    if family.startswith("deepseek") or family == "minicpm3":
        assert shape.kv_lora_rank == 64 and shape.kv_heads == shape.heads
        assert shape.head_dim == 32 + 16 and shape.value_head_dim == cfg.v_head_dim
        assert shape.q_lora_rank == (cfg.q_lora_rank or 0)
    # the same from config.json, and from the model itself
    cfg.save_pretrained(tmp_path)
    assert model_shape(str(tmp_path / "config.json"), seq=128).params() == shape.params()
    assert model_shape(model, seq=128).dense_layers == dense


def test_deepseek_v3_holds_671b_and_runs_37b_a_token():
    """DeepSeek-V3's published sizes (arXiv 2412.19437: 671B parameters, 37B activated a token) from its
    config alone: MLA, 3 dense layers, 256 experts of 2048 with one shared, top-8."""
    shape = model_shape(transformers.DeepseekV3Config())
    assert shape.dense_layers == (0, 1, 2) and shape.dense_ffn == 18432
    assert shape.params() == pytest.approx(671e9, rel=0.005)
    core = 4 * shape.seq * shape.heads * shape.core_head_dim          # Q K^T and P V: no weights
    active = sum(len(idx) * (kind.layer_forward_flops(1) - core) / 2 for kind, idx in shape.layer_kinds())
    active += 2 * shape.vocab * shape.hidden                           # the embedding and the LM head
    assert active == pytest.approx(37e9, rel=0.02)
    # tensor parallelism splits the up projections and the output, and replicates the two down ones
    gemms = shape.attention_gemms()
    replicated = [g for g in gemms if not g.split]
    assert [(g.inner, g.outer) for g in replicated] == [(7168, 1536), (7168, 512 + 64)]
    assert all(g.local(8) == (g.outer, g.inner) for g in replicated)
    assert [g.local(8) for g in gemms if g.split] == [(128 * 192 / 8, 1536), (128 * 256 / 8, 512), (7168, 128 * 128 / 8)]
    # and a tp rank holds those two (and the router, the norms) whole, the rest a t-th
    moe = shape.layer_kind(3)
    whole = 7168 * 1536 + 7168 * 576 + 7168 * 256 + 1536 + 512 + 4 * 7168
    assert moe.layer_rank_params(8) == pytest.approx((moe.layer_params() - whole) / 8 + whole, rel=1e-12)
    assert moe.layer_rank_params(1) == moe.layer_params()


def _mixed(dense_ffn: int) -> ModelShape:
    """Four layers, the first two with a dense MLP of ``dense_ffn``, the last two with 8 experts."""
    return ModelShape("mixed", 4, 1024, 16, 16, 256, 32000, 2048, gated=True, tied=False, experts=8,
                      experts_per_token=2, dense_layers=(0, 1), dense_ffn=dense_ffn)


def test_stage_mixes_follow_the_even_cuts():
    shape = ModelShape("ds", 61, 7168, 128, 128, 2048, 129280, 4096, gated=True, experts=256, experts_per_token=8,
                       dense_layers=(0, 1, 2), dense_ffn=18432)
    # layer kinds in the order their first layers come: the dense ones, then the MoE ones. 16 stages of
    # ceil(61 / 16) = 4: the first holds the 3 dense layers and 1 MoE, the last 1 MoE layer
    assert [kind.experts for kind, _ in shape.layer_kinds()] == [1, 256]
    assert set(shape.stage_mixes(16)) == {(0, 4), (3, 1), (0, 1)}
    assert set(shape.stage_mixes(1)) == {(3, 58)}
    assert set(_mixed(512).stage_mixes(2)) == {(0, 2), (2, 0)}
    uniform = dataclasses.replace(shape, dense_layers=(), dense_ffn=0)
    assert uniform.stage_mixes(16) == ((4,),)


@pytest.mark.parametrize("heavy", ["dense", "moe"])
def test_the_busiest_stage_paces_the_pipeline(heavy):
    """At pp=2 the dense layers fill one stage and the MoE layers the other: the step is paced by the
    heavier, so it is the step of a model made of that kind alone; a rank's memory is the larger
    stage's; the model's flops count each layer as what it is."""
    shape = _mixed(16384 if heavy == "dense" else 64)
    dense, moe = sorted((kind for kind, _ in shape.layer_kinds()), key=lambda k: k.experts)
    alone = {"dense": dataclasses.replace(dense, layers=4), "moe": dataclasses.replace(moe, layers=4)}
    c = Candidate(dp=1, pp=2, tp=2, b=1, m=8)
    got = predict(shape, DGX_H100, c)
    like = predict(alone[heavy], DGX_H100, c)
    assert got.breakdown.compute == pytest.approx(like.breakdown.compute, rel=1e-12)
    assert got.breakdown.tp_comm == pytest.approx(like.breakdown.tp_comm, rel=1e-12)
    assert _rank_params(shape, c) == max(_rank_params(a, c) for a in alone.values())
    assert shape.model_flops(4096) == pytest.approx((alone["dense"].model_flops(4096) + alone["moe"].model_flops(4096)) / 2)
    # one stage: every layer, each priced as what it is
    whole = Candidate(dp=1, pp=1, tp=2, b=1, m=8)
    assert predict(shape, DGX_H100, whole).breakdown.compute == pytest.approx(
        (predict(alone["dense"], DGX_H100, whole).breakdown.compute
         + predict(alone["moe"], DGX_H100, whole).breakdown.compute) / 2, rel=1e-9)


def test_deepseek_v3_plans_from_its_config(tmp_path):
    plans = plan(transformers.DeepseekV3Config(), 1024, "dgx-h100", 2048, seq=4096, top=3)
    best = plans.best
    assert best.fits and best.prediction.memory.total <= DGX_H100.hbm_bytes
    text = plan_md(plans)
    assert "multi-head latent attention (q rank 1536, kv rank 512" in text
    assert "layers 0-2 a dense MLP 18432" in text


# hybrids, as the zoo builds them (tests/harness/zoo.py): which layers run the other mixer, which softmax
# attention, which no MLP, and the class of the mixer read off the first one
HYBRIDS = {
    "jamba": ("JambaMambaMixer", (0,), (0,), ()),                    # Mamba + dense MLP, attention + MoE
    "bamba": ("BambaMixer", (0,), (0,), ()),
    "falcon_h1": ("FalconH1Mixer", (), (), ()),                       # every layer: Mamba beside attention
    "nemotron_h": ("NemotronHMamba2Mixer", (0,), (0, 2, 3), (0, 1)),  # each block one of the four
    "qwen3_next": ("Qwen3NextGatedDeltaNet", (0,), (0,), ()),
    "lfm2": ("Lfm2ShortConv", (0,), (0,), ()),
    "recurrent_gemma": ("RecurrentGemmaRecurrentBlock", (0, 2), (0, 2), ()),
}


@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_hybrid_layers_are_read_layer_by_layer(family):
    from tests.harness.zoo import ZOO
    cls, kwargs, _ = ZOO[family]
    config = getattr(transformers, cls, None)
    if config is None:
        pytest.skip(f"this transformers has no {cls}")
    cfg = config(**kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    shape = model_shape(cfg)
    name, mixer_layers, attention_free, mlp_free = HYBRIDS[family]
    assert shape.kv_heads == (getattr(cfg, "num_key_value_heads", None) or shape.heads)    # the config's groups
    if family == "qwen3_next":                  # its output gate, as wide as q, beside q, k and v
        assert shape.attention_extra_width == shape.q_width
    assert shape.mixer is not None and shape.mixer.name == name
    assert (shape.mixer_layers, shape.attention_free_layers, shape.mlp_free_layers) == (mixer_layers, attention_free,
                                                                                      mlp_free)
    # every layer's parameters priced as what it holds (norms and biases aside: 4h a layer)
    real = sum(p.numel() for p in model.parameters())
    assert abs(shape.params() - real) <= 0.03 * real, (shape, real)
    for i, layer in enumerate(model.model.layers):
        held = sum(p.numel() for p in layer.parameters())
        assert abs(shape.layer_kind(i).layer_params() - held) <= 4 * shape.hidden, (i, type(layer).__name__)
    # a rank holds its own stage's layers, each as what it is: one stage, all of them
    one = Candidate(dp=1, pp=1, tp=1, b=1, m=1)
    ends = _rank_params(dataclasses.replace(shape, layers=0, dense_layers=(), mixer_layers=(),
                                            attention_free_layers=(), mlp_free_layers=()), one)
    assert _rank_params(shape, one) - ends == sum(len(idx) * k.layer_params() for k, idx in shape.layer_kinds())


def test_a_mixer_beside_attention_shares_its_all_reduce():
    """Falcon-H1 runs Mamba and attention side by side on one residual branch: their row-parallel outputs
    add before one all-reduce, so its layer is two blocks (the mixers, the MLP), not three; Jamba's
    layers run one or the other."""
    from tests.harness.zoo import ZOO
    shapes = {f: model_shape(getattr(transformers, ZOO[f][0])(**ZOO[f][1])) for f in ("falcon_h1", "jamba")}
    falcon, jamba = shapes["falcon_h1"], shapes["jamba"]
    assert falcon.parallel_mixer and not jamba.parallel_mixer
    assert [k.blocks for k, _ in falcon.layer_kinds()] == [2]
    assert [k.blocks for k, _ in jamba.layer_kinds()] == [2, 2]
    from autoshard.planner.cost import _layer_seconds
    c = Candidate(dp=1, pp=1, tp=4, b=1, m=1)
    two, three = (_layer_seconds(s, DGX_H100, c, 2048, True).tp
                  for s in (falcon, dataclasses.replace(falcon, parallel_mixer=False)))
    assert three == pytest.approx(two * 3 / 2, rel=1e-12)


def test_a_mixer_layer_has_no_attention_core():
    """A Mamba layer's time is its projections and its scan: no attention core, so selective recompute
    (which runs the attention core again) adds nothing to it; it saves no s x s matrix either."""
    from tests.harness.zoo import ZOO
    from autoshard.planner.cost import _layer_seconds, activation_bytes_per_layer
    cls, kwargs, _ = ZOO["jamba"]
    shape = model_shape(getattr(transformers, cls)(**kwargs), seq=2048)
    mamba, attention = (shape.layer_kind(i) for i in (0, 1))
    assert (mamba.attention, mamba.blocks, attention.blocks) == (False, 2, 2)
    c = Candidate(dp=1, pp=1, tp=1, b=1, m=1, recompute="selective")
    assert _layer_seconds(mamba, DGX_H100, c, 2048, False).recompute == 0
    assert _layer_seconds(attention, DGX_H100, c, 2048, False).recompute > 0
    # only the attention layer keeps an s x s softmax where the attention is not flash: 5 a s / h of s b h
    mamba_kept, attention_kept = ([activation_bytes_per_layer(k, 1, 1, "none", flash=f) for f in (False, True)]
                                  for k in (mamba, attention))
    assert mamba_kept[0] == mamba_kept[1]
    assert attention_kept[0] - attention_kept[1] == pytest.approx(5 * shape.heads * 2048 / shape.hidden * 2048 * shape.hidden)


def test_hybrids_that_nest_layers_are_refused():
    from tests.harness.zoo import ZOO
    cls, kwargs, _ = ZOO["zamba2"]
    with pytest.raises(ValueError, match=r"decoder layer 1 \(Zamba2HybridLayer\) runs other decoder layers"):
        model_shape(getattr(transformers, cls)(**kwargs))


def test_nemotron_h_plans_from_its_config():
    """Nemotron-H's default config (Mamba-2, attention, MoE and MLP blocks) is planned end to end."""
    cfg = transformers.NemotronHConfig()
    plans = plan(cfg, 64, "dgx-h100", 256, seq=4096, top=3)
    assert plans.best.fits
    text = plan_md(plans)
    assert "a NemotronHMamba2Mixer on layers" in text and "no MLP on layers" in text


def test_a_state_space_model_has_no_attention_and_no_mlp():
    """Mamba-2's blocks are a mixer and a norm: no attention heads to size or split, no MLP."""
    cfg = transformers.Mamba2Config(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_heads=16, head_dim=32,
                                    expand=2, n_groups=1, state_size=16)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    shape = model_shape(cfg, seq=1024)
    assert (shape.attention, shape.ffn, shape.blocks, shape.mixer.name) == (False, 0, 1, "Mamba2Mixer")
    real = sum(p.numel() for p in model.parameters())
    assert abs(shape.params() - real) <= 0.03 * real
    assert shape.layer_forward_flops(1) == 2 * sum(g.inner * g.outer for g in shape.mixer.gemms)
    assert plan(shape, 8, "dgx-h100", 64, top=1).best.fits


def test_rwkv_time_mixing_is_a_mixer_not_softmax_attention():
    """RWKV's "SelfAttention" holds a learned decay (``time_decay``): a recurrence, read as the mixer,
    whose four h x h matrices are split column-wise but for ``output``, back to the stream row-wise;
    its channel mixing is the MLP (its receptance counted in the width)."""
    cfg = transformers.RwkvConfig(vocab_size=512, hidden_size=256, num_hidden_layers=4, attention_hidden_size=256,
                                  intermediate_size=1024, context_length=1024)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    shape = model_shape(cfg)
    assert (shape.attention, shape.mixer.name, shape.blocks) == (False, "RwkvSelfAttention", 2)
    assert [g.split for g in shape.mixer.gemms] == ["outer", "outer", "outer", "inner"]
    assert shape.ffn == 1024 + 256 // 2        # key and value, and receptance's h x h as half a column pair
    real = sum(p.numel() for p in model.parameters())
    assert abs(shape.params() - real) <= 0.03 * real
    assert plan(shape, 8, "dgx-h100", 64, top=1).best.fits
