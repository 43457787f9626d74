"""A mesh's shape without processes: what the compiler is told instead of a communicator.

Ranks are laid out as ``torch.arange(world).view(dp, pp, tp)``: tp varies fastest, so a tensor-parallel
group is a run of consecutive ranks (one node), as in Megatron.
"""
from __future__ import annotations

from dataclasses import dataclass

AXES = ("dp", "pp", "tp")


@dataclass(frozen=True)
class MeshSpec:
    """Axis sizes of a (dp, pp, tp) mesh."""
    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self):
        for a in AXES:
            if not isinstance(getattr(self, a), int) or getattr(self, a) < 1:
                raise ValueError(f"mesh axis '{a}' must be an int >= 1, got {getattr(self, a)!r}")

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def axis_size(self, axis: str) -> int:
        return getattr(self, axis)

    def coords(self, rank: int) -> dict:
        """``{axis: index}`` of a global rank."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks {self}")
        return {"dp": rank // (self.pp * self.tp), "pp": rank // self.tp % self.pp, "tp": rank % self.tp}

    def rank_of(self, coords: dict) -> int:
        return (coords["dp"] * self.pp + coords["pp"]) * self.tp + coords["tp"]

    def group_ranks(self, rank: int, axis: str) -> list:
        """The global ranks of ``rank``'s group along ``axis`` (the others' coordinates fixed)."""
        c = self.coords(rank)
        return [self.rank_of({**c, axis: i}) for i in range(self.axis_size(axis))]
