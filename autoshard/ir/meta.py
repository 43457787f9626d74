"""Every ``node.meta`` key autoshard writes, declared once, with the pass that provides it.

Passes read and write them through the accessors, never through string literals, so a pass that runs
without its inputs fails with a message that names the key and the pass that provides it (instead of a
``KeyError`` two passes later). The pass manager checks the same declarations before anything runs.

torch's own keys are read as they are: ``val`` (the FakeTensor from export), ``nn_module_stack``.
"""
from __future__ import annotations

from dataclasses import dataclass

_MISSING = object()


class MissingMetaError(RuntimeError):
    """A pass read a node annotation that no earlier pass wrote."""


@dataclass(frozen=True)
class MetaKey:
    key: str            # the string under node.meta
    provided_by: str    # the pass that writes it
    doc: str

    def get(self, node, default=_MISSING):
        if self.key in node.meta:
            return node.meta[self.key]
        if default is not _MISSING:
            return default
        raise MissingMetaError(f"node '{node.name}' ({node.format_node()}) has no '{self.key}' annotation: "
                               f"pass '{self.provided_by}' provides it; was it disabled or did it skip this node?")

    def set(self, node, value):
        node.meta[self.key] = value

    def has(self, node) -> bool:
        return self.key in node.meta


KIND = MetaKey("autoshard_kind", "capture", "placeholders: 'parameter', 'buffer' or 'input'")
NAME = MetaKey("autoshard_name", "capture", "placeholders: the original parameter/buffer name, or the input's")
REQUIRES_GRAD = MetaKey("autoshard_requires_grad", "capture",
                        "whether the value carries a gradient (placeholders from capture, every node from plan)")
STRATEGY = MetaKey("autoshard_strategy", "plan", "the chosen tensor-parallel Strategy (output and input placements)")
SPEC = MetaKey("autoshard_spec", "plan", "DistSpec: one placement per mesh axis of the node's output")
GLOBAL_SHAPE = MetaKey("autoshard_global_shape", "tp_rewrite", "the output's shape in the single-device model")
LOCAL_SHAPE = MetaKey("autoshard_local_shape", "tp_rewrite", "the output's shape on this rank")
SOURCE = MetaKey("autoshard_source", "tp_rewrite", "collective nodes: the node whose value they move")
LOCAL_VAL = MetaKey("autoshard_local_val", "check_local_shapes",
                    "a meta tensor of the node's local value: shape, dtype and strides on this rank")

RECOMPUTE = MetaKey("autoshard_recompute", "recompute", "nodes of a recomputed region (one layer): its index")
CUT = MetaKey("autoshard_cut", "pipeline_split",
              "a value a stage cut sends, under the name the stage plan gives it: found again by this tag when "
              "a rewrite replaced the node under another name (copying its meta)")
ALL = (KIND, NAME, REQUIRES_GRAD, STRATEGY, SPEC, GLOBAL_SHAPE, LOCAL_SHAPE, SOURCE, LOCAL_VAL, RECOMPUTE, CUT)

# Graph-level facts live in ``GraphModule.meta`` under these keys.
PLAN_REPORT = "autoshard_plan_report"
FUSION_REPORT = "autoshard_fusion_report"     # ir.fusion.FusionReport, from the fuse pass
CHUNKED_LOSS = "autoshard_chunked_loss"       # passes.chunk_loss.ChunkedLossReport, from chunk_loss
RECOMPUTE_PLAN = "autoshard_recompute_plan"   # ir.recompute.RecomputePlan, from the recompute pass
