"""The activation-recompute plan: which stretches of a rank's graph run again in backward.

Written by ``passes/recompute.py``, dumped in ``plan.md``, and run by ``runtime/recompute.py``: the
regions are data, planned once.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RecomputeRegion:
    """One layer's nodes, ``first`` to ``last`` in graph order (indices into the rank's whole graph)."""
    layer: int
    first: str
    last: str
    first_index: int
    last_index: int

    @property
    def nodes(self) -> int:
        return self.last_index - self.first_index + 1


@dataclass(frozen=True)
class RecomputePlan:
    regions: tuple
    reason: str = ""          # why nothing is recomputed, when nothing is
    skipped: tuple = ()       # why a layer is not recomputed (one line each)
    kind: str = "full"        # "full": whole layers; "selective": each attention's core

    def lines(self) -> list:
        """The ``plan.md`` section."""
        L = ["## Activation recompute", ""]
        if not self.regions:
            return L + [f"- none: {self.reason or 'every candidate was left out'}"] + [f"- {s}" for s in self.skipped] + [""]
        if self.kind == "selective":
            L += [f"Selective: {len(self.regions)} attention cores (scores, softmax, dropout, the product with v) run "
                  "again in backward; each keeps only q, k and v. The matmul outputs are kept.", ""]
        else:
            L += [f"{len(self.regions)} regions run again in backward (each keeps only its input); the embedding "
                  "and the head with its loss are not recomputed.", ""]
        L += [
              "| region | layer | first node | last node | nodes |", "|---|---|---|---|---|"]
        L += [f"| {i} | {r.layer} | {r.first} | {r.last} | {r.nodes} |" for i, r in enumerate(self.regions)]
        return L + [""] + [f"- {s}" for s in self.skipped] + ([""] if self.skipped else [])
