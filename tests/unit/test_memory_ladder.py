"""``memory_limit`` as a hard constraint (``autoshard/planner/memory_ladder.py``): lowering it walks the
ladder TP -> TP + SP -> TP + SP + selective -> full recompute -> an error naming the bytes missing;
``parallelize(memory_limit=...)`` applies the choice (or only checks the user's), and the program it
runs is the single-device model's; ``autoshard.plan(memory_limit=...)`` respects it too."""
import copy
import dataclasses
import logging
import math

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard.ir.mesh import MeshSpec
from autoshard.ir.program import comm_summary
from autoshard.models.gpt import GPT, GPTConfig
from autoshard.planner import DGX_A100, Candidate, plan, predict
from autoshard.planner.config_reading import model_shape
from autoshard.planner.cost import stage_memory
from autoshard.planner.memory_ladder import MemoryLimitError, choose, memory_options, rungs_for
from autoshard.planner.shape import BUILTIN
from tests.harness.parity_checks import rel
from tests.harness.simulate import simulate

# SC'21's 1.7B GPT (24 layers, h 2304, 24 heads, s 2048) at tp=4, 8 microbatches of 2, attention keeping
# its s x s matrix (so selective recompute has something to drop); pp=2 where stages differ
SHAPE = BUILTIN["gpt-1.7b"]
MESH = dict(dp=1, pp=2, tp=4, b=2, m=8)
WALK = dict(MESH, pp=1)
LADDER = ["TP alone", "TP + SP", "TP + SP (regathered)", "TP + SP + selective recompute",
          "TP + SP (regathered) + selective recompute", "TP + SP + full recompute"]
MiB = 2**20


def _choose(limit, mesh=MESH, **kw):
    return choose(SHAPE, limit, **mesh, cluster=DGX_A100, flash=False, **kw)


def test_sequence_parallelism_wins_outright_where_pipeline_sends_shrink():
    """Without a pipeline SP costs a little time (its norms' gradient all-reduce); with one, each boundary
    send is 1/t of the bytes, so SP is faster *and* smaller: TP alone is never the choice there."""
    alone = {r.name: r for r in _choose(1e15, WALK).rungs}
    assert alone["TP alone"].step_seconds < alone["TP + SP"].step_seconds
    piped = _choose(1e15)
    by = {r.name: r for r in piped.rungs}
    assert by["TP + SP"].step_seconds < by["TP alone"].step_seconds and by["TP + SP"].bytes < by["TP alone"].bytes
    assert piped.chosen.name == "TP + SP"


def test_lowering_the_limit_walks_the_ladder_then_names_the_missing_bytes():
    free = _choose(1e15, WALK)
    names = [r.name for r in free.rungs]
    assert names == LADDER, names                            # the ladder is the order of the time they add
    steps = [r.step_seconds for r in free.rungs]
    assert steps == sorted(steps) and len(set(steps)) == len(LADDER)
    sizes = [r.bytes for r in free.rungs]
    assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes   # each rung holds less than the one before
    for r in free.rungs:                                     # the bytes are the cost model's
        c = Candidate(1, 1, 4, 2, 8, 1, r.recompute, 0, r.sp)
        assert r.bytes == predict(SHAPE, DGX_A100, c, flash=False).memory.total
        assert r.stage_bytes == (stage_memory(SHAPE, c, 0, flash=False).total,) == (r.bytes,)
    chosen = []
    for i, rung in enumerate(free.rungs):
        at = _choose(rung.bytes, WALK)                       # exactly its bytes: it fits
        assert at.chosen.name == rung.name
        assert [x.rung.name for x in at.rejected] == LADDER[:i]
        assert all(x.missing > 0 and "more than memory_limit" in x.reason() for x in at.rejected)
        below = rung.bytes - 1                               # a byte less: the next rung down
        if i + 1 < len(free.rungs):
            assert _choose(below, WALK).chosen.name == LADDER[i + 1]
        chosen.append(at.chosen.options())
    # TP, SP, SP with the column-parallel inputs as shards (Megatron's bytes), SP + selective, both, full
    assert chosen == [{"recompute": False, "sequence_parallel": False}, {"recompute": False, "sequence_parallel": True},
                      {"recompute": False, "sequence_parallel": "regather"},
                      {"recompute": "selective", "sequence_parallel": True},
                      {"recompute": "selective", "sequence_parallel": "regather"},
                      {"recompute": True, "sequence_parallel": True}]
    smallest = free.rungs[-1].bytes
    with pytest.raises(MemoryLimitError) as e:
        _choose(smallest - 3 * MiB, WALK)
    assert e.value.missing == pytest.approx(3 * MiB)
    msg = str(e.value)
    assert f"{3 * MiB} bytes (3.0 MiB) missing per rank" in msg and "TP + SP + full recompute" in msg
    assert "more GPUs" in msg and "microbatches=16" in msg       # b=2: a smaller microbatch is a way out


def test_flash_attention_leaves_selective_recompute_nothing_to_drop():
    """With flash attention no s x s matrix is kept, so selective recompute holds what SP holds, for
    more time: the choice goes from SP to SP with its inputs regathered, then straight to full recompute."""
    free = choose(SHAPE, 1e15, **MESH, cluster=DGX_A100, flash=True)
    by = {r.name: r for r in free.rungs}
    assert by["TP + SP + selective recompute"].bytes == by["TP + SP"].bytes
    assert by["TP + SP (regathered) + selective recompute"].bytes == by["TP + SP (regathered)"].bytes
    below_sp = choose(SHAPE, by["TP + SP"].bytes - 1, **MESH, cluster=DGX_A100, flash=True)
    assert below_sp.chosen.name == "TP + SP (regathered)"
    below = choose(SHAPE, by["TP + SP (regathered)"].bytes - 1, **MESH, cluster=DGX_A100, flash=True)
    assert below.chosen.name == "TP + SP + full recompute"


def test_each_stage_holds_its_own_microbatches_in_flight():
    """1F1B's first stage holds p microbatches of its layers, the last one (and the logits): one choice
    runs on every stage, and ``per_stage`` says what each would take alone."""
    free = _choose(1e15)
    fastest = free.rungs[0]
    first, last = fastest.stage_bytes
    assert first > last
    between = _choose((first + last) / 2)
    alone = between.per_stage()
    assert alone[1].name == fastest.name and alone[0].name != fastest.name
    assert between.chosen is not fastest and "Each stage alone" in "\n".join(between.lines())
    # the chosen recompute runs only where it is needed: the last stage fits without it
    assert between.chosen.recompute != "none" and between.recompute_stages == (0,)
    assert between.options()["recompute_stages"] == (0,) and "only on stage(s) 0" in between.summary()
    assert "stage 1: none" in "\n".join(between.lines())
    assert _choose(1e15).recompute_stages is None                          # nothing recomputes
    tight = _choose(min(r.bytes for r in free.rungs if r.recompute == "none") / 2)
    assert tight.recompute_stages in (None, (0,))                         # every stage, or still only the first


def test_recompute_stages_limits_the_regions_to_those_stages():
    """``recompute_stages``: the full and selective recompute passes keep only the regions of the pipeline
    ranks named (a 4-layer GPT cut in two: layers 0-1 on rank 0, 2-3 on rank 1; interleaved, by rank)."""
    from autoshard.ir.meta import RECOMPUTE_PLAN
    _, idx, tgt = _gpt()
    model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=4, vocab_size=64, block_size=16, flash=False))

    def layers(recompute, stages):
        prog = autoshard.compile_pipeline(model, {"pp": 2}, 0, (idx, tgt), {}, options=autoshard.CompileOptions(
            loss_only=True, recompute=recompute, recompute_stages=stages,
            pipeline=autoshard.PipelineOptions(microbatches=2, cuts=(2,))))
        return [r.layer for r in prog.gm.meta[RECOMPUTE_PLAN].regions]
    assert layers(True, None) == [0, 1, 2, 3]
    assert layers(True, (0,)) == [0, 1] and layers(True, (1,)) == [2, 3]
    assert layers("selective", (1,)) == [2, 3]
    # interleaved (v=2): rank 0 holds chunks 0 and 2, so layers 0 and 2
    prog = autoshard.compile_pipeline(model, {"pp": 2}, 0, (idx, tgt), {}, options=autoshard.CompileOptions(
        loss_only=True, recompute=True, recompute_stages=(0,), pipeline=autoshard.PipelineOptions(
            microbatches=2, schedule="interleaved", virtual_stages=2, cuts=(1, 2, 3))))
    assert [r.layer for r in prog.gm.meta[RECOMPUTE_PLAN].regions] == [0, 2]
    with pytest.raises(ValueError, match=r"recompute_stages=\(2,\): this program has 2 pipeline rank"):
        layers(True, (2,))
    with pytest.raises(ValueError, match="recompute_stages=.*tuple of ints"):
        autoshard.CompileOptions(recompute=True, recompute_stages=0)
    with pytest.raises(ValueError, match="with recompute=False"):
        autoshard.CompileOptions(recompute=False, recompute_stages=(0,))


def test_settings_the_user_gave_are_kept_and_only_checked():
    assert rungs_for(4, 2048, sp=False) == [("none", False), ("selective", False), ("full", False)]
    assert rungs_for(1, 2048) == [("none", False), ("selective", False), ("full", False)]
    assert rungs_for(4, 2048, recompute="full") == [("full", False), ("full", True)]
    free = _choose(1e15, WALK)
    sp_bytes = {r.name: r for r in free.rungs}["TP + SP"].bytes
    checked = _choose(1e15, WALK, recompute="none", sp=False)
    assert [r.name for r in checked.rungs] == ["TP alone"] and checked.fixed == ("recompute", "sequence_parallel")
    with pytest.raises(MemoryLimitError, match=r"TP alone \(recompute=False, sequence_parallel=False, as given\).*"
                                               r"Leave recompute and sequence_parallel out and memory_limit chooses TP \+ SP"):
        _choose(sp_bytes, WALK, recompute="none", sp=False)
    with pytest.raises(ValueError, match="sequence_parallel=True shards the sequence over tp, but tp=1"):
        choose(SHAPE, 1e15, tp=1, sp=True)
    with pytest.raises(ValueError, match="positive number"):
        _choose(0)


def _gpt(**kw):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, flash=False, **kw)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    return GPT(cfg), idx, tgt


def test_parallelize_applies_the_choice_and_trains_exactly(tmp_path, caplog):
    model, idx, tgt = _gpt()
    free = choose(model_shape(model, 16), 1e15, b=4, flash=False, activation_bytes=4)   # fp32 training
    assert [r.name for r in free.rungs] == ["no recompute", "selective recompute", "full recompute"]
    limit = (free.rungs[0].bytes + free.rungs[1].bytes) / 2
    ref = copy.deepcopy(model)
    _, want = ref(idx, tgt)
    want.backward()
    with caplog.at_level(logging.INFO, logger="autoshard"):
        pm = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (idx, tgt), loss_only=True, memory_limit=limit,
                                   dump=str(tmp_path))
    assert pm.memory_choice.chosen.name == "selective recompute" and pm.program.options.recompute == "selective"
    assert "memory_limit=" in caplog.text and "selective recompute" in caplog.text
    assert "## Memory limit" in (tmp_path / "plan.md").read_text()
    got = pm.step(idx, tgt)
    assert math.isclose(float(got.detach()), float(want.detach()), rel_tol=1e-5)
    grads = dict(ref.named_parameters())
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6)
    kept = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (idx, tgt), loss_only=True, memory_limit=limit,
                                 recompute=True)                 # the user's full recompute fits: kept
    assert kept.program.options.recompute is True and kept.memory_choice.fixed == ("recompute",)
    with pytest.raises(MemoryLimitError, match="recompute=False, as given.*chooses selective recompute"):
        autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (idx, tgt), memory_limit=limit, recompute=False)
    with pytest.raises(MemoryLimitError, match="bytes .* missing per rank"):
        autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (idx, tgt), memory_limit=free.rungs[-1].bytes - 1)


def test_the_choice_at_tp_2_is_sequence_parallel_and_exact():
    """At tp=2 the options ``parallelize`` would run (``memory_options``) turn SP (and selective recompute)
    on below TP alone's bytes; the program they compile reduce-scatters, and trains exactly."""
    model, idx, tgt = _gpt(dropout=0.0)
    spec = MeshSpec(tp=2)
    shape = model_shape(model, 16)
    free = choose(shape, 1e15, tp=2, b=4, flash=False, activation_bytes=4)
    limit = free.rungs[2].bytes                                  # TP + SP + selective fits exactly
    options = autoshard.compile_options(loss_only=True, memory_limit=limit)
    chosen, choice = memory_options(model, spec, (idx, tgt), {}, options)
    assert choice.chosen.name == "TP + SP + selective recompute"
    assert (chosen.recompute, chosen.sequence_parallel) == ("selective", True)
    prog = autoshard.compile_rank(model, spec, 0, (idx, tgt), options=dataclasses.replace(chosen, pipeline=None))
    assert comm_summary(prog.collectives)[0][("tp", "fwd", "reduce_scatter")] > 0
    ref = copy.deepcopy(model)
    want = ref(idx, tgt)[1]
    want.backward()
    for rank, (out, grads, _) in enumerate(simulate(model, 2, (idx, tgt), loss_fn=lambda o: o[1], loss_only=True,
                                                    **choice.options())):
        assert rel(out[1].detach(), want.detach()) <= 1e-5
        for n, p in ref.named_parameters():
            assert rel(grads[n], p.grad) <= 1e-5, (rank, n)


def test_a_model_the_planner_cannot_read_keeps_the_balancers_limit(caplog):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        pm = autoshard.parallelize(model, {"tp": 1}, (x,), memory_limit=1e9)
    assert pm.memory_choice is None and "bounds only the pipeline stages" in caplog.text
    assert pm(x).shape == (4, 1)


def test_plan_takes_a_memory_limit_below_the_clusters():
    """``autoshard.plan(memory_limit=...)``: a limit below the usable memory replaces it, so the winner
    fits it (with SP or recompute where it must); a limit above changes nothing."""
    shape = BUILTIN["gpt-1.7b"]
    free = plan(shape, 8, DGX_A100, global_batch=64)
    limit = free.best.memory_bytes * 0.6
    tight = plan(shape, 8, DGX_A100, global_batch=64, memory_limit=limit)
    assert tight.limit == limit and all(p.memory_bytes <= limit for p in tight.ranked)
    assert tight.best.step_seconds >= free.best.step_seconds
    assert any(p.memory_bytes > limit and "allowed (memory_limit)" in p.why for p in tight.too_big)
    roomy = plan(shape, 8, DGX_A100, global_batch=64, memory_limit=1e15)
    assert roomy.limit == DGX_A100.hbm_bytes * DGX_A100.usable_memory
    assert roomy.best.label() == free.best.label()
    with pytest.raises(ValueError, match="fits gpt-1.7b in 1.0 KiB per GPU"):
        plan(shape, 8, DGX_A100, global_batch=64, memory_limit=1024).best


def test_the_schedule_and_the_compute_dtype_set_the_activation_bytes():
    """GPipe holds every microbatch on every rank (1F1B p - r), ZB-H1 up to 1F1B's first rank's on every
    rank, ZB-H2 up to min(m, 2p - 1), and fp32 activations are twice bf16's: the ladder prices what the
    run will hold."""
    c = Candidate(1, 4, 1, 1, 8, recompute="none")
    one_f = [stage_memory(SHAPE, c, r, flash=False) for r in range(4)]
    gpipe = [stage_memory(SHAPE, c, r, flash=False, schedule="gpipe") for r in range(4)]
    zb = [stage_memory(SHAPE, c, r, flash=False, schedule="zb-h1") for r in range(4)]
    zb2 = [stage_memory(SHAPE, c, r, flash=False, schedule="zb-h2") for r in range(4)]
    fp32 = [stage_memory(SHAPE, c, r, flash=False, activation_bytes=4) for r in range(4)]
    logits = 2 * 4 * SHAPE.seq * SHAPE.vocab          # the last rank's fp32 logits and gradient, whatever the rest
    for r in range(4):
        extra = logits if r == 3 else 0
        assert gpipe[r].activations - extra == pytest.approx((one_f[r].activations - extra) * 8 / (4 - r))
        assert zb[r].activations - extra == pytest.approx((one_f[0].activations) * 1.0)
        assert zb2[r].activations - extra == pytest.approx(one_f[0].activations * 7 / 4)     # min(8, 2p - 1) = 7
        assert fp32[r].activations - extra == pytest.approx(2 * (one_f[r].activations - extra))
    assert choose(SHAPE, 1e15, pp=4, b=1, m=8, schedule="gpipe").chosen.bytes > choose(SHAPE, 1e15, pp=4, b=1, m=8).chosen.bytes


def test_compile_only_entry_points_choose_what_parallelize_chooses():
    """compile_pipeline(memory_limit=...) applies the ladder's choice, as parallelize does, so a dump made
    without processes is the program parallelize runs; compile_rank, which compiles no pipeline, refuses
    a limit instead of dropping it; an explicit sequence_parallel=False is the user's, only checked."""
    model, idx, tgt = _gpt()
    free = choose(model_shape(model, 16), 1e15, b=4, flash=False, activation_bytes=4)
    limit = (free.rungs[0].bytes + free.rungs[1].bytes) / 2
    pm = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (idx, tgt), loss_only=True, memory_limit=limit)
    prog = autoshard.compile_pipeline(copy.deepcopy(model), {"tp": 1}, 0, (idx, tgt), memory_limit=limit)
    assert prog.options.recompute == pm.program.options.recompute == "selective"
    with pytest.raises(ValueError, match="compile_rank\\(memory_limit=...\\).*compile with compile_pipeline"):
        autoshard.compile_rank(model, {"tp": 1}, 0, (idx, tgt), memory_limit=limit)
    from autoshard.planned import user_memory_settings
    assert user_memory_settings(dict(sequence_parallel=False, memory_limit=1e12), None, None) == {"sequence_parallel"}
    assert user_memory_settings(dict(recompute="auto", memory_limit=1e12), None, None) == set()


@pytest.mark.parametrize("bad", ["8GB", float("nan"), True, -1, float("inf")])
def test_a_memory_limit_that_is_not_bytes_is_refused(bad):
    with pytest.raises(ValueError, match="memory_limit=.*give the bytes a rank may hold"):
        autoshard.compile_options(memory_limit=bad)


@pytest.mark.parametrize("flag", [1, 0, 1.0])
def test_an_int_recompute_flag_is_refused_not_read_as_off(flag):
    """recompute=1 equals True but is not True: every pass that tests ``is True`` would skip it (and a
    memory limit count it as full recompute)."""
    with pytest.raises(ValueError, match=f"recompute={flag!r}"):
        autoshard.compile_options(recompute=flag)
    with pytest.raises(ValueError, match=f"sequence_parallel={flag!r}"):
        autoshard.compile_options(sequence_parallel=flag)
