"""autoshard: compile a plain single-device GPT into a Megatron-style 3D-parallel (tensor, pipeline and
data parallel) training program.

    mesh = autoshard.init_mesh(tp=2)                       # under torchrun
    pm = autoshard.parallelize(model, mesh, example_args=(idx, targets))
    logits, loss = pm(idx, targets); loss.backward()      # pm.parameters() are this rank's shards

    mesh = autoshard.init_mesh(pp=2, tp=2)                 # a pipeline of 2 stages, each tp=2
    pm = autoshard.parallelize(model, mesh, (idx, targets), microbatches=4, schedule="1f1b")
    loss = pm.step(idx, targets)                           # the whole batch, as 4 microbatches

docs/architecture.md describes the data flow and where each concern lives.
"""
from autoshard.api import compile_options, compile_pipeline, compile_rank, compile_ranks, parallelize
from autoshard.checkpoint import load, save
from autoshard.ir import (CompileOptions, CostModel, DistSpec, MeshSpec, Partial, Program, Replicate, Shard)
from autoshard.launcher import RankError, launch
from autoshard.mesh import init_mesh
from autoshard.ir.errors import InputError
from autoshard.ir.options import PipelineOptions
from autoshard.runtime.data_parallel import data_parallel_rank, local_batch
from autoshard.runtime.module import ParallelModule
from autoshard.runtime.executor import PipelineError
from autoshard.planner import Cluster, ModelShape, Plan, plan
# the errors a user may catch, each named where it is raised
from autoshard.passes.capture import CaptureError
from autoshard.passes.microbatch_loss import LossError
from autoshard.passes.pipeline_split import PipelineSplitError
from autoshard.passes.plan import PlanError
from autoshard.planner.memory_ladder import MemoryLimitError

__all__ = ["init_mesh", "parallelize", "compile_rank", "compile_ranks", "compile_pipeline", "compile_options", "PipelineOptions",
           "PipelineError", "InputError", "local_batch", "data_parallel_rank", "save", "load", "launch", "RankError", "Program", "ParallelModule", "CompileOptions",
           "MeshSpec", "CostModel", "DistSpec", "Shard", "Replicate", "Partial", "plan", "Plan", "Cluster",
           "ModelShape", "CaptureError", "LossError", "PipelineSplitError", "PlanError", "MemoryLimitError"]
