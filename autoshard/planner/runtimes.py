"""The runtimes a plan can be priced for, as ``Runtime`` records, by name: autoshard's own, and the ones that measured the
published runs ``benchmarks/planner.py`` checks the planner against. A ``Runtime`` says only what the
planner prices beyond the plan (``planner/cost.py``): whether the dp reduction overlaps backward and in
what dtype it travels, whether ZeRO-1 reduce-scatters, whether the parameter gather overlaps the next
forward, whether the tp collectives are pipelined under their GEMMs, and whether the interleaved
schedule's sends overlap compute.

    autoshard.plan(model, 1024, "dgx-h100", 2048, runtime="megatron-core-overlapped")

plans for a Megatron Core run with all its overlaps on: the configuration to hand to Megatron, not to
``parallelize`` (which runs autoshard's runtime).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Runtime:
    """What the planner assumes of the program that runs a plan, beyond the plan: autoshard's own
    (``AUTOSHARD``), unless the planner is set against a run another runtime measured
    (``benchmarks/planner.py`` names each published run's)."""
    name: str = "autoshard"
    dp_overlap: bool = True     # the dp gradients are reduced beside the last backward (autoshard's buckets)
    grad_bytes: int = 4         # bytes a gradient element crosses the dp links in (fp32)
    # under ZeRO-1, each gradient is reduce-scattered to the dp rank that owns its optimizer state and the
    # updated parameters all-gathered: Megatron's distributed optimizer, DeepSpeed's ZeRO. autoshard's
    # ZeRO-1 all-reduces the gradients and each owner broadcasts its share (``runtime/zero.py``)
    sharded_grads: bool = False
    # ZeRO-1's parameter all-gather runs beside the next step's first forward (Megatron's
    # --overlap-param-gather); else it is exposed after the optimizer step
    param_gather_overlap: bool = False
    # under SP, the layers' tp collectives are cut in chunks and pipelined under the GEMMs beside them
    # (Megatron Core's --tp-comm-overlap, Transformer Engine's userbuffers, which needs SP); else they
    # are priced exposed, as Megatron-LM's of 2021-22 are. autoshard's column-parallel matmul does run
    # its input gradient's all-reduce beside dW (``ColumnParallelMatmul``): the planner does not credit it
    tp_overlap: bool = False
    # the interleaved schedule's pipeline sends and receives run beside the next chunk's compute (Megatron
    # Core's overlap_p2p_comm, on by default with virtual stages); else each is exposed
    p2p_overlap: bool = False


AUTOSHARD = Runtime()


# Megatron-LM of 2021-22: ``train_step`` reduced the dp gradients after the whole forward-backward
# (``optimizer.reduce_model_grads``; Megatron Core's overlapped reduction came later), in the training dtype
# unless --accumulate-allreduce-grads-in-fp32, which is off by default and forced on for bf16 (its
# arguments.py: "bfloat16 requires gradient accumulation and all-reduce to be done in fp32"). SC'21 trained in fp16.
MEGATRON_FP16 = Runtime("megatron-2021-fp16", dp_overlap=False, grad_bytes=2)
MEGATRON_BF16 = Runtime("megatron-2022-bf16", dp_overlap=False)
# Megatron Core with --overlap-grad-reduce (bf16, reduced in fp32)
MEGATRON_CORE = Runtime("megatron-core")
# Megatron Core r0.8.0's weak-scaling runs (its README): the distributed optimizer (ZeRO-1 that
# reduce-scatters the gradients), --overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap, and
# the pipeline's sends overlapped ("PP (enabled by default)": overlap_p2p_comm, interleaved schedule)
MEGATRON_CORE_OVERLAPPED = Runtime("megatron-core-overlapped", sharded_grads=True, param_gather_overlap=True,
                                   tp_overlap=True, p2p_overlap=True)
# DeepSpeed's pipeline engine (MT-NLG; Megatron-DeepSpeed for BLOOM) reduces after the last backward (its
# ReduceGrads instruction); bf16 runs with fp32 gradient accumulation
DEEPSPEED_PIPELINE = Runtime("deepspeed-pipeline", dp_overlap=False)
# Meta's Llama 3 runtime: FSDP-style, the reduce-scatter overlapped with backward, gradients reduced in fp32
# (the Llama 3 paper's numerical-stability notes)
LLAMA3 = Runtime("llama3")

RUNTIMES = {r.name: r for r in (AUTOSHARD, MEGATRON_FP16, MEGATRON_BF16, MEGATRON_CORE, MEGATRON_CORE_OVERLAPPED,
                                DEEPSPEED_PIPELINE, LLAMA3)}


def runtime_named(runtime) -> Runtime:
    """A preset by name (``RUNTIMES``), or the ``Runtime`` given."""
    if isinstance(runtime, Runtime):
        return runtime
    if isinstance(runtime, str) and runtime.lower() in RUNTIMES:
        return RUNTIMES[runtime.lower()]
    raise ValueError(f"runtime={runtime!r}: give a name of {sorted(RUNTIMES)} or an "
                     "autoshard.planner.Runtime(...) saying what the runtime overlaps")
