"""What a sharding rule returns (``Strategy``) and what it is given (``RuleContext``).

A strategy is one way an op can run locally on one mesh axis: the placement of its output and the
placement each input must arrive in. Rules list only strategies whose local computation is exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autoshard.ir.mesh import MeshSpec
from autoshard.ir.placement import R, Placement, Shard, shardable


@dataclass(frozen=True)
class Strategy:
    out: Placement
    ins: tuple                    # one placement per node.all_input_nodes entry
    lowering: str | None = None   # a local implementation other than the op itself
    comm: tuple = ()              # collectives inside the op (ir.redistribute.CommStep)
    sharded: bool = False         # True when each rank computes 1/t of the op


@dataclass
class RuleContext:
    """The mesh and the axis being planned (the rules see its size as ``t``)."""
    mesh: MeshSpec
    axis: str = "tp"
    hints: dict = field(default_factory=dict)      # node -> {(dim, blocks)} from fused-projection splits
    unruled: list = field(default_factory=list)    # nodes replicated because no rule knows their op

    @property
    def t(self) -> int:
        return self.mesh.axis_size(self.axis)


def _ins(node, mapping: dict):
    """Placements aligned with ``node.all_input_nodes``; inputs not named are Replicate."""
    return tuple(mapping.get(n, R) for n in node.all_input_nodes)


def blocks_order(k):
    """Sort key for a ``blocks`` value: equal-block counts first, then unequal sizes (a tuple, which
    does not compare with an int)."""
    return isinstance(k, tuple), k


def shard_options(node, shape, ctx: RuleContext, allow_pad=False):
    """All shards of a tensor: every dim t divides (or, if allowed, pads), plus blocked shards from hints."""
    opts = [Shard(d) for d, n in enumerate(shape) if n > 1 and shardable(n, ctx.t, 1, allow_pad)]
    for d, k in sorted(ctx.hints.get(node, ()), key=lambda h: (h[0], blocks_order(h[1]))):
        if shardable(shape[d], ctx.t, k):
            opts.append(Shard(d, k))
    return opts


def _replicated(node):
    return [Strategy(R, _ins(node, {}))]


def op_argument(node, name: str, default=None):
    """The value ``node`` passes for its op's argument ``name`` (positional or keyword), else its
    schema's default, else ``default``."""
    schema = getattr(node.target, "_schema", None)
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.name == name:
            if i < len(node.args) and not a.kwarg_only:
                return node.args[i]
            if name in node.kwargs:
                return node.kwargs[name]
            return a.default_value if a.has_default_value() else default
    return default


def has_argument(node, name: str) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.name == name for a in schema.arguments)
