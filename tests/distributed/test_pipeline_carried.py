"""Pipeline cuts that send small values beside the residual stream.

An MoE model trained with its router's auxiliary loss (HF ``output_router_logits=True``, as the Trainer
is used for Mixtral, Qwen-MoE, OLMoE) keeps every layer's router logits until the loss. Before, no cut
was legal after the first router, so pp=2 put one attention layer on stage 0 and pp=4 failed. Now a cut
may carry such values, packed with the stream into one transfer."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.ir.options import CompileOptions, PipelineOptions
from autoshard.passes.pipeline_split import activations, candidates
from autoshard.passes.shapes import val
from tests.harness.distributed import run_distributed
from tests.harness.family_pipeline_checks import mixtral_with_aux_loss, moe_aux_loss_pipeline, pipeline_against_single_device
from tests.harness.models import batch, build


def _compile(model, args, kwargs, pp, **options):
    return autoshard.compile_pipeline(model, {"pp": pp}, 0, args, kwargs,
                                      CompileOptions(pipeline=PipelineOptions(microbatches=pp, **options)))


def test_moe_router_logits_are_carried_so_every_layer_can_end_a_stage():
    model, kw = mixtral_with_aux_loss(4)
    prog = _compile(model, (), kw, pp=4)
    assert [c.layers for c in prog.plan.costs] == [(0, 1), (1, 2), (2, 3), (3,)]
    assert [len(c) for c in prog.plan.carried] == [1, 2, 3]      # the routers before each cut
    for k, chunk in enumerate(prog.chunks[1:]):
        stream = 1 * 8 * 64                                          # one row of [8, 64] per microbatch
        assert chunk.in_shape == (stream + (k + 1) * 8 * 4,)         # + each router's [8 tokens, 4 experts]
        assert chunk.in_dtype == torch.float32
        assert prog.chunks[k].out_shape == chunk.in_shape
    with_cuts = _compile(model, (), kw, pp=2, cuts=(1,))           # pipeline_cuts after a MoE layer: legal now
    assert [c.layers for c in with_cuts.plan.costs][0] == (0,)


def test_recompute_finds_every_moe_layer_with_its_router_logits_carried():
    """The recompute regions come from the same cut points: before, only layer 0's attention was
    recomputed under the auxiliary loss (a silent loss of the memory saving)."""
    from autoshard.ir import meta as M
    model, kw = mixtral_with_aux_loss(4)
    prog = autoshard.compile_pipeline(model, {"pp": 2}, 0, (), kw,
                                      CompileOptions(recompute=True, pipeline=PipelineOptions(microbatches=2)))
    assert [r.layer for r in prog.gm.meta[M.RECOMPUTE_PLAN].regions] == [0, 1, 2, 3]


def test_a_wide_mlp_intermediate_beside_the_stream_is_no_cut():
    """A GPT's up-projection ([.., 4h]) is live beside the residual stream ([.., h], a quarter of it)
    until the add: a legal cut in principle, but not a residual stream, so not offered."""
    model = build("gpt", n_layer=2)
    from autoshard.passes.capture import capture
    gm = capture(model, *batch("gpt", 96, B=4)).gm
    cands = candidates(gm, activations(gm))
    assert all(not c.carried for c in cands)
    assert {tuple(val(c.boundary).shape) for c in cands[:-1]} == {(4, 8, 32)}   # the last: the logits


class RunningAuxNet(nn.Module):
    """Each block adds a float64 penalty to a running scalar, which the loss reads at the end: a
    carried value of another dtype, passed through stages it is not computed on."""

    def __init__(self, vocab=50, hidden=16, layers=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.Tanh())
                                    for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, labels):
        h = self.emb(ids)
        penalty = torch.zeros((), dtype=torch.float64)
        for block in self.blocks:
            h = h + block(h)
            penalty = penalty + h.double().pow(2).mean()
        ce = F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
        return ce + 1e-3 * penalty.float()


def _running_aux_batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 50, (4, 6), generator=g), torch.randint(0, 50, (4, 6), generator=g)


def test_values_of_another_dtype_are_packed_in_the_wider_one():
    torch.manual_seed(0)
    prog = _compile(RunningAuxNet(), _running_aux_batch(), None, pp=2, cuts=(2,))
    c1 = prog.chunks[1]
    assert prog.plan.carried == [(prog.plan.carried[0][0],)] and c1.in_dtype == torch.float64
    assert c1.in_shape == (2 * 6 * 16 + 1,)


def _toy_parity(rank, world, net="running_aux", cut=2):
    torch.manual_seed(0)
    model = {"running_aux": RunningAuxNet, "scan": ScanNet}[net]()
    ids, labels = _running_aux_batch()
    ref = copy.deepcopy(model)
    want = ref(ids, labels)
    want.backward()
    pm = autoshard.parallelize(model, autoshard.init_mesh(pp=2), (ids, labels), microbatches=2, pipeline_cuts=[cut])
    loss = float(pm.step(ids, labels))
    grads = dict(ref.named_parameters())
    worst = max(float((pm.gather(n, p.grad) - grads[n].grad).abs().max()) for n, p in pm.named_parameters())
    return dict(loss=loss, want=float(want.detach()), worst=worst)


def test_a_carried_running_scalar_trains_exactly_on_two_stages():
    for r in run_distributed(_toy_parity, 2):
        assert abs(r["loss"] - r["want"]) <= 1e-6 * abs(r["want"]), r
        assert r["worst"] < 1e-6, r


@pytest.mark.parametrize("dims, options", [({"pp": 2}, {}), ({"pp": 2, "tp": 2}, {"recompute": True, "scatter_gather": True}),
                                           ({"pp": 2}, {"schedule": "interleaved", "virtual_stages": 2})],
                         ids=["pp2", "pp2-tp2-recompute", "pp2-interleaved"])
def test_moe_aux_loss_on_a_pipeline_matches_the_single_device_model(dims, options):
    for r in run_distributed(moe_aux_loss_pipeline, 4 if "tp" in dims else 2, dims, options, timeout=300):
        assert abs(r["loss"] - r["want"]) <= 1e-6 * abs(r["want"]), r
        assert r["worst"] < 1e-5, r
        assert r["carried"][0] >= 1 and r["layers"][0][-1] >= 1, r     # cut after a router, not before the first


@pytest.mark.slow
def test_moe_aux_loss_on_four_stages():
    for r in run_distributed(moe_aux_loss_pipeline, 4, {"pp": 4}, None, timeout=300):
        assert abs(r["loss"] - r["want"]) <= 1e-6 * abs(r["want"]), r
        assert r["worst"] < 1e-5, r
        assert r["carried"] == [1, 2, 3], r


MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "phimoe", "granitemoe"]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "pp2-tp2"])
@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_moe_family_with_router_aux_loss_on_two_stages(name, tp):
    """Every HF MoE family of the tests, trained with ``output_router_logits=True`` on pp=2 (and tp=2): the
    cut after layer 0 carries its router logits, whatever their tp placement (OLMoE's gate is planned
    row-parallel and sends the all-reduced logits; PhiMoE's column-parallel sends its shard). Loss, eval
    loss and every gradient against the single-device model."""
    from tests.harness.zoo import ZOO, build_zoo
    if name in ZOO and build_zoo(name) is None:
        pytest.skip(f"this transformers has no {ZOO[name][0]}")
    for r in run_distributed(pipeline_against_single_device, 2 * tp, name, True, tp, timeout=300):
        assert abs(r["loss"] - r["want"]) <= 1e-5 * abs(r["want"]), r
        assert abs(r["eval"] - r["want"]) <= 1e-5 * abs(r["want"]), r
        assert r["worst"] < 1e-5 and r["carried"] == [1], r


class ScanNet(nn.Module):
    """A recurrence written into a buffer one step at a time (``states[:, t] = ...``, as linear attention
    and RG-LRU layers do): writes into views, which have no users in the graph."""

    def __init__(self, vocab=50, hidden=16, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, labels):
        h = self.emb(ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
            states = torch.zeros_like(h)
            states[:, 0] = h[:, 0]
            for t in range(1, h.shape[1]):
                states[:, t] = 0.5 * states[:, t - 1] + h[:, t]
            h = h + states
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_a_scan_that_writes_into_a_view_trains_exactly_on_two_stages():
    """Such a write has no users, so the stage walk (which follows data edges) left it out of every stage
    graph and the stage read the buffer unwritten: a wrong loss with no error (Qwen3.5, Qwen3-Next,
    RecurrentGemma). Capture now makes each write a ``select_scatter``, which the stage keeps as data."""
    torch.manual_seed(0)
    prog = _compile(ScanNet(), _running_aux_batch(), None, pp=2, cuts=(1,))
    scatters = [[n for n in c.gm.graph.nodes if n.target is torch.ops.aten.select_scatter.default]
                for c in prog.chunks]
    assert [len(s) for s in scatters] == [6, 6]                  # one per time step, on each layer's stage
    for r in run_distributed(_toy_parity, 2, "scan", 1):
        assert abs(r["loss"] - r["want"]) <= 1e-6 * abs(r["want"]), r
        assert r["worst"] < 1e-5, r
