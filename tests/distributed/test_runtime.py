"""The ParallelModule as a user meets it: loss-only runs, full state dicts both ways, models on meta,
the collective tracer against the plan, and bounded timeouts. One 2-rank process group for all."""
import copy
import os
import time

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.models import GPT, GPTConfig
from autoshard.ir.program import comm_summary
from tests.harness.distributed import run_distributed
from tests.harness.models import batch, build


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _runtime(rank, world):
    out = {}
    mesh = autoshard.init_mesh(tp=world)
    args, _ = batch("gpt", 96)
    model = build("gpt")
    ref = copy.deepcopy(model)
    _, rloss = ref(*args)

    pm = autoshard.parallelize(model, mesh, example_args=args, loss_only=True)
    logits, loss = pm(*args)
    out["loss_only: logits"] = logits
    out["loss_only: loss"] = rel(loss.detach(), rloss.detach())

    # the tracer counts what the plan says, call for call and byte for byte
    pm.reset_comm_counts()
    pm(*args)[1].backward()
    planned_calls, planned_bytes = comm_summary(pm.program.collectives)
    calls, nbytes = pm.comm_counts()
    out["tracer calls"] = (dict(calls), planned_calls)
    out["tracer bytes"] = (dict(nbytes), planned_bytes)

    # full state dict -> the single-device model, strict, tied names included
    for p in pm.parameters():
        p.data.add_(0.001)  # move away from the seed so the round trip is not trivially equal
    fresh = build("gpt")
    fresh.load_state_dict(pm.full_state_dict(), strict=True)
    out["full_state_dict -> single device"] = rel(pm(*args)[1].detach(), fresh(*args)[1].detach())

    # a single-device state dict -> the sharded model
    other = build("gpt", vocab_size=96)
    torch.manual_seed(123)
    for p in other.parameters():
        p.data.normal_(0, 0.05)
    pm.load_full_state_dict(other.state_dict())
    out["load_full_state_dict"] = rel(pm(*args)[1].detach(), other(*args)[1].detach())

    # a model built on meta compiles without its weights, then loads them
    with torch.device("meta"):
        meta_model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=96))
    pm_meta = autoshard.parallelize(meta_model, mesh, example_args=args)
    assert all(not p.is_meta for p in pm_meta.parameters())
    pm_meta.load_full_state_dict(ref.state_dict())
    out["meta model"] = rel(pm_meta(*args)[1].detach(), rloss.detach())

    # ranks that disagree are told so, on every rank, before any training collective runs
    torch.manual_seed(rank)  # a forgotten common seed: each rank draws other weights
    try:
        autoshard.parallelize(GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=16)), mesh, example_args=args)
        out["unseeded"] = None
    except RuntimeError as e:
        out["unseeded"] = str(e)
    # ... also between dp replicas and between the pipeline stages holding a tied weight; and copies that
    # drift apart later are found by check_replicas on those axes too
    double = tuple(torch.cat([a] * 2) for a in args)
    small = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=96)

    def drifted(axis):
        """A pm on ``axis`` built alike on every rank, then rank 1's copy of the embedding moved."""
        torch.manual_seed(0)
        pm_axis = autoshard.parallelize(GPT(GPTConfig(**small)), autoshard.init_mesh(**{axis: world}), double,
                                        microbatches=2)
        if rank == 1:
            with torch.no_grad():
                pm_axis.local_parameters()["transformer.wte.weight"].to_local().add_(1e-3)
        return pm_axis

    for axis in ("dp", "pp"):
        torch.manual_seed(rank)
        try:
            autoshard.parallelize(GPT(GPTConfig(**small)), autoshard.init_mesh(**{axis: world}), double, microbatches=2)
            out[f"unseeded {axis}"] = None
        except RuntimeError as e:
            out[f"unseeded {axis}"] = str(e)
        pm_axis = drifted(axis)
        try:
            pm_axis.check_replicas()
            out[f"drift {axis}"] = None
        except RuntimeError as e:
            out[f"drift {axis}"] = str(e)
        # AUTOSHARD_CHECK_REPLICAS=N checks every N-th pm.step (the only way to train at dp or pp > 1)
        os.environ["AUTOSHARD_CHECK_REPLICAS"] = "2"
        steps = 0
        try:
            pm_env = drifted(axis)
            for _ in range(3):
                pm_env.step(*double)
                steps += 1
            out[f"drift {axis} every 2 steps"] = None
        except RuntimeError as e:
            out[f"drift {axis} every 2 steps"] = (steps, str(e))
        finally:
            del os.environ["AUTOSHARD_CHECK_REPLICAS"]
    other_args = tuple(a[:, :4].contiguous() for a in args) if rank == 1 else args  # another shape on rank 1
    try:
        autoshard.parallelize(build("gpt"), mesh, example_args=other_args)
        out["other plan"] = None
    except RuntimeError as e:
        out["other plan"] = str(e)

    # a data-loader slip (each rank of one replica given other rows) is an error on every rank, not a wrong loss
    theirs = batch("gpt", 96, seed=2)[0] if rank == 1 else args
    for name, make, call in (
            ("tp batch", lambda: autoshard.parallelize(build("gpt"), mesh, example_args=args), lambda m: m(*theirs)),
            ("pp batch", lambda: autoshard.parallelize(build("gpt", n_layer=2), autoshard.init_mesh(pp=world),
                                                       example_args=(torch.cat([args[0]] * 2),
                                                                     torch.cat([args[1]] * 2)), microbatches=2),
             lambda m: m.step(torch.cat([theirs[0]] * 2), torch.cat([theirs[1]] * 2)))):
        try:
            call(make())
            out[name] = None
        except RuntimeError as e:
            out[name] = str(e)
    out["data_parallel_rank"] = autoshard.data_parallel_rank(mesh)

    # a mesh that does not cover the world fails before any collective
    try:
        autoshard.init_mesh(tp=4)
        out["mesh mismatch"] = None
    except ValueError as e:
        out["mesh mismatch"] = str(e)
    return out


def test_runtime_features():
    results = run_distributed(_runtime, 2, timeout=300)
    for rank, out in enumerate(results):
        assert out["loss_only: logits"] is None
        for key in ("loss_only: loss", "full_state_dict -> single device", "load_full_state_dict", "meta model"):
            assert out[key] <= 1e-5, (rank, key, out[key])
        measured, planned = out["tracer calls"]
        assert measured == planned and sum(measured.values()) > 0
        measured, planned = out["tracer bytes"]
        assert measured == planned
        assert "world has 2" in out["mesh mismatch"] and "tp=4" in out["mesh mismatch"]
        for case in ("unseeded", "unseeded dp", "unseeded pp"):
            assert "weights on rank 1 differ from rank 0's" in out[case] and "torch.manual_seed" in out[case], out[case]
        assert "between the 2 data-parallel replicas: ['transformer.wte.weight'" in out["drift dp"], out["drift dp"]
        for axis in ("dp", "pp"):     # raised on the second step, on every rank
            steps, message = out[f"drift {axis} every 2 steps"]
            assert steps == 1 and "transformer.wte.weight" in message, (axis, steps, message)
        assert "between the 2 pipeline stages holding the tied weight: ['transformer.wte.weight']" in out["drift pp"], \
            out["drift pp"]
        assert "compiled different plans" in out["other plan"], out["other plan"]
        assert "tp ranks were given different batches" in out["tp batch"], out["tp batch"]
        assert "pp ranks were given different batches" in out["pp batch"], out["pp batch"]
        assert "data_parallel_rank" in out["tp batch"] and out["data_parallel_rank"] == (0, 1)


def _first_programs_at_dp2(rank, world):
    """Which program parallelize compiles first at dp=2, pp=1, and that each module then runs."""
    from autoshard.ir.pipeline import PipelineProgram
    from autoshard.ir.program import Program
    mesh = autoshard.init_mesh(dp=world)
    (idx, tgt), _ = batch("gpt", 96, B=2 * world)
    idx, tgt = autoshard.local_batch(((idx, tgt), {}), mesh)[0]
    out = {}
    model = build("gpt")
    pm = autoshard.parallelize(copy.deepcopy(model), mesh, (idx, tgt))       # trains with pm.step: its program
    out["training"] = (isinstance(pm.program, PipelineProgram), pm.captures.traced)
    ref = copy.deepcopy(model).eval()
    for name, train, args in (("logits only", True, (idx,)), ("eval mode", False, (idx, tgt))):
        pm = autoshard.parallelize(copy.deepcopy(model).train(train), mesh, args)   # no step to train: a forward
        pm.eval()
        with torch.no_grad():
            got, want = pm(*args)[0], ref(*args)[0]
        out[name] = (type(pm.program) is Program, rel(got, want))
    return out


def test_the_first_program_at_dp2_is_the_step_unless_the_example_call_cannot_step():
    """At dp > 1 pm(...) does not train, so parallelize compiles the training step program first; an
    example call without a loss (logits only) or a model in eval mode compiles the forward program, and
    its eval forwards match the single-device model."""
    for out in run_distributed(_first_programs_at_dp2, 2, timeout=300):
        assert out["training"] == (True, 1)
        for name in ("logits only", "eval mode"):
            assert out[name][0] and out[name][1] <= 1e-5, (name, out[name])


def _unread_parameter(rank, world, mesh_kw):
    """An HF Llama with a head its loss never reads (a value head), trained 2 AdamW steps on ``mesh_kw``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, use_cache=False))
    model.value_head = torch.nn.Linear(32, 7)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(1))
    mesh = autoshard.init_mesh(**mesh_kw)
    local = autoshard.local_batch(dict(input_ids=ids, labels=ids), mesh)
    pm = autoshard.parallelize(model, mesh, example_kwargs=local, microbatches=2 if mesh_kw.get("pp") else 1)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        pm.step(**local)
        opt.step()
        opt.zero_grad()
        ref(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = pm.full_state_dict()
    pm.eval()
    ref.eval()
    with torch.no_grad():
        eval_rel = rel(pm.eval_batch(**local), ref(input_ids=ids, labels=ids).loss)
    return (sorted(set(ref.state_dict()) ^ set(full)),
            max(rel(full[k], v) for k, v in ref.state_dict().items() if k in full), eval_rel,
            bool(torch.equal(full["value_head.weight"], ref.value_head.weight)))


@pytest.mark.parametrize("mesh_kw", [dict(dp=2), dict(pp=2)])
def test_a_parameter_the_loss_never_reads_is_kept_and_left_alone(mesh_kw):
    """The step program (first at dp > 1, and at pp > 1) cuts stages from what the loss reads; a parameter
    nothing reads is still the module's: in full_state_dict (which loads strictly into the model), in
    checkpoints, and left untouched by AdamW (no gradient, as on one device). Eval forwards compile."""
    for differ, worst, eval_rel, untouched in run_distributed(_unread_parameter, 2, mesh_kw, timeout=300):
        assert differ == [] and worst <= 1e-5 and eval_rel <= 1e-5 and untouched


def _hang(rank, world):
    os.environ["AUTOSHARD_TIMEOUT"] = "2"
    mesh = autoshard.init_mesh(tp=world)
    if rank == 1:
        time.sleep(9)  # never joins the collectives below (rank 0 gives up on both within about 4 s)
        return None
    waited = []
    for group in (None, mesh.get_group("tp")):   # the world group, then the tp axis's own group
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except Exception as e:  # noqa: BLE001 - gloo raises once the group's timeout expires
            waited.append((time.monotonic() - start, type(e).__name__))
    return waited


def test_collective_timeout_is_bounded():
    """A rank waiting on a collective its peer never joins fails after AUTOSHARD_TIMEOUT, not never: on the
    world group and on a mesh axis's group (which new_group would give torch's 30-minute default)."""
    results = run_distributed(_hang, 2, timeout=60, init_pg=False)
    assert len(results[0]) == 2 and all(waited < 6 for waited, _ in results[0]), results[0]


def test_program_cache_keeps_the_most_recently_used_and_closes_the_rest():
    from autoshard.runtime.program_cache import ProgramCache
    closed = []
    cache = ProgramCache(2, "program", on_drop=closed.append)
    cache.put("a", "A"), cache.put("b", "B")
    assert cache.get("a") == "A"          # now the most recently used: "b" goes first
    cache.put("c", "C")
    assert closed == ["B"] and "b" not in cache and len(cache) == 2 and cache.values() == ["A", "C"]
    assert cache.get("b") is None
    with pytest.raises(ValueError, match="max_programs=0"):
        ProgramCache(0, "program")
    owner = {"max_programs": 3}                 # a module's limit, changed after the cache was made
    live = ProgramCache(lambda: owner["max_programs"], "program")
    for k in "abc":
        live.put(k, k.upper())
    owner["max_programs"] = 1
    live.put("d", "D")
    assert live.values() == ["D"]


def test_batch_fingerprint_has_one_size_and_compares_nans():
    from autoshard.runtime.batch_check import fingerprint
    a = torch.tensor([[1.0, float("nan")], [3.0, 4.0]])
    assert torch.equal(fingerprint([a, 2]), fingerprint([a.clone(), 3]))          # NaNs and non-tensors
    assert fingerprint([a]).shape == fingerprint([a, a, torch.ones(5)]).shape == (6,)
    assert not torch.equal(fingerprint([a]), fingerprint([a.flip(0)]))            # same sum, other order
    assert not torch.equal(fingerprint([a.reshape(4)]), fingerprint([a]))         # same values, other shape


def test_buffers_of_a_model_built_on_meta_are_rebuilt_as_the_model_would():
    """A model built under torch.device("meta") has meta buffers too. HF's non-persistent rotary inv_freq is
    recomputed (its _init_weights, as from_pretrained does), so the meta-built model, given the real
    weights, computes the real loss; a persistent buffer nothing rebuilds starts at zeros (warned) and is
    loaded; a non-persistent one nothing rebuilds is an error naming it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    call = dict(input_ids=ids, labels=ids, use_cache=False)
    pm = autoshard.parallelize(model, {"tp": 1}, (), call)
    pm.load_full_state_dict(ref.state_dict(), strict=False)
    assert abs(float(pm(**call).loss) - float(ref(**call).loss)) <= 1e-6 * float(ref(**call).loss)

    class Scaled(torch.nn.Module):
        def __init__(self, persistent):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.full((4,), 2.0), persistent=persistent)

        def forward(self, x):
            return (self.lin(x) * self.scale).sum()

    x = torch.randn(2, 4)
    torch.manual_seed(0)
    real = Scaled(True)
    with torch.device("meta"):
        saved = Scaled(True)
    with pytest.warns(UserWarning, match="buffer 'scale' .* starts at zeros; load it with load_full_state_dict"):
        pm = autoshard.parallelize(saved, {"tp": 1}, (x,))
    pm.load_full_state_dict(real.state_dict())
    assert torch.allclose(pm(x), real(x))
    # integer and bool buffers too: BERT's position_ids (an arange), GPT-Neo's causal masks (a tril)
    from transformers import BertConfig, BertLMHeadModel, GPTNeoConfig, GPTNeoForCausalLM
    from autoshard.runtime.params import model_buffers
    for build_it in (lambda: BertLMHeadModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                        num_attention_heads=4, intermediate_size=64, is_decoder=True)),
                     lambda: GPTNeoForCausalLM(GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                                            attention_types=[[["global", "local"], 1]], window_size=4,
                                                            max_position_embeddings=16))):
        real_buffers = dict(build_it().named_buffers())
        with torch.device("meta"):
            on_meta = build_it()
        rebuilt = model_buffers(on_meta)
        assert real_buffers.keys() == rebuilt.keys()
        for name, b in real_buffers.items():
            assert rebuilt[name].dtype == b.dtype and torch.equal(rebuilt[name], b), name
    with torch.device("meta"):
        lost = Scaled(False)
    with pytest.raises(ValueError, match="buffer 'scale' of '' \\(Scaled\\) is on the meta device and is not saved"):
        autoshard.parallelize(lost, {"tp": 1}, (x,))


def test_bound_program_runs_on_the_mesh_device():
    """A program traced on the CPU (or meta) runs on its mesh's device: binding retargets every device
    literal export baked in (GPT's positions arange), leaving the program's own graph as traced; a call's
    tensors are moved there (as DDP moves its inputs), those already there are not copied."""
    from autoshard.runtime.bind import bind
    from autoshard.runtime.device import mesh_device, to_device
    prog = autoshard.compile_rank(build("gpt", n_layer=1), {"tp": 1}, 0, *batch("gpt", 96))

    def devices(gm):
        found = set()
        for n in gm.graph.nodes:
            torch.fx.node.map_aggregate((n.args, n.kwargs), lambda a: found.add(a) if isinstance(a, torch.device) else a)
        return found
    assert devices(prog.gm) == {torch.device("cpu")}
    bound = bind(prog.gm, {}, torch.device("meta"))
    assert devices(bound) == {torch.device("meta")} and devices(prog.gm) == {torch.device("cpu")}
    assert "device(type='meta')" in bound.code
    x = torch.ones(2)
    moved = to_device(((x,), {"y": x, "n": 3}), torch.device("meta"))
    assert moved[0][0].is_meta and moved[1]["y"].is_meta and moved[1]["n"] == 3
    assert to_device((x,), torch.device("cpu"))[0] is x and to_device((x,), None)[0] is x
    assert mesh_device(None) is None


def test_param_groups_by_the_whole_models_names():
    """Every rank may build its param groups from the whole model's names: a name another pipeline stage
    holds is skipped, a tied weight's embedding name is its head's, and a typo or a tensor of the single-
    device model is an error saying what to pass."""
    from autoshard.runtime.zero import group_names
    mine = {"a.weight": torch.zeros(2), "lm_head.weight": torch.zeros(3)}
    model = {"a.weight": "a.weight", "b.weight": "b.weight", "lm_head.weight": "lm_head.weight",
             "wte.weight": "lm_head.weight"}
    groups = group_names([{"params": ["a.weight", "b.weight", "wte.weight", "lm_head.weight"], "weight_decay": 0.1},
                          {"params": [], "weight_decay": 0.0}], mine, model)
    assert groups == [(["a.weight", "lm_head.weight"], {"weight_decay": 0.1}), ([], {"weight_decay": 0.0})]
    with pytest.raises(ValueError, match="holds 'c.weight' that is not a parameter of this pm: give the model's"):
        group_names([{"params": ["c.weight"]}], mine, model)
    with pytest.raises(ValueError, match="holds a tensor that is not a parameter of this pm.*single-device"):
        group_names([{"params": [torch.zeros(2)]}], mine, model)
    with pytest.raises(ValueError, match="lm_head.weight is in more than one optimizer param group"):
        group_names([{"params": ["wte.weight"]}, {"params": ["lm_head.weight"]}], mine, model)
