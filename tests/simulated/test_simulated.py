"""Tier 1: exactness of the sharding rules on the cases that once gave silent wrong results.

Every rank runs in a thread of this process (``tests/harness/simulate.py``); outputs, every gradient and
input gradients must equal eager PyTorch. Each model below reproduces one review finding.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.passes.plan import PlanError
from autoshard.ir.placement import Shard
from tests.harness.models import batch, build
from tests.harness.simulate import assert_same


class Square(nn.Module):
    """(row-parallel output)^2: Partial must not pass through a product of a value with itself."""
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 64, bias=False), nn.Linear(64, 16, bias=False)

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        return (y * y).sum()


class Attention3d(nn.Module):
    """sdpa on (B, L, E): dim 1 is the sequence, not heads; it must not be sharded."""
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        h = self.proj(x)
        return F.scaled_dot_product_attention(h, h, h, is_causal=True).sum()


class ScaledBias(nn.Module):
    """add(linear, b, alpha=3) must not fold into linear(x, W, b)."""
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.add(F.linear(x, self.w), self.b, alpha=3.0).pow(2).sum()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.proj = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x))).pow(2).sum()


class PaddedEmbedding(nn.Module):
    """nn.Embedding(padding_idx=0) under the vocab-parallel lowering: row 0 gets no gradient."""
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16, padding_idx=0)
        self.head = nn.Linear(16, 8)

    def forward(self, idx):
        return self.head(self.emb(idx)).pow(2).sum()


class ExtremeLogits(nn.Module):
    """Vocab-parallel CE on logits near -200 (the padded columns are 0: they must not set the max) with
    banned (-inf) columns at local column 0 of ranks that do not hold the target (-inf * 0 = NaN)."""
    def __init__(self, vocab=7, banned=(4, 6)):
        super().__init__()
        self.head = nn.Linear(16, vocab)
        with torch.no_grad():
            self.head.bias.fill_(-200.0)
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[list(banned)] = True
        self.register_buffer("banned", mask)

    def forward(self, x, targets):
        return F.cross_entropy(self.head(x).masked_fill(self.banned, float("-inf")), targets)


@pytest.mark.parametrize("t", [2, 4])
def test_partial_never_squared(t):
    torch.manual_seed(0)
    assert_same(Square(), (torch.randn(4, 16),), t)


def test_sdpa_on_3d_inputs_keeps_the_sequence_whole():
    torch.manual_seed(0)
    assert_same(Attention3d(), (torch.randn(2, 16, 32),), 2)
    # and at the rule level, whatever the costs: no strategy may shard the sequence dim of (B, L, E)
    from autoshard.passes.capture import capture
    from autoshard.ir.mesh import MeshSpec
    from autoshard.passes.rules import RuleContext, strategies_for
    gm = capture(Attention3d(), (torch.randn(2, 16, 32),)).gm
    node = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    outs = {s.out for s in strategies_for(node, RuleContext(MeshSpec(tp=2)))}
    assert all(getattr(p, "dim", 0) == 0 for p in outs), outs


def test_bias_with_alpha_is_not_folded():
    torch.manual_seed(0)
    assert_same(ScaledBias(), (torch.randn(2, 4),), 2)


def test_input_that_requires_grad_gets_the_full_gradient():
    torch.manual_seed(0)
    assert_same(MLP(), (torch.randn(4, 16, requires_grad=True),), 2)


def test_embedding_padding_idx_row_gets_no_gradient():
    torch.manual_seed(0)
    idx = torch.tensor([[0, 5, 40, 0], [63, 0, 33, 1]])
    assert_same(PaddedEmbedding(), (idx,), 2)


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_loss_on_extreme_logits(t):
    torch.manual_seed(0)
    # 64 rows: enough that gathering the logits costs more than the loss's two small all-reduces
    x, targets = torch.randn(64, 16), torch.tensor([0, 2, 3, 5, 1, 2, 0, 3] * 8)
    # pinned vocab-parallel: at this size the planner would rather run the head row-parallel
    assert_same(ExtremeLogits(), (x, targets), t, pins={"head.weight": Shard(0)})


def test_vocab_smaller_than_a_full_shard_stays_exact():
    """V=5 at tp=4 would leave the last rank only padding: the planner must not shard it that way."""
    torch.manual_seed(0)
    with pytest.raises(PlanError, match="cannot pin parameter 'head.weight'"):
        assert_same(ExtremeLogits(vocab=5, banned=(4,)), (torch.randn(6, 16), torch.tensor([0, 2, 3, 2, 0, 3])), 4,
                    pins={"head.weight": Shard(0)})
    assert_same(ExtremeLogits(vocab=5, banned=(4,)), (torch.randn(6, 16), torch.tensor([0, 2, 3, 2, 0, 3])), 4)


@pytest.mark.parametrize("t", [2, 4])
def test_gpt_matches_in_simulation(t):
    model = build("gpt", n_layer=2, vocab_size=97, fused_qkv=(t == 2))
    args, _ = batch("gpt", 97)
    assert_same(model, args, t, loss_fn=lambda out: out[1])


def test_meta_init_draws_distinct_layers_and_keeps_the_callers_rng():
    from autoshard.models import GPT, GPTConfig
    from autoshard.runtime.module import ParallelModule
    import autoshard
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16))
    args, _ = batch("gpt", 96)
    state = torch.random.get_rng_state()
    pm = ParallelModule(autoshard.compile_rank(model, {"tp": 1}, 0, args), model)
    assert torch.equal(state, torch.random.get_rng_state())
    w = pm.local_parameters()
    assert not torch.equal(w["transformer.h.0.mlp.c_fc.weight"], w["transformer.h.1.mlp.c_fc.weight"])


class WriteThroughAlias(nn.Module):
    """``contiguous()`` may return its input itself: an in-place write through it reaches every reader of
    the input, so canonicalize must leave it alone; a write to a plain op result (``z += y``) is made pure."""
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.a(x)
        c = h.contiguous()
        c.mul_(2.0)
        y = self.b(torch.relu(h))
        z = self.b(c)
        z += y
        return z.pow(2).sum()


@pytest.mark.parametrize("t", [2, 4])
def test_in_place_writes_keep_their_meaning(t):
    torch.manual_seed(0)
    assert_same(WriteThroughAlias(), (torch.randn(4, 16),), t)


class WriteWithAView(nn.Module):
    """``p = h.movedim(-1, 0); h.mul_(2); y = p.movedim(0, -1)``: the write must reach the view. Sharding
    would move h and p through different collectives, so capture functionalizes it (``p`` is read from the
    written ``h``) before anything is sharded."""
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.a(x)
        p = h.movedim(-1, 0)
        h.mul_(2.0)
        return self.b(torch.relu(p.movedim(0, -1))).sum()


def test_in_place_write_with_a_view_is_exact_at_every_tp(tmp_path):
    # (was refused at tp > 1 before capture functionalized writes into views)
    for t in (1, 2, 4):
        torch.manual_seed(0)
        assert_same(WriteWithAView(), (torch.randn(2, 4, 8),), t)
    autoshard.compile_rank(WriteWithAView(), {"tp": 2}, 0, (torch.randn(2, 4, 8),),
                           options=autoshard.CompileOptions(dump=str(tmp_path)))
    assert "## Writes into views" in (tmp_path / "plan.md").read_text()      # the dump says it was done


class TrainOnlyConstant(nn.Module):
    """Constants made in forward are lifted per trace (lifted_tensor_0, ...): the eval program must read its
    own, not the train program's."""
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        if self.training:
            x = x * torch.tensor([0.5])
        return (self.a(x) * torch.tensor([3.0])).sum()


def test_programs_keep_their_own_constants_and_key_on_requires_grad():
    import dataclasses
    import autoshard
    from autoshard.ir.mesh import MeshSpec
    from autoshard.runtime.module import ParallelModule
    from tests.harness.simulate import run_ranks
    torch.manual_seed(0)
    model, x = TrainOnlyConstant(), torch.randn(2, 4, 8)
    model.eval(); want_eval = float(model(x)); model.train(); want_train = float(model(x))
    progs = [autoshard.compile_rank(model, {"tp": 2}, r, (x,)) for r in range(2)]
    lock = __import__("threading").Lock()

    def rank(r, comms):
        def compiler(a, kw, training, pins):
            with lock:  # torch.export is not thread-safe
                return autoshard.compile_rank(model, MeshSpec(tp=2), r, a, kw,
                                              dataclasses.replace(autoshard.CompileOptions(), pins=pins), training=training)
        pm = ParallelModule(progs[r], model, comms, compiler=compiler)
        train = float(pm(x)); pm.eval(); ev = float(pm(x)); pm.train()
        pm(x.clone().requires_grad_())          # an input that needs a gradient: its own program
        return train, ev, len(pm.programs), pm.program is progs[r]

    for train, ev, n, first in run_ranks(MeshSpec(tp=2), rank):
        assert train == pytest.approx(want_train, rel=1e-6) and ev == pytest.approx(want_eval, rel=1e-6)
        assert n == 3 and first


class FillBySlices(nn.Module):
    """DeepSeek MLA's keys: a fresh buffer, its head-sharded first part and a broadcast shared part
    copied into slices of the last dimension. Exact at any tp, because the buffer is their ``cat``."""
    def __init__(self, how="exact"):
        super().__init__()
        self.how = how
        self.a, self.shared, self.b = nn.Linear(8, 4 * 6), nn.Linear(8, 2), nn.Linear(4 * 8, 8)

    def forward(self, x):
        B, S, _ = x.shape
        k = self.a(x).view(B, S, 4, 6).transpose(1, 2)             # [B, heads, S, 6]
        r = self.shared(x).view(B, 1, S, 2).expand(-1, 4, -1, -1)  # one part for every head
        out = k.new_empty(B, 4, S, 8)
        if self.how == "read early":
            early = out[..., :6].copy_(k).sum()
        else:
            out[..., :6].copy_(k)
        if self.how == "mutated":
            r = r * 1.0
            k.mul_(3.0)        # after its copy: the cat (after the last copy) would read the new value
        lo = 5 if self.how == "overlap" else 6
        out[..., lo:].copy_(r.double() if self.how == "exact" else r[..., :1] if self.how == "overlap" else r)
        y = self.b(out.transpose(1, 2).reshape(B, S, 32)).pow(2).sum()
        return y + early if self.how == "read early" else y


def test_fill_by_slices_becomes_a_cat_and_is_exact():
    torch.manual_seed(0)
    for t in (1, 2, 4):
        assert_same(FillBySlices(), (torch.randn(2, 3, 8),), t)


@pytest.mark.parametrize("how", ["overlap", "read early", "mutated"])
def test_fill_by_slices_that_is_not_a_cat_is_functionalized_and_exact(how):
    # not one cat (fill_slices leaves it), so capture makes its writes slice_scatters
    for t in (1, 2):
        torch.manual_seed(0)
        assert_same(FillBySlices(how), (torch.randn(2, 3, 8),), t)


class NestedFills(nn.Module):
    """One filled buffer copied into a slice of another (the rewrite of the outer one reads the inner)."""
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 16)

    def forward(self, x):
        outer = x.new_empty(x.shape[0], 32)
        inner = x.new_empty(x.shape[0], 16)
        inner[:, :8].copy_(self.a(x))
        inner[:, 8:].copy_(self.b(x))
        outer[:, :16].copy_(inner)
        outer[:, 16:].copy_(self.c(x))
        return outer.pow(2).sum()


def test_nested_fills_are_both_cats():
    torch.manual_seed(0)
    assert_same(NestedFills(), (torch.randn(4, 8),), 2)


class ShortConvMixer(nn.Module):
    """A Mamba-style mixer: in-projection, a depthwise causal conv over channels (its weight read through
    ``squeeze``/``unsqueeze`` as HF's slow paths do), per-head gates as ``baddbmm`` (RG-LRU's), and an
    out-projection. Every piece has a channel-sharded strategy, so nothing needs gathering."""

    def __init__(self, d=8, inner=16, heads=4, k=3):
        super().__init__()
        self.inp, self.out = nn.Linear(d, inner), nn.Linear(inner, d)
        self.conv = nn.Conv1d(inner, inner, k, groups=inner, padding=k - 1)
        self.gate_w = nn.Parameter(torch.randn(heads, inner // heads, inner // heads) * 0.3)
        self.gate_b = nn.Parameter(torch.randn(heads, inner // heads) * 0.1)
        self.heads = heads

    def forward(self, x):
        b, s, _ = x.shape
        h = self.inp(x).transpose(1, 2)
        w = self.conv.weight.squeeze(1)
        h = F.conv1d(h, w.unsqueeze(1), self.conv.bias, padding=self.conv.padding, groups=h.shape[1])[..., :s]
        h = F.silu(h).transpose(1, 2)                                     # [b, s, inner]
        heads = h.reshape(b * s, self.heads, -1).transpose(0, 1)          # [heads, b*s, inner/heads]
        gate = torch.baddbmm(self.gate_b[:, None, :], heads, self.gate_w).sigmoid()
        h = h * gate.transpose(0, 1).reshape(b, s, -1)
        return self.out(h).pow(2).sum()


@pytest.mark.parametrize("t", [2, 4])
def test_depthwise_conv_and_head_gates_shard_along_channels(t):
    torch.manual_seed(0)
    assert_same(ShortConvMixer(), (torch.randn(2, 5, 8),), t)
    prog = autoshard.compile_rank(ShortConvMixer(), {"tp": t}, 0, (torch.randn(2, 5, 8),))
    local = {p.name: p.local_shape for p in prog.params}
    assert local["conv.weight"] == (16 // t, 1, 3) and local["gate_w"][0] == 4 // t, local
    assert not prog.report.unruled, prog.report.unruled


class SqueezedBias(nn.Module):
    """``bias.squeeze()`` of a ``(1, 4)`` parameter (ERNIE 4.5 MoE's router correction bias): at tp=4 a
    shard of the 4 is 1 wide, and a local ``squeeze()`` would drop it too."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4, bias=False)
        self.bias = nn.Parameter(torch.randn(1, 4))

    def forward(self, x):
        return (self.lin(x) + self.bias.squeeze()).sigmoid().sum()


@pytest.mark.parametrize("t", [2, 4])
def test_squeeze_keeps_a_dim_that_is_one_wide_only_locally(t):
    torch.manual_seed(0)
    assert_same(SqueezedBias(), (torch.randn(3, 8),), t)


class Overwritten(nn.Module):
    """``h.copy_(...)`` over a fresh matmul output: its functional twin ``copy`` has no derivative (a crash
    in backward before), and eager leaves ``a`` a zero gradient, not None (an optimizer still decays it)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h.copy_(torch.tanh(self.b(x)))
        return (h * h).sum()


@pytest.mark.parametrize("t", [1, 2, 4])
def test_a_copy_over_an_op_result_keeps_the_overwritten_weights_zero_gradient(t):
    torch.manual_seed(0)
    assert_same(Overwritten(), (torch.randn(2, 8),), t)
