"""Scans that write into a buffer one position at a time (``out[:, t] = h``): made pure at capture
(``passes/functionalize.py``), and, where nothing reads a half-written buffer, one ``cat`` of the writes
(``passes/stack_scans.py``) instead of one buffer copy per step."""
import pytest
import torch
import torch.nn as nn

import autoshard
from tests.simulated.test_simulated import assert_same

aten = torch.ops.aten


class Recurrence(nn.Module):
    """RG-LRU's shape: the state is its own variable, and each step's state is written into ``out``."""

    def __init__(self, d=8, reads_back=False, skip=None):
        super().__init__()
        self.inp, self.out = nn.Linear(d, 16), nn.Linear(16, d)
        self.reads_back, self.skip = reads_back, skip

    def forward(self, x):
        h = self.inp(x)
        out = torch.zeros_like(h)
        state = torch.zeros_like(h[:, 0])
        for t in range(h.shape[1]):
            if t == self.skip:
                continue                                     # a position left as zeros: no cat
            prev = out[:, t - 1] if self.reads_back and t else state
            state = 0.5 * prev + h[:, t]
            out[:, t] = state
        return self.out(torch.tanh(out)).pow(2).sum()


def _ops(model, t=2):
    prog = autoshard.compile_rank(model, {"tp": t}, 0, (torch.randn(2, 5, 8),))
    return [n.target for n in prog.gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("t", [1, 2, 4])
def test_a_scan_that_fills_its_buffer_is_one_cat_and_exact(t):
    torch.manual_seed(0)
    assert_same(Recurrence(), (torch.randn(2, 5, 8),), t)
    ops = _ops(Recurrence(), t)
    assert aten.select_scatter.default not in ops and aten.cat.default in ops


@pytest.mark.parametrize("how", [{"reads_back": True}, {"skip": 2}])
def test_a_scan_that_reads_its_buffer_or_leaves_a_gap_keeps_its_scatters(how):
    # reading out[:, t-1] observes a half-written buffer; a skipped step keeps the zeros there
    torch.manual_seed(0)
    assert_same(Recurrence(**how), (torch.randn(2, 5, 8),), 2)
    assert aten.select_scatter.default in _ops(Recurrence(**how))


class LearnedInit(nn.Module):
    """The buffer starts from a learned state (broadcast and cloned), then every position is written: the
    state gets a zero gradient in eager, so the cat keeps it under one slice_scatter (not None)."""

    def __init__(self, d=8):
        super().__init__()
        self.inp, self.init = nn.Linear(d, 16), nn.Parameter(torch.randn(16))

    def forward(self, x):
        h = self.inp(x)
        out = self.init.expand_as(h).clone()
        state = torch.zeros_like(h[:, 0])
        for t in range(h.shape[1]):
            state = 0.5 * state + h[:, t]
            out[:, t] = state
        return out.pow(2).sum()


class OverwriteWithAView(nn.Module):
    """``h.copy_(...)`` where ``h`` has a view: functionalized, and ``a`` still gets its zero gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        v = h[:, :4]
        h.copy_(torch.tanh(self.b(x)))
        return (h * h).sum() + v.sum()


class ScalarOverwrite(nn.Module):
    """A 0-d ``copy_`` over -inf: made pure without ``x * 0`` (which is NaN there)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        s = torch.full((), float("-inf"))
        s.copy_(self.a(x).pow(2).mean())
        return s * 2 + self.a(x).sum().squeeze(0)        # and a 0-d squeeze, which has nothing to shard


@pytest.mark.parametrize("model", [LearnedInit, OverwriteWithAView, ScalarOverwrite])
@pytest.mark.parametrize("t", [1, 2])
def test_overwritten_values_keep_zero_gradients_and_no_nan(model, t):
    torch.manual_seed(0)
    args = (torch.randn(2, 5, 8),) if model is LearnedInit else (torch.randn(2, 8),)
    assert_same(model(), args, t)


class ScanDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.drop = nn.Linear(8, 16), nn.Dropout(0.1)

    def forward(self, x):
        h = self.drop(self.inp(x))
        out = torch.zeros_like(h)
        for t in range(h.shape[1]):
            out[:, t] = 0.5 * (out[:, t - 1] if t else 0) + h[:, t]
        return out.pow(2).sum()


def test_dropout_in_a_functionalized_graph_is_still_dropout():
    """Functionalization spells it native_dropout (output and mask); canonicalize makes it dropout again,
    so the rules shard it and the tp dropout warning and per-rank RNG handling still see it."""
    with pytest.warns(UserWarning, match="dropout"):
        prog = autoshard.compile_rank(ScanDropout().train(), {"tp": 2}, 0, (torch.randn(2, 5, 8),))
    ops = [n.target for n in prog.gm.graph.nodes if n.op == "call_function"]
    assert aten.native_dropout.default not in ops and not prog.report.unruled
