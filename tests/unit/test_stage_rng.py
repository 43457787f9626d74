"""A pipeline rank's dropout stream (``runtime/stage_rng.py``): its own per pp rank, the same for the
same rank and seed (so the tp ranks of a stage, seeded alike, draw one mask), new each step, and the
caller's global stream advanced by one draw a step only."""
import torch

from autoshard.runtime.stage_rng import draws_random, stage_stream


def _draw(pp_size, pp_rank, seed=1234):
    torch.manual_seed(seed)
    with stage_stream(pp_size, pp_rank, random=True):
        return torch.rand(8)


def test_each_pp_rank_draws_its_own_masks_and_the_global_stream_moves_one_draw():
    a, b = _draw(2, 0), _draw(2, 1)
    assert not torch.equal(a, b)                                 # stage 1 does not repeat stage 0's draws
    assert torch.equal(a, _draw(2, 0))                           # one rank, one seed: one stream (tp ranks agree)
    assert not torch.equal(a, _draw(2, 0, seed=99))              # another seed, another stream
    torch.manual_seed(1234)
    with stage_stream(2, 1, random=True):
        torch.rand(100)
    after = torch.rand(1)
    torch.manual_seed(1234)
    torch.randint(0, 1 << 62, (), dtype=torch.int64)
    assert torch.equal(after, torch.rand(1))                     # the step took one draw of the user's stream
    torch.manual_seed(1234)
    with stage_stream(2, 0, random=True):
        first = torch.rand(8)
    with stage_stream(2, 0, random=True):
        assert not torch.equal(first, torch.rand(8))             # the next step, new masks


def test_one_stage_or_no_random_op_is_left_alone():
    for args in ((1, 0, True), (2, 1, False)):
        torch.manual_seed(5)
        with stage_stream(*args):
            x = torch.rand(4)
        torch.manual_seed(5)
        assert torch.equal(x, torch.rand(4))


def test_draws_random_finds_dropout_in_a_graph_and_its_submodules():
    import torch.fx as fx

    class Inner(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten.dropout.default(x, 0.1, True)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = fx.symbolic_trace(Inner())

        def forward(self, x):
            return self.inner(x) + 1
    class KeepsSubgraphs(fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, fx.GraphModule) or super().is_leaf_module(m, name)
    outer = Outer()
    nested = fx.GraphModule(outer, KeepsSubgraphs().trace(outer))
    assert any(n.op == "call_module" for n in nested.graph.nodes)       # the dropout is in the submodule only
    assert draws_random([nested])
    assert not draws_random([fx.symbolic_trace(torch.nn.Linear(2, 2))])


def test_a_dropout_of_p_0_an_eval_dropout_and_an_sdpa_without_dropout_draw_nothing():
    import torch.fx as fx
    aten = torch.ops.aten

    def graph(fn):
        return fx.symbolic_trace(fn)
    assert not draws_random([graph(lambda x: aten.dropout.default(x, 0.0, True))])
    assert not draws_random([graph(lambda x: aten.dropout.default(x, 0.1, False))])
    assert draws_random([graph(lambda x: aten.dropout.default(x, 0.1, True))])
    assert not draws_random([graph(lambda x: aten.scaled_dot_product_attention.default(x, x, x, None, 0.0, True))])
    assert draws_random([graph(lambda x: aten.scaled_dot_product_attention.default(x, x, x, None, 0.1, True))])
    assert draws_random([graph(lambda x: aten.bernoulli.p(x, 0.5))])
