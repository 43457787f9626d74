"""The baseline for ``benchmarks.pp``: torch.distributed.pipelining on the same GPT, split by hand.

Stage modules are cut at the same layer boundaries autoshard is told to cut at (``pipeline_cuts``), from
a copy of the same single-device model, so both run the same weights. torch's pipelining has no
cross-stage gradient sum for a tied weight, so the comparison uses an untied head.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.runtime.comm import collective_device


class GPTChunk(nn.Module):
    """Layers ``[lo, hi)`` of ``autoshard.models.GPT``, with the embedding (first chunk) and the final
    norm and head (last chunk): one stage of a hand-split pipeline."""

    def __init__(self, gpt, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        t = gpt.transformer
        if first:
            self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop
        self.h = nn.ModuleList(t.h[lo:hi])
        if last:
            self.ln_f, self.lm_head = t.ln_f, gpt.lm_head

    def forward(self, x):
        if self.first:
            pos = torch.arange(0, x.shape[1], dtype=torch.long, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def torch_pipeline(gpt, cuts: list, pp_rank: int, pp: int, v: int, m: int, group=None, zero_bubble: bool = False,
                   v_shape: bool = False):
    """``(schedule, stage modules)`` for this rank: ``Schedule1F1B`` (v = 1) or
    ``ScheduleInterleaved1F1B`` over the chunks ``pp_rank, pp_rank + pp, ...``; with ``zero_bubble``,
    ``ScheduleInterleavedZeroBubble`` (torch's ZB1P: its B/W split made by autograd at run time); with
    ``v_shape`` (v = 2), ``ScheduleZBVZeroBubble`` over the chunks ``pp_rank`` and ``2 pp - 1 - pp_rank``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
    edges = [0] + list(cuts) + [len(gpt.transformer.h)]
    n = pp * v
    stages, modules = [], []
    mine = [pp_rank, 2 * pp - 1 - pp_rank] if v_shape else range(pp_rank, n, pp)
    for s in mine:
        mod = GPTChunk(gpt, edges[s], edges[s + 1], s == 0, s == n - 1)
        modules.append(mod)
        stages.append(PipelineStage(mod, s, n, collective_device(), group=group))
    if v_shape:
        return ScheduleZBVZeroBubble(stages, m, loss_fn=loss_fn), modules
    if zero_bubble:
        return ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss_fn), modules
    if v == 1:
        return Schedule1F1B(stages[0], m, loss_fn=loss_fn), modules
    return ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn), modules
