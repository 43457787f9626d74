"""Tier 1: each pass on small graphs, and compile-only runs of any rank (no processes)."""
from collections import Counter

import pytest
import torch

import autoshard
from autoshard.ir import meta as M
from autoshard.ir.mesh import MeshSpec
from autoshard.ir.placement import R, Shard, local_shape, shard_range, shardable
from autoshard.runtime.layout import assemble, take_shard
from autoshard.passes.bias import decompose_bias_pass
from autoshard.passes.capture import capture
from autoshard.passes.manager import PASSES, PassContext
from autoshard.passes.plan import plan_pass
from autoshard.passes.shapes import map_shard_through_view, view_groups
from tests.harness.models import batch, build

aten = torch.ops.aten


def count_ops(gm):
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def planned(kind="gpt", t=2, **cfg):
    model = build(kind, **cfg)
    args, kwargs = batch(kind, cfg.get("vocab_size", 96 if kind == "gpt" else 101))
    gm = decompose_bias_pass(capture(model, args, kwargs).gm)
    plan_pass(gm, PassContext(MeshSpec(tp=t), 0))
    return {M.NAME.get(n): M.SPEC.get(n).tp for n in gm.graph.nodes if M.KIND.get(n, None) == "parameter"}, gm


# --- spec and shape helpers ---------------------------------------------------------------------------
def test_view_groups_and_shard_mapping():
    assert view_groups((2, 16, 192), (32, 192)) == [((0, 1), (0,)), ((2,), (1,))]
    assert map_shard_through_view((2, 16, 64), (2, 16, 4, 16), 2, 1, 2) == (2, 1)     # h -> (nh, hs): heads
    assert map_shard_through_view((2, 16, 64), (2, 16, 4, 16), 2, 1, 8) is None       # 4 heads over 8 ranks
    assert map_shard_through_view((2, 16, 192), (2, 16, 3, 4, 16), 2, 3, 2) == (3, 1)  # q|k|v blocks -> heads
    assert map_shard_through_view((2, 16, 64), (32, 64), 0, 1, 2) == (0, 1)           # merge keeps the outer dim
    assert map_shard_through_view((2, 16, 64), (32, 64), 1, 1, 2) == (0, 2)           # inner dim of a merge: per row block
    assert map_shard_through_view((4, 8, 16, 8), (32, 16, 8), 1, 1, 2) == (0, 4)       # BLOOM's batch*heads
    assert map_shard_through_view((32, 16, 8), (4, 8, 16, 8), 0, 4, 2) == (1, 1)       # and back
    assert map_shard_through_view((2, 16, 192), (2, 16, 12, 16), 2, 3, 2) == (2, 3)   # q|k|v heads in one dim
    assert map_shard_through_view((2, 16, 64), (2, 16, 64), 2, (32, 16, 16), 2) == (2, (32, 16, 16))


def test_shard_ranges_blocks_and_padding():
    assert shard_range(12, 2, 1, blocks=3) == [(2, 4), (6, 8), (10, 12)]  # every block's second half
    assert shard_range(16, 2, 1, blocks=(8, 4, 4)) == [(4, 8), (10, 12), (14, 16)]   # unequal q|k|v blocks
    assert local_shape((16, 64), Shard(0, blocks=(8, 4, 4)), 2) == (8, 64)
    assert shardable(16, 4, (8, 4, 4)) and not shardable(16, 8, (8, 4, 4))
    full = torch.arange(16.0)
    parts = [take_shard(full, 0, 16, 2, r, (8, 4, 4)) for r in range(2)]
    assert parts[1].tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    assert torch.equal(assemble(torch.cat(parts), 0, 16, 2, (8, 4, 4)), full)
    assert shard_range(97, 2, 1) == [(49, 97)]                           # last rank: 48 rows + 1 of padding
    assert local_shape((97, 64), Shard(0), 2) == (49, 64)


# --- passes -------------------------------------------------------------------------------------------
def test_decompose_bias_splits_every_biased_matmul():
    model = build("gpt", n_layer=1)
    gm = capture(model, *batch("gpt", 96)).gm
    before = count_ops(gm)
    after = count_ops(decompose_bias_pass(gm))
    biased = 4  # c_attn, c_proj, c_fc, mlp.c_proj (the LM head has no bias)
    assert after["aten.add.Tensor"] == before["aten.add.Tensor"] + biased
    assert after["aten.linear.default"] == before["aten.linear.default"]
    assert all(len(n.args) == 2 for n in gm.graph.nodes if n.target is aten.linear.default)


def test_plan_is_megatrons_on_fused_qkv_gpt():
    pl, gm = planned("gpt", t=2, n_layer=1)
    assert pl["transformer.h.0.attn.c_attn.weight"] == Shard(0, blocks=3)  # per q/k/v block, by heads
    assert pl["transformer.h.0.attn.c_attn.bias"] == Shard(0, blocks=3)
    assert pl["transformer.h.0.attn.c_proj.weight"] == Shard(1)            # row-parallel
    assert pl["transformer.h.0.mlp.c_fc.weight"] == Shard(0)               # column-parallel
    assert pl["transformer.h.0.mlp.c_proj.weight"] == Shard(1)             # row-parallel
    assert pl["transformer.h.0.attn.c_proj.bias"] == R                     # added once, after the all-reduce
    assert pl["transformer.wte.weight"] == Shard(0)                        # vocab-parallel (lm_head is tied to it)
    assert "lm_head.weight" not in pl                                      # the alias: one tensor, one name
    assert pl["transformer.h.0.ln_1.weight"] == R
    lowerings = Counter(M.STRATEGY.get(n).lowering for n in gm.graph.nodes)
    assert lowerings["vocab_parallel_embedding"] >= 1
    assert lowerings["vocab_parallel_cross_entropy"] == 1
    sdpa = next(n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
    assert M.SPEC.get(sdpa).tp == Shard(1)                                 # attention split by heads


@pytest.mark.parametrize("family", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_plan_is_megatrons_on_rmsnorm_models(family):
    """An RMSNorm can run sharded along hidden, so a plan that never replicates the residual stream exists:
    every linear row-parallel, a reduce-scatter after each (7 a layer), twice Megatron's traffic. Pricing
    the residual's replica as memory made it look cheaper (it stepped 4x slower at tp=2 on gloo); the
    residual replica is priced by its traffic, so the planner picks Megatron's layout: 2 all-reduces a
    layer forward, and the loss vocab-parallel."""
    import transformers as T
    config = getattr(T, family.replace("ForCausalLM", "Config"))(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = getattr(T, family)(config)
    ids = torch.randint(0, 256, (4, 32))
    prog = autoshard.compile_rank(model, {"tp": 2}, 0, (), dict(input_ids=ids, labels=ids, use_cache=False),
                                  loss_only=True)
    pl = {r.name: r.spec.tp for r in prog.params}
    for i in range(2):
        layer = f"model.layers.{i}."
        for w in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert pl[layer + w + ".weight"] == Shard(0), (w, pl[layer + w + ".weight"])
        for w in ("self_attn.o_proj", "mlp.down_proj"):
            assert pl[layer + w + ".weight"] == Shard(1)
        for w in ("input_layernorm", "post_attention_layernorm"):
            assert pl[layer + w + ".weight"] == R
    assert pl["lm_head.weight"] == Shard(0)
    kinds = Counter((c.phase, c.kind) for c in prog.collectives)
    assert kinds[("fwd", "reduce_scatter")] == 0 and kinds[("fwd", "all_reduce")] == 2 * 2 + 3, kinds


def test_tied_weight_keeps_the_name_the_model_gives_it():
    """HF's Llama with a tied head reads the weight through ``lm_head``, but ``model.named_parameters()``
    calls it ``model.embed_tokens.weight``: the program uses that name (a user's param groups and name
    filters are built from it), keeps ``lm_head.weight`` as an alias, and a pin given under the alias
    applies to the one tensor."""
    import transformers as T
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    ids = torch.randint(0, 64, (2, 8))
    kwargs = dict(input_ids=ids, labels=ids, use_cache=False)
    prog = autoshard.compile_rank(model, {"tp": 2}, 0, (), kwargs, loss_only=True)
    assert {r.name for r in prog.params} == set(dict(model.named_parameters()))
    assert prog.captured.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    pl = {r.name: r.spec.tp for r in prog.params}
    assert pl["model.embed_tokens.weight"] == Shard(0)
    pinned = autoshard.compile_rank(model, {"tp": 2}, 0, (), kwargs, loss_only=True, pins={"lm_head.weight": R})
    assert {r.name: r.spec.tp for r in pinned.params}["model.embed_tokens.weight"] == R


def test_residual_stream_is_the_token_embedding_or_inputs_embeds():
    """What the replica price measures against: the token embedding looked up from input_ids (through
    views), or inputs_embeds; never a position table (no batch dim) or T5's relative-position bias."""
    import transformers as T
    from autoshard.passes.cost import residual_stream_bytes
    torch.manual_seed(0)
    gpt2 = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16))
    ids = torch.randint(0, 64, (4, 16))
    stream = 4 * 16 * 32 * 4
    assert residual_stream_bytes(capture(gpt2, (), dict(input_ids=ids, labels=ids)).gm) == stream
    embeds = torch.randn(4, 16, 32)
    assert residual_stream_bytes(capture(gpt2, (), dict(inputs_embeds=embeds, labels=ids)).gm) == stream
    t5 = T.T5ForConditionalGeneration(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                 num_heads=4, decoder_start_token_id=0))
    assert residual_stream_bytes(capture(t5, (), dict(input_ids=ids, labels=ids, use_cache=False)).gm) == stream


def test_plan_separate_qkv_and_untied_head():
    pl, _ = planned("gpt", t=2, n_layer=1, fused_qkv=False, tie_weights=False)
    for w in ("q_proj", "k_proj", "v_proj"):
        assert pl[f"transformer.h.0.attn.{w}.weight"] == Shard(0)
    assert pl["lm_head.weight"] == Shard(0) and pl["transformer.wte.weight"] == Shard(0)


def test_plan_hf_gpt2_conv1d_transposed_weights():
    pl, _ = planned("hf", t=2)
    assert pl["transformer.h.0.attn.c_attn.weight"] == Shard(1, blocks=3)  # Conv1D stores W as (in, out)
    assert pl["transformer.h.0.attn.c_proj.weight"] == Shard(0)
    assert pl["transformer.h.0.mlp.c_fc.weight"] == Shard(1)
    assert pl["transformer.h.0.mlp.c_proj.weight"] == Shard(0)
    tied = pl.get("transformer.wte.weight", pl.get("lm_head.weight"))  # HF ties them; the graph reads one
    assert tied == Shard(0)                                               # 101 rows: padded to 102


def test_pin_overrides_the_planner():
    model = build("gpt", n_layer=1)
    prog = autoshard.compile_rank(model, {"tp": 2}, 0, *batch("gpt", 96),
                                  options=autoshard.CompileOptions(pins={"transformer.wpe.weight": R}))
    assert {p.name: p.spec.tp for p in prog.params}["transformer.wpe.weight"] == R


# --- compile-only runs --------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_compile_only_first_and_last_rank(tp, tmp_path):
    model = build("gpt", n_layer=2, n_head=8, n_embd=64, vocab_size=100)
    args, _ = batch("gpt", 100)
    cap = capture(model, args, {})
    for rank in (0, tp - 1):
        prog = autoshard.compile_rank(model, {"tp": tp}, rank, args, options=autoshard.CompileOptions(
            dump=str(tmp_path)), captured=cap)
        for p in prog.params:  # every weight matrix sharded, shapes local
            if len(p.global_shape) == 2:
                assert p.spec.tp != R and p.local_shape != p.global_shape, p.name
        assert prog.coords == {"dp": 0, "pp": 0, "tp": rank}
    assert (tmp_path / "plan.md").exists() and (tmp_path / f"rank{tp - 1}" / "plan.md").exists()
    assert len(list(tmp_path.glob("[0-9][0-9]_*.txt"))) == len(PASSES) + 1  # capture + every pass, numbered


@pytest.mark.parametrize("options", [dict(), dict(sequence_parallel=True, recompute=True),
                                     dict(recompute="selective", disable=("fuse",))])
def test_compile_ranks_shares_one_plan_and_matches_each_rank_alone(options, tmp_path):
    """One capture and one plan for every rank (compile_ranks) gives each rank the program compile_rank
    gives it alone (so the shared planned graph is left as it was for the next rank), and dumps every
    enabled pass into every rank's directory."""
    model = build("gpt", n_layer=2, n_head=4, n_embd=32, vocab_size=100, dropout=0.1)
    args, _ = batch("gpt", 100)
    alone = [autoshard.compile_rank(model, {"tp": 4}, r, args, **options) for r in (3, 0, 2)]
    shared = autoshard.compile_ranks(model, {"tp": 4}, [3, 0, 2], args, dump=str(tmp_path), **options)
    for a, b in zip(alone, shared):
        assert b.gm.code == a.gm.code and b.rank == a.rank
        assert [(p.name, p.spec, p.local_shape) for p in b.params] == [(p.name, p.spec, p.local_shape) for p in a.params]
        assert b.collectives == a.collectives
    files = sorted(f.name for f in tmp_path.glob("[0-9][0-9]_*.txt"))
    assert files == sorted(f.name for f in (tmp_path / "rank3").glob("[0-9][0-9]_*.txt"))
    assert len(files) == len(PASSES) + 1 - len(options.get("disable", ()))
    assert (tmp_path / "rank2" / "plan.md").exists()
    with pytest.raises(ValueError, match="ranks is empty"):
        autoshard.compile_ranks(model, {"tp": 4}, [], args)
    with pytest.raises(ValueError, match="rank 4"):
        autoshard.compile_ranks(model, {"tp": 4}, [0, 4], args)


def test_collectives_match_megatron_count():
    """4-layer GPT at TP=2, loss only: 2 all-reduces per layer forward and 2 backward, like Megatron's
    hand-written layers (16), plus one for the embedding, one f for the LM head input, and two in the
    vocab-parallel loss. Nothing is gathered."""
    model = build("gpt", n_layer=4)
    prog = autoshard.compile_rank(model, {"tp": 2}, 0, *batch("gpt", 96),
                                  options=autoshard.CompileOptions(loss_only=True))
    kinds = Counter((c.axis, c.phase, c.kind) for c in prog.collectives)
    assert kinds == {("tp", "fwd", "all_reduce"): 2 * 4 + 1 + 2, ("tp", "bwd", "all_reduce"): 2 * 4 + 1}
    B, T, h = 2, 8, 32
    layer = [c for c in prog.collectives if tuple(c.shape) == (B, T, h)]
    assert len(layer) == 4 * 4 + 2


def test_dump_lists_formulas(tmp_path):
    model = build("gpt", n_layer=1)
    autoshard.compile_rank(model, {"tp": 2}, 0, *batch("gpt", 96),
                           options=autoshard.CompileOptions(dump=str(tmp_path), loss_only=True))
    plan = (tmp_path / "plan.md").read_text()
    assert "`4*b*h*s`" in plan and "all_reduce" in plan and "Parameter bytes on this rank" in plan
    index = next(i for i, p in enumerate(PASSES, start=1) if p.name == "tp_rewrite")
    graph = (tmp_path / f"{index:02d}_tp_rewrite.txt").read_text()
    assert "redistribute_0" in graph and "S(0,b3)" in graph


@pytest.mark.parametrize("fused", [True, False])
def test_rewrite_fuse_bias_and_overlap_node_counts(fused):
    """Per layer: fused q|k|v and fc1 each get f fused into a ColumnParallelMatmul (the gradient
    all-reduce overlaps dW); separate q, k, v share one plain f. Row-parallel biases stay a separate add
    after the all-reduce; every other bias is folded back into its linear."""
    L = 2
    model = build("gpt", n_layer=L, fused_qkv=fused)
    prog = autoshard.compile_rank(model, {"tp": 2}, 0, *batch("gpt", 96),
                                  options=autoshard.CompileOptions(loss_only=True))
    mods = Counter(type(prog.gm.get_submodule(n.target)).__name__ for n in prog.gm.graph.nodes if n.op == "call_module")
    assert mods["ColumnParallelMatmul"] == (2 if fused else 1) * L + 1   # + the LM head
    assert mods["CopyToParallel"] == (0 if fused else L)
    assert mods["Redistribute"] == 2 * L + 1                              # g after each row matmul, embedding
    ops = count_ops(prog.gm)
    assert ops["aten.add.Tensor"] == 2 * L + 2 * L + 1                    # row biases, residuals, embeddings
    linears_with_bias = [n for n in prog.gm.graph.nodes if n.target is aten.linear.default and len(n.args) == 3]
    assert len(linears_with_bias) == (0 if fused else 3 * L)              # (fused ones live in the modules)


@pytest.mark.parametrize("kv_heads, tp, kv_placement", [(2, 2, Shard(0)), (2, 4, R), (1, 2, R)])
def test_gqa_kv_heads_sharded_or_replicated(kv_heads, tp, kv_placement, tmp_path):
    """tp divides the kv heads: they shard with the query heads. It does not (GQA with fewer kv heads than
    ranks, multi-query): the k/v projections are replicated and plan.md says why. Either way the query
    projection is column-parallel and the output projection row-parallel."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=kv_heads,
                                         max_position_embeddings=32))
    ids = torch.randint(0, 64, (2, 8))
    prog = autoshard.compile_rank(model, {"tp": tp}, 0, (), dict(input_ids=ids, labels=ids, use_cache=False),
                                  options=autoshard.CompileOptions(dump=str(tmp_path)))
    spec = {p.name: p.spec.tp for p in prog.params}
    attn = "model.layers.0.self_attn"
    assert spec[f"{attn}.q_proj.weight"] == Shard(0) and spec[f"{attn}.o_proj.weight"] == Shard(1)
    assert spec[f"{attn}.k_proj.weight"] == spec[f"{attn}.v_proj.weight"] == kv_placement
    assert prog.report.replicated_weights == []        # by design, not reported as a fallback
    plan = (tmp_path / "plan.md").read_text()
    assert f"4 query heads, {kv_heads} kv heads at tp={tp}" in plan
    assert ("k/v projections replicated" in plan) == (kv_placement == R)
