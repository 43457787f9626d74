"""autoshard: compile a plain single-device GPT into a Megatron-style tensor-parallel program.

    mesh = autoshard.init_mesh(tp=2)                       # under torchrun
    pm = autoshard.parallelize(model, mesh, example_args=(idx, targets))
    logits, loss = pm(idx, targets); loss.backward()      # pm.parameters() are this rank's shards

docs/architecture.md describes the data flow and where each concern lives.
"""
from autoshard.api import compile_rank, parallelize
from autoshard.ir import (CompileOptions, CostModel, DistSpec, MeshSpec, Partial, Program, Replicate, Shard)
from autoshard.launcher import RankError, launch
from autoshard.mesh import init_mesh
from autoshard.runtime.module import ParallelModule

__all__ = ["init_mesh", "parallelize", "compile_rank", "launch", "RankError", "Program", "ParallelModule", "CompileOptions",
           "MeshSpec", "CostModel", "DistSpec", "Shard", "Replicate", "Partial"]
