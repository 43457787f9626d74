"""What ``parallelize``'s keywords become when a ``Plan`` (``autoshard.plan(...).best``) or the user
decides them: the plan's settings, checked against the mesh and the example batch, and the settings a
``memory_limit`` may choose (``planner/memory_ladder.py``) or must only check."""
from __future__ import annotations

import logging

import torch

from autoshard.ir.options import CompileOptions
from autoshard.planner.search import check_plan
from autoshard.runtime.microbatch import row_counts

log = logging.getLogger("autoshard")


def plan_keywords(plan, spec, args, kwargs, keywords: dict) -> dict:
    """``keywords`` with what ``plan`` (``autoshard.plan(...).best``) decides: microbatches, schedule,
    virtual stages, recompute and ZeRO, checked against the mesh and the example batch first. A keyword
    given as well must agree with the plan."""
    plan = check_plan(plan)
    if (spec.dp, spec.pp, spec.tp) != (plan.dp, plan.pp, plan.tp):
        raise ValueError(f"the plan is for dp={plan.dp} pp={plan.pp} tp={plan.tp}, the mesh is dp={spec.dp} "
                         f"pp={spec.pp} tp={spec.tp}: build the mesh with autoshard.init_mesh(plan=plan)")
    leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
    rows = row_counts(leaves)
    if len(rows) == 1 and rows != {plan.b * plan.m}:
        raise ValueError(f"the plan runs {plan.m} microbatches of {plan.b} sequences on each dp rank, so each rank's "
                         f"batch has {plan.b * plan.m} rows, but the example batch has {rows.pop()}: pass "
                         "autoshard.local_batch of a global batch of the plan's size")
    tokens = {x.shape[1] for x in leaves if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point()}
    if plan.seq and len(tokens) == 1 and tokens != {plan.seq}:
        raise ValueError(f"the plan was priced for sequences of {plan.seq} tokens, but the example batch's token "
                         f"ids have {tokens.pop()}: plan again with autoshard.plan(..., seq=...) for this length")
    if not plan.fits:
        log.warning("autoshard: this plan was predicted not to fit (%s)", plan.why or "see plans.too_big")
    if plan.runtime != "autoshard":
        log.warning("autoshard: this plan was priced for the %r runtime, whose overlaps autoshard's runtime does "
                    "not all have: its predicted step is not autoshard's (plan(..., runtime='autoshard') prices it)",
                    plan.runtime)
    out = dict(keywords)
    for k, v in plan.parallelize_options().items():
        if k in out and out[k] != v:
            fix = (" (the plan was priced at bf16 compute: for an fp32 plan, plan on a cluster of compute_dtype='fp32', "
                   "e.g. DGX_A100.with_(compute_dtype='fp32', peak_flops=...))" if k == "mixed_precision" else "")
            raise ValueError(f"parallelize({k}={out[k]!r}, plan=...) disagrees with the plan's {k}={v!r}: "
                             f"pass one of them{fix}")
        out[k] = v
    return out


MEMORY_SETTINGS = {"recompute": "auto", "sequence_parallel": False}     # what memory_limit may choose, defaults


def user_memory_settings(keywords: dict, options: CompileOptions | None, plan) -> set:
    """The settings ``memory_limit`` must not change, only check: given as keywords (an explicit
    ``sequence_parallel=False`` too; ``recompute="auto"`` leaves the choice free), set away from their
    default in ``options=``, or decided by a plan."""
    if plan is not None:
        return set(MEMORY_SETTINGS)
    if options is not None:
        return {k for k, default in MEMORY_SETTINGS.items() if getattr(options, k) != default}
    return {k for k in MEMORY_SETTINGS if k in keywords and keywords[k] != "auto"}
