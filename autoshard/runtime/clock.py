"""When each pipeline action ran, read from the clock that saw it run.

On the CPU an action's work is done when its Python call returns, so a host clock times it. CUDA runs
asynchronously: a host clock there times when Python *issued* each action, and the bubble it measured
would be the host's idle time, not the GPU's. So on CUDA each mark is an event recorded on the current
stream (where the chunk's kernels run and where a receive's ``wait`` blocks), and the marks are read
only when someone asks for the timeline: reading them waits for the step's work, which ``pm.step``
itself never does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from autoshard.ir.simulator import Span, Timeline


class StepClock:
    """Marks in one step. ``mark()`` is a host time on the CPU and a recorded CUDA event on a GPU;
    ``seconds(mark)`` is seconds since the clock started, either way. ``event`` makes the events (tests
    pass a stand-in)."""

    def __init__(self, device: torch.device, event=None):
        self.events = event is not None or device.type == "cuda"
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.host_start = time.perf_counter()
        self.start = self._record() if self.events else self.host_start

    def _record(self):
        e = self._event()
        e.record()
        return e

    def mark(self):
        return self._record() if self.events else time.perf_counter() - self.host_start

    def seconds(self, mark) -> float:
        if not self.events:
            return mark
        mark.synchronize()
        return self.start.elapsed_time(mark) / 1e3     # CUDA events measure milliseconds

    def host_seconds(self) -> float:
        """Seconds since the step started on the host (for error messages, which cannot wait on a GPU)."""
        return time.perf_counter() - self.host_start


@dataclass
class Recorded:
    """One rank's marks of a step, turned into a ``Timeline`` on demand: spans of marks, the step's end
    mark, and the peak of saved activation bytes."""
    name: str
    pp: int
    rank: int
    clock: StepClock
    spans: list = field(default_factory=list)       # Span(action, start mark, end mark)
    end: object = None
    peak: int = 0

    def timeline(self) -> Timeline:
        s = self.clock.seconds
        spans = [Span(x.action, s(x.start), s(x.end)) for x in self.spans]
        busy = sum(x.end - x.start for x in spans if x.action.is_compute)
        return Timeline(self.name, self.pp, {self.rank: spans}, s(self.end), {self.rank: busy},
                        {self.rank: self.peak})
