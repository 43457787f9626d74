"""The vocabulary compiler and runtime share, depending on neither: placements per mesh axis, the plan
of a placement change as steps, the graph's parallel ops as data, typed ``node.meta`` keys, options, and
the program records. ``passes/`` and ``autoshard/runtime/`` both import this; neither imports the other.
"""
from autoshard.ir.mesh import AXES, MeshSpec
from autoshard.ir.options import CompileOptions, CostModel
from autoshard.ir.placement import DistSpec, P, Partial, Placement, R, Replicate, Shard
from autoshard.ir.program import Captured, CollectiveRecord, ParamRecord, PlanReport, Program

__all__ = ["AXES", "MeshSpec", "CompileOptions", "CostModel", "DistSpec", "P", "Partial", "Placement", "R",
           "Replicate", "Shard", "Captured", "CollectiveRecord", "ParamRecord", "PlanReport", "Program"]
