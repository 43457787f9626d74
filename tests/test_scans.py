"""Scans that write into a buffer one position at a time (``out[:, t] = h``): made pure at capture
(``passes/functionalize.py``), and, where nothing reads a half-written buffer, one ``cat`` of the writes
(``passes/stack_scans.py``) instead of one buffer copy per step."""
import pytest
import torch
import torch.nn as nn

import autoshard
from tests.test_simulated import assert_same

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
