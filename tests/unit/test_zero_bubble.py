"""Zero-bubble pipelines without processes: the ZB-H1 schedule as data (its bubble and memory against
the closed forms, in exact Fractions), the split of backward into B and W (``ir/weight_grad.py``), and
the pass that makes each parameter matmul's weight gradient wait for W (``passes/weight_grad.py``)."""
import weakref
from fractions import Fraction

import pytest
import torch

from autoshard.ir.options import CompileOptions, PipelineOptions
from autoshard.ir.schedule import W_MEMORY, Action, Kind, Schedule, add_communication, make_schedule, one_f_one_b, validate
from autoshard.ir.zero_bubble import zero_bubble_h1
from autoshard.ir.simulator import Costs, simulate
from autoshard.ir.weight_grad import WeightGrads, deferred_linear, deferring, splitting
from tests.unit.test_pipeline_compile import compile_pp
from tests.harness.models import batch, build

CASES = [(pp, m) for pp in (2, 3, 4, 8) for m in (pp, 2 * pp, 4 * pp)] + [(4, 6), (2, 1), (1, 3)]


def costs(pp, activation_bytes=0):
    """F = 1, B = 1, W = 1 per stage (the paper's assumption): a backward of 2, split in halves."""
    return Costs.uniform(pp, Fraction(1), Fraction(2), activation_bytes)


@pytest.mark.parametrize("pp,m", CASES)
def test_zb_h1_is_a_valid_split_schedule(pp, m):
    check_split_schedule(zero_bubble_h1(pp, m), "zb-h1", pp, m)


def check_split_schedule(s, name, pp, m):
    """A valid split schedule that ``make_schedule(name)`` gives, whose text round-trips once lowered,
    with each F, B and W once a microbatch in order and every W after its own B."""
    assert s.split and make_schedule(name, pp, m, 1).text() == s.text()
    validate(s)
    lowered = add_communication(s)
    validate(lowered)
    assert Schedule.from_text(lowered.text()) == lowered
    for r, acts in s.actions.items():
        for kind in (Kind.F, Kind.B, Kind.W):      # each once, in microbatch order (sends match receives)
            assert [a.microbatch for a in acts if a.kind is kind] == list(range(m))
        for a in acts:        # a W after its own B
            if a.kind is Kind.W:
                assert acts.index(Action(r, Kind.B, a.microbatch)) < acts.index(a)
    assert not any(a.kind is Kind.W and a.kind.value in ("SEND", "RECV") for acts in lowered.actions.values()
                   for a in acts)


@pytest.mark.parametrize("pp,m", [c for c in CASES if c[1] >= c[0]])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(pp, m):
    """Qi et al.: 1F1B idles (p-1)(F+B+W) a rank, ZB-H1 (p-1)(F+B-W): a third of it when F = B = W."""
    zb, base = simulate(zero_bubble_h1(pp, m), costs(pp)), simulate(one_f_one_b(pp, m), costs(pp))
    assert base.step_time == 3 * m + (pp - 1) * 3
    assert zb.step_time == 3 * m + (pp - 1) * 1
    assert zb.busy == base.busy == {r: 3 * m for r in range(pp)}
    assert zb.bubble_over_ideal == base.bubble_over_ideal / 3 == Fraction(pp - 1, 3 * m)
    labels = {span.action.kind for spans in zb.spans.values() for span in spans}
    assert Kind.W in labels


@pytest.mark.parametrize("pp,m", CASES)
def test_zb_h1_holds_no_more_than_1f1b(pp, m):
    """Activations from F to B, ``W_MEMORY`` of them from B to W: no rank above 1F1B's peak (its first
    rank's), the paper's ZB-H1 promise."""
    zb = simulate(zero_bubble_h1(pp, m), costs(pp, activation_bytes=1000))
    base = simulate(one_f_one_b(pp, m), costs(pp, activation_bytes=1000))
    assert max(zb.peak_activation_bytes.values()) <= max(base.peak_activation_bytes.values())
    promised = validate(zero_bubble_h1(pp, m))
    assert all(zb.peak_activation_bytes[r] <= 1000 * promised[r] for r in range(pp))
    assert 0 < W_MEMORY <= 1


def test_w_svg_has_its_own_colour(tmp_path):
    path = tmp_path / "zb.svg"
    simulate(zero_bubble_h1(2, 4), costs(2)).to_svg(str(path))
    text = path.read_text()
    assert "0W3" in text and "#54a24b" in text


@pytest.mark.parametrize("transposed", [False, True])
def test_deferred_linear_leaves_dw_for_w_and_matches_autograd(transposed):
    torch.manual_seed(0)
    w = torch.randn(4, 6, requires_grad=True) if transposed else torch.randn(6, 4, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    x = torch.randn(2, 3, 4, requires_grad=True)

    def weight():       # a cast on the way, as a bf16 or padded parameter input has
        return w.to(torch.float64).to(torch.float32)
    ((x @ weight() + b) if transposed else torch.nn.functional.linear(x, weight(), b)).square().sum().backward()
    want = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    kept = WeightGrads()
    with splitting():                                                         # F of a split microbatch
        y = deferred_linear(x, weight(), b, transposed)
    with deferring(kept):                                                     # its B
        y.square().sum().backward()
    assert w.grad is None and x.grad is not None and b.grad is not None    # B: the input's and the bias's
    assert len(kept.items) == 1 and kept.nbytes > 0
    kept.run()                                                                # W
    for got, ref in zip((x.grad, w.grad, b.grad), want):
        torch.testing.assert_close(got, ref)
    x.grad = w.grad = b.grad = None       # not splitting (an eval, a backward run whole): ATen's linear
    deferred_linear(x, weight(), b, transposed).square().sum().backward()
    torch.testing.assert_close(w.grad, want[1])
    with splitting():                     # split, but its backward outside B: an error, never a lost dW
        y = deferred_linear(x, weight(), b, transposed)
    with pytest.raises(RuntimeError, match="outside its B"):
        y.sum().backward()


def test_a_split_matmul_inside_a_recompute_region_saves_its_input_through_autograd():
    """Non-reentrant checkpoint drops what autograd saves and runs the region again in backward: the
    matmul's input must be among those (not held aside), and W still gets the recomputed (x, dy)."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    w1, w2 = torch.randn(16, 8, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    inner = []

    def region(h, split):
        lin = deferred_linear if split else torch.nn.functional.linear
        g = torch.nn.functional.gelu(lin(h, w1))
        inner.append(weakref.ref(g))
        return lin(g, w2)
    checkpoint(region, x, False, use_reentrant=False).square().sum().backward()
    want = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    packed = []
    with splitting(), torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = checkpoint(region, x, True, use_reentrant=False)
    assert all(t is x or t.data_ptr() == x.data_ptr() for t in packed)   # only the region's input is kept
    assert inner[-1]() is None            # the second matmul's input is not held aside: recompute frees it
    kept = WeightGrads()
    with deferring(kept):
        y.square().sum().backward()
    assert len(kept.items) == 2 and w1.grad is None
    kept.run()
    for got, ref in zip((x.grad, w1.grad, w2.grad), want):
        torch.testing.assert_close(got, ref)


def test_the_pass_defers_every_parameter_matmul():
    from autoshard.ir.weight_grad import WEIGHT_GRAD_PLAN
    model = build("gpt", n_layer=2)
    prog = compile_pp(model, *batch("gpt", 96, B=4), schedule="zb-h1")
    plan = prog.gm.meta[WEIGHT_GRAD_PLAN]
    deferred = {d.parameter for d in plan.deferred}
    for i in range(2):
        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            assert f"transformer.h.{i}.{name}.weight" in deferred
    assert "transformer.h.0.ln_1.weight" in plan.in_b and "transformer.h.0.ln_1.weight" not in deferred
    targets = [n.target for n in prog.gm.graph.nodes if n.op == "call_function"]
    assert targets.count(deferred_linear) == len(plan.deferred)
    assert prog.schedule.split
    plain = compile_pp(build("gpt", n_layer=2), *batch("gpt", 96, B=4), schedule="1f1b")
    assert WEIGHT_GRAD_PLAN not in plain.gm.meta and not plain.schedule.split


def test_tensor_parallel_matmuls_defer_too():
    from autoshard.ir import ops
    from autoshard.ir.weight_grad import WEIGHT_GRAD_PLAN
    prog = compile_pp(build("gpt", n_layer=2), *batch("gpt", 96, B=4), mesh={"pp": 2, "tp": 2}, schedule="zb-h1")
    column = [m for m in prog.gm.modules() if isinstance(m, ops.ColumnParallelMatmul)]
    assert column and all(m.defer_weight for m in column)
    assert len(prog.gm.meta[WEIGHT_GRAD_PLAN].deferred) >= 8


def test_zero_bubble_with_inductor_is_refused_with_the_fix():
    import autoshard
    with pytest.raises(ValueError, match="codegen='autoshard' or schedule='1f1b'"):
        CompileOptions(codegen="inductor", pipeline=PipelineOptions(microbatches=4, schedule="zb-h1"))
    with pytest.raises(ValueError, match="codegen='autoshard' or schedule='1f1b'"):     # as parallelize's keywords
        autoshard.compile_options(codegen="inductor", microbatches=4, schedule="zb-h1")


@pytest.mark.parametrize("costs", [dict(f=0), dict(w=0), dict(b=0), dict(f=[1, 0, 1], b=[1, 0, 0], w=[0, 0, 1])])
def test_zb_h1_takes_free_actions(costs):
    """An action of no cost (an empty stage, a W with nothing to do) makes others ready at the same time."""
    validate(add_communication(zero_bubble_h1(3, 6, **costs)))


@pytest.mark.parametrize("split_cost", [0.25, 0.0])
def test_auto_picks_the_shortest_simulated_step_and_says_why(split_cost):
    """``schedule="auto"`` prices 1F1B and ZB-H1 on the same cuts, and ZB-V on its own 2p stages, and runs
    the fastest: its predicted step is the least of the three, which compiled on their own predict. With
    a costly split backward (a quarter more) 1F1B wins here; with a free split and runtime (no cost an
    action or a send: a GPU's, unmeasured), ZB-V."""
    import dataclasses
    import autoshard
    from autoshard.ir.options import CostModel
    model, args = build("gpt", n_layer=4), batch("gpt", 96, B=8)
    cm = dataclasses.replace(CostModel.cpu(), weight_split_overhead=split_cost)
    if not split_cost:
        cm = dataclasses.replace(cm, action_overhead=0.0, send_blocking=0.0)

    def compiled(name):
        options = CompileOptions(cost_model=cm, pipeline=PipelineOptions(microbatches=8, schedule=name))
        return autoshard.compile_pipeline(model, {"pp": 2}, 0, *args, options)
    steps = {name: compiled(name).plan.predicted_step for name in ("1f1b", "zb-h1", "zb-v")}
    auto = compiled("auto")
    chosen = auto.schedule.name
    assert chosen == ("1f1b" if split_cost else "zb-v")
    assert auto.plan.predicted_step == pytest.approx(min(steps.values())) == pytest.approx(steps[chosen])
    assert all(name in auto.plan.schedule_choice for name in steps)
    assert auto.schedule.split == (chosen != "1f1b") and len(auto.chunks) == (4 if chosen == "zb-v" else 2)
    options = CompileOptions(codegen="inductor", pipeline=PipelineOptions(microbatches=8, schedule="auto"))
    whole = autoshard.compile_pipeline(model, {"pp": 2}, 0, *args, options)
    assert not whole.schedule.split and "inductor" in whole.plan.schedule_choice


def test_zb_h1_keeps_each_rank_within_1f1bs_whole_peak():
    """With stages of unequal activations and parameters (an LM head on the last), the generator holds
    back W only where the rank's parameters plus what it holds stay under 1F1B's highest rank."""
    pp, m = 4, 8
    act, resident = [4.0, 4.0, 4.0, 6.0], [10.0, 8.0, 8.0, 14.0]
    s = zero_bubble_h1(pp, m, activation=act, resident=resident)
    costs = Costs((1,) * pp, (2,) * pp, tuple(act))
    zb, base = simulate(s, costs), simulate(one_f_one_b(pp, m), costs)
    whole = {r: zb.peak_activation_bytes[r] + resident[r] for r in range(pp)}
    assert max(whole.values()) <= max(base.peak_activation_bytes[r] + resident[r] for r in range(pp)) + 1e-9
    assert zb.step_time < base.step_time


def test_the_dp_reducer_arms_b_gradients_at_the_last_b_and_w_gradients_at_the_last_w():
    """A bucket holding a norm's weight (final at the stage's last B) and a matmul's (final at its last
    W) launches at that W, during the step: not before (a gradient still to come) and not only at the
    end (the all-reduce exposed)."""
    from autoshard.runtime.data_parallel import GradReducer
    from autoshard.runtime.executor import arming_points

    class Comm:
        launched = []

        def all_reduce_async(self, flat, where):
            Comm.launched.append(flat.clone())
            return type("Work", (), {"wait": lambda self: None})()
    leaves = {"norm": torch.zeros(4, requires_grad=True), "fc": torch.zeros(4, 4, requires_grad=True)}
    reducer = GradReducer(Comm(), leaves, {0: ["norm", "fc"]}, bucket_bytes=1 << 20, late=frozenset({"fc"}))
    s = zero_bubble_h1(2, 3)
    acts = s.actions[1]                                   # the last stage: its B and W are split
    arms = arming_points(acts, {(a.stage, a.microbatch) for a in acts if a.kind is Kind.W})
    assert arms[acts[max(i for i, a in enumerate(acts) if a.kind is Kind.B)]] == ["B"]
    assert arms[acts[-1]] == ["W"] and acts[-1].kind is Kind.W
    reducer.begin_step(grads_still_held=False)
    for a in acts:                                        # B accumulates the norm's, W the matmul's
        for phase in arms.get(a, ()):
            reducer.arm(0, phase)                         # (the one stage this reducer holds)
        if a.kind is Kind.B:
            (leaves["norm"] * 1.0).sum().backward()
        elif a.kind is Kind.W:
            assert not Comm.launched                      # not before the matmul's last gradient
            (leaves["fc"] * 1.0).sum().backward()
    assert len(Comm.launched) == 1                        # launched at the last W, before finish()
    torch.testing.assert_close(Comm.launched[0], torch.full((20,), 3.0))


# ------------------------------------------------------------------------------------------------ ZB-V

@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (2, 8), (3, 5), (4, 4), (4, 8), (4, 16)])
def test_zb_v_is_valid_and_near_zero_bubble_at_1f1bs_peak(pp, m):
    """ZB-V (two stages a rank in a V): every action once, in dependency order, transfers matched; with
    F = B = W per chunk (half a stage's 1F1B costs), the step is within (p - 1)/2 chunk-F of the ideal
    3 m (1F1B idles 2(p - 1) of a stage's F + B), and no rank holds more than 1F1B's first rank."""
    from autoshard.ir.zero_bubble import zero_bubble_v
    s = zero_bubble_v(pp, m)
    assert s.placement == "v" and s.split and s.virtual == 2
    assert all(s.rank_of(r) == r and s.rank_of(2 * pp - 1 - r) == r for r in range(pp))
    validate(add_communication(s))
    chunk = Costs((0.5,) * (2 * pp), (1.0,) * (2 * pp), (1,) * (2 * pp))
    v = simulate(s, chunk)
    one = simulate(one_f_one_b(pp, m), Costs((1.0,) * pp, (2.0,) * pp, (2,) * pp))
    assert v.step_time <= 3 * m + (pp - 1) * 0.5 + 1e-9
    assert one.step_time == 3 * m + 3 * (pp - 1)
    assert max(v.peak_activation_bytes.values()) <= max(one.peak_activation_bytes.values())
    assert Schedule.from_text(s.text()).rank_of(2 * pp - 1) == 0       # the text keeps the V


def test_zb_v_options_and_its_receives_in_send_order():
    """``schedule="zb-v"`` sets v = 2 (any other v is an error). Rank 0 sends stage 0's F and stage 3's B to
    rank 1 on one channel: the lowering receives them in the order they were sent."""
    from autoshard.ir.options import PipelineOptions
    from autoshard.ir.zero_bubble import zero_bubble_v
    assert PipelineOptions(microbatches=4, schedule="zb-v").virtual_stages == 2
    with pytest.raises(ValueError, match="two stages on each rank"):
        PipelineOptions(microbatches=4, schedule="zb-v", virtual_stages=3)
    lowered = add_communication(zero_bubble_v(2, 4))
    recvs = [a for a in lowered.actions[1] if a.kind in (Kind.RECV_F, Kind.RECV_B)]
    sends = [a for a in lowered.actions[0] if a.kind in (Kind.SEND_F, Kind.SEND_B)]
    from autoshard.ir.schedule import _matching_send
    assert [_matching_send(a) for a in recvs] == sends       # rank 1 receives in rank 0's send order
    assert {a.kind for a in sends} == {Kind.SEND_F, Kind.SEND_B}    # both directions' traffic on one channel
    validate(lowered)


def test_zb_v_with_a_heavier_head_chunk_keeps_its_bubble_small():
    """Chunks of unequal activations (the LM head's last chunk, on the V's rank 0 beside the embedding; the
    heavier middle pair on rank 1): every rank may hold p microbatches of the heaviest pair, so the middle
    rank does not stall on the first layers' cap. Chunk bytes are the built-in GPT's at pp=2 on its balanced
    cuts; F = B = W per chunk."""
    from autoshard.ir.zero_bubble import zero_bubble_v
    act = (2.29, 2.23, 2.69, 2.36)
    s = zero_bubble_v(2, 8, activation=list(act))
    tl = simulate(s, Costs((0.5,) * 4, (1.0,) * 4, act))
    assert tl.step_time <= 3 * 8 + 0.5 + 1e-9
    pairs = [act[0] + act[3], act[1] + act[2]]
    assert max(tl.peak_activation_bytes.values()) <= 2 * max(pairs) + 1e-9


@pytest.mark.parametrize("pp,m", CASES)
def test_zb_h2_is_valid_holds_its_deeper_warm_up_and_steps_as_zb_h1_when_f_b_w_are_equal(pp, m):
    """ZB-H2: rank r holds up to 2 (p - r) - 1 microbatches between F and B (about twice 1F1B's peak);
    within one synchronous step, with F = B = W, it takes ZB-H1's step (the last stage waits (p - 1) F
    and then has 3m of work)."""
    from autoshard.ir.zero_bubble import zero_bubble_h2
    s = zero_bubble_h2(pp, m)
    check_split_schedule(s, "zb-h2", pp, m)
    for r, acts in s.actions.items():
        in_flight = most = 0
        for a in acts:
            in_flight += {Kind.F: 1, Kind.B: -1}.get(a.kind, 0)
            most = max(most, in_flight)
        assert most <= min(m, 2 * (pp - r) - 1)
    h2, h1 = simulate(s, costs(pp, 1000)), simulate(zero_bubble_h1(pp, m), costs(pp, 1000))
    assert h2.step_time == h1.step_time
    assert max(h2.peak_activation_bytes.values()) <= 1000 * min(m, 2 * pp - 1)
    if m >= 2 * pp - 1 and pp > 1:
        assert max(h2.peak_activation_bytes.values()) > max(h1.peak_activation_bytes.values())


def test_zb_h2_beats_zb_h1_where_b_outweighs_w():
    """With B = 2, W = 1 (the ops between the matmuls in B: on the CI host a stage measured B 6.14 and W
    1.87 ms) ZB-H1 leaves (p - 1)(F + B - W) of bubble; ZB-H2's extra warm-up forwards fill part of it."""
    from autoshard.ir.zero_bubble import zero_bubble_h2
    pp, m = 4, 8
    c = Costs((1,) * pp, (3,) * pp, (1,) * pp, weight=(1,) * pp)
    h1 = simulate(zero_bubble_h1(pp, m, b=2, w=1), c)
    h2 = simulate(zero_bubble_h2(pp, m, b=2, w=1), c)
    assert h1.step_time == 4 * m + (pp - 1) * 2 == 38
    assert h2.step_time == 35 < h1.step_time


def test_auto_tries_zb_h2_only_where_a_memory_limit_checks_it():
    """ZB-H2 holds about twice 1F1B's activations: ``schedule="auto"`` prices it only under a
    ``memory_limit``, runs it where it is the fastest that fits, and passes over it where it does not
    (priced with a free split and runtime, where ZB-H2 is the fastest here)."""
    import dataclasses
    import autoshard
    from autoshard.ir.options import CostModel
    model, args = build("gpt", n_layer=4, block_size=64), batch("gpt", 96, B=16, T=64)   # activations weigh
    cm = dataclasses.replace(CostModel.cpu(), weight_split_overhead=0.0, action_overhead=0.0, send_blocking=0.0)

    def compiled(name="auto", **pipeline):
        options = CompileOptions(cost_model=cm,
                                 pipeline=PipelineOptions(microbatches=8, schedule=name, **pipeline))
        return autoshard.compile_pipeline(model, {"pp": 2}, 0, *args, options)
    assert "zb-h2" not in compiled().plan.schedule_choice
    plans = {name: compiled(name, memory_limit=2**30).plan for name in ("1f1b", "zb-h1", "zb-h2")}
    peaks = {name: max(p.predicted_peak_bytes.values()) for name, p in plans.items()}
    fastest = min(plans, key=lambda name: plans[name].predicted_step)
    roomy = compiled(memory_limit=2**30)
    assert fastest == "zb-h2" and "zb-h2" in roomy.plan.schedule_choice and roomy.schedule.name == "zb-h2"
    assert roomy.plan.predicted_step == pytest.approx(plans["zb-h2"].predicted_step)
    assert peaks["zb-h2"] > peaks["zb-h1"]
    tight = compiled(memory_limit=(peaks["zb-h1"] + peaks["zb-h2"]) / 2)
    assert tight.schedule.name == "zb-h1" and "over memory_limit" in tight.plan.schedule_choice


def test_a_chunked_lm_head_prices_its_weight_gradient_in_b():
    """The chunked loss computes the LM head's weight gradient with the loss, in a split schedule's B: the
    stage balancer prices it there, not in W (the embedding's stage is unchanged)."""
    import autoshard
    from autoshard.ir.options import CostModel
    model, args = build("gpt", n_layer=4, tie_weights=False), batch("gpt", 96, B=8)

    def weights(rows):
        options = CompileOptions(cost_model=CostModel.cpu(), loss_chunk_rows=rows,
                                 pipeline=PipelineOptions(microbatches=4, schedule="zb-h1"))
        return [c.weight_seconds for c in autoshard.compile_pipeline(model, {"pp": 2}, 0, *args, options).plan.costs]
    whole, chunked = weights(None), weights(4)
    assert chunked[0] == whole[0] and 0 < chunked[1] < whole[1]
