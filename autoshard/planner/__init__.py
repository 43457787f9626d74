"""The planner: the whole (dp, pp, tp, b, m, v, recompute, zero) configuration for a cluster, predicted.

    plans = autoshard.plan(model_or_config, gpus=3072, cluster="dgx-a100", global_batch=1536)
    best = plans.best                         # a Plan: the mesh, microbatches, schedule, recompute, ZeRO
    mesh = autoshard.init_mesh(plan=best)
    pm = autoshard.parallelize(model, mesh, batch, plan=best)

``cluster.py`` holds the hardware as data (presets and ``Cluster.measure()``), ``shape.py`` the model's
sizes (read by ``config_reading.py`` from a config and, by ``layer_reading.py``, off its layers: MLA,
dense layers among MoE ones, hybrids' other token mixers, as ``blocks.py``'s records), ``cost.py`` the step time and memory of one configuration, ``runtimes.py`` the runtimes a plan can
be priced for (autoshard's, Megatron's, DeepSpeed's), ``search.py`` the search and its
reasons, ``report.py`` the table, ``plan.md`` and the plot, and ``cli.py`` ``python -m autoshard plan``.
``memory_ladder.py`` makes ``memory_limit`` a hard constraint for a mesh already chosen: the fastest of TP,
+ SP, + selective recompute, full recompute that fits (what ``parallelize(memory_limit=...)`` applies).
"""
from autoshard.planner.cluster import DGX_A100, DGX_H100, PRESETS, Cluster, Link, cluster_named
from autoshard.planner.config_reading import model_shape
from autoshard.planner.cost import Breakdown, Candidate, Memory, Prediction, predict
from autoshard.planner.runtimes import AUTOSHARD, RUNTIMES, Runtime, runtime_named
from autoshard.planner.search import Plan, Plans, candidates, plan
from autoshard.planner.shape import ModelShape

__all__ = ["plan", "Plan", "Plans", "Cluster", "Link", "DGX_A100", "DGX_H100", "PRESETS", "cluster_named",
           "ModelShape", "model_shape", "Candidate", "Runtime", "AUTOSHARD", "RUNTIMES", "runtime_named", "Prediction", "Breakdown", "Memory", "predict", "candidates"]
