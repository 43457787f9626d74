"""Megatron's scatter/gather of pipeline transfers (Narayanan et al., SC'21, section 4.1).

Without sequence parallelism the residual stream a stage sends is whole and the same on every tp rank,
and each tp rank sends it to its peer of the next stage: t copies of one tensor cross the slow links
between nodes, one a GPU. Scattered, each tp rank sends only its 1/t slice of the flattened tensor, and
the receiving tp ranks all-gather the slices over their fast link inside the node. The gradient sent
back is whole on every tp rank too (the column-parallel input's gradient is summed over tp in backward),
so it travels the same way. A sequence-sharded boundary (SP) is already 1/t a rank and is sent as it is.

Whether a transfer is sliced is the boundary's placement, read from the compiled chunks
(``Chunk.in_replicated`` / ``out_replicated``), so sender and receiver agree without a handshake; the
tp ranks of a pipeline rank walk the same action list, so their all-gathers line up.
"""
from __future__ import annotations

import math

import torch

from autoshard.ir.options import scatter_gather_on
from autoshard.ir.schedule import Action, Kind
from autoshard.runtime.layout import pad_to


class ScatterGather:
    """The transfers of one rank's step that go as tp slices: ``part`` before a send, ``buffer`` for a
    receive, ``whole`` once a receive has arrived."""

    def __init__(self, tp, chunks: dict):
        self.tp, self.chunks = tp, chunks

    def sliced(self, a: Action) -> bool:
        """Whether ``a``'s tensor is whole on every tp rank: a forward's boundary, or its gradient."""
        chunk = self.chunks[a.stage]
        return chunk.out_replicated if a.kind in (Kind.SEND_F, Kind.RECV_B) else chunk.in_replicated

    def _length(self, numel: int) -> int:
        return math.ceil(numel / self.tp.size)

    def part(self, tensor: torch.Tensor) -> torch.Tensor:
        """This tp rank's slice of ``tensor`` flattened (the last one padded with zeros)."""
        n = self._length(tensor.numel())
        flat = pad_to(tensor.reshape(-1), 0, n * self.tp.size)
        return flat[self.tp.rank * n:(self.tp.rank + 1) * n].contiguous()

    def buffer(self, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        return torch.empty(self._length(math.prod(shape)), dtype=dtype, device=device)

    def whole(self, part: torch.Tensor, a: Action) -> torch.Tensor:
        """The tensor receive ``a`` stands for, made of every tp rank's slice (counted as phase "p2p" in
        ``pm.comm_counts()``: the transfers' own all-gathers, beside the program's planned collectives)."""
        chunk = self.chunks[a.stage]
        shape = chunk.in_shape if a.kind is Kind.RECV_F else chunk.out_shape
        return self.tp.all_gather(part, 0, "p2p")[:math.prod(shape)].view(shape)


def scatter_gather(setting, tp, chunks: dict) -> ScatterGather | None:
    """The step's ``ScatterGather`` where ``setting`` (``PipelineOptions.scatter_gather``) turns it on and
    there is a tp group; None: every transfer goes whole."""
    if not scatter_gather_on(setting) or tp.size == 1 or not any(c.in_replicated or c.out_replicated
                                                                  for c in chunks.values()):
        return None
    return ScatterGather(tp, chunks)
