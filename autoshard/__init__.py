"""autoshard: compile a plain single-device GPT into a Megatron-style tensor-parallel program.

    mesh = autoshard.init_mesh(tp=2)                       # under torchrun
    pm = autoshard.parallelize(model, mesh, example_args=(idx, targets))
    logits, loss = pm(idx, targets); loss.backward()      # pm.parameters() are this rank's shards
"""
from autoshard.api import Program, compile_rank, parallelize
from autoshard.config import CompileOptions, MeshSpec
from autoshard.mesh import init_mesh
from autoshard.passes.cost import CostModel
from autoshard.passes.spec import Partial, Replicate, Shard

__all__ = ["init_mesh", "parallelize", "compile_rank", "Program", "CompileOptions", "MeshSpec", "CostModel",
           "Shard", "Replicate", "Partial"]
