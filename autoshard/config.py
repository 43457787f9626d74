"""Every switch autoshard reads, in one place (the README has the same table).

| variable / option    | meaning                                                             |
|----------------------|---------------------------------------------------------------------|
| ``AUTOSHARD_DUMP``   | directory for pass dumps and ``plan.md`` (same as ``dump=``)        |
| ``AUTOSHARD_TIMEOUT``| seconds before a collective gives up (process-group timeout), 300  |
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from autoshard.passes.cost import CostModel

AXES = ("dp", "pp", "tp")


def dump_dir(explicit: str | None) -> str | None:
    return explicit or os.environ.get("AUTOSHARD_DUMP") or None


def pg_timeout_seconds() -> float:
    return float(os.environ.get("AUTOSHARD_TIMEOUT", "300"))


@dataclass(frozen=True)
class MeshSpec:
    """A mesh's shape without processes: axis name -> size, in (dp, pp, tp) order (tp fastest)."""
    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self):
        for a in AXES:
            if getattr(self, a) < 1:
                raise ValueError(f"mesh axis '{a}' must be >= 1, got {getattr(self, a)}")

    @property
    def size(self):
        return self.dp * self.pp * self.tp

    def coords(self, rank: int) -> dict:
        """``torch.arange(world).view(dp, pp, tp)``: the coordinates of a global rank."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks {self}")
        return {"dp": rank // (self.pp * self.tp), "pp": rank // self.tp % self.pp, "tp": rank % self.tp}


@dataclass
class CompileOptions:
    pins: dict = field(default_factory=dict)          # parameter name -> Placement
    loss_only: bool = False
    cost_model: CostModel = field(default_factory=CostModel)
    disable: tuple = ()                               # pass names to skip (bisecting)
    dump: str | None = None
