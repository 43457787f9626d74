"""Zero-bubble pipelines (``schedule="zb-h1"``, ``"zb-h2"`` and ``"zb-v"``) on gloo ranks: each stage's backward runs as B (the input
gradient) and W (the matmuls' weight gradients, ``passes/weight_grad.py``), and ``pm.step`` must still
match the single-device model on the whole batch: the loss, every gradient gathered to full shape, then
3 AdamW steps, on batches whose microbatches hold different numbers of ignored targets. Covers the tied
head (its two copies on two stages), full and selective recompute, tensor parallelism (the column-parallel
matmul's deferred dW), data parallelism with ZeRO-1 (the dp buckets arm at a stage's last W), and the
built-in GPT, HF GPT-2 and a Llama family model. Under ZB-V the first and last stages share rank 0, so
the tied head and its embedding are one rank's: no copy crosses ranks.
"""
import dataclasses

from autoshard.ir.options import CostModel
from tests.distributed.test_pipeline import _check
from tests.harness.distributed import run_distributed
from tests.harness.pipeline_checks import run_configs

GPT = dict(n_layer=4)
ZB = dict(microbatches=4, schedule="zb-h1")
ZBV = dict(microbatches=4, schedule="zb-v")     # two stages a rank in a V: 4 stages on 2 ranks
# priced with a free split of backward (a GPU's), "auto" chooses ZB-V on its own 4 stages
# (tests/unit/test_zero_bubble.py); then pm.eval_batch compiles on the same V
NO_SPLIT_COST = dataclasses.replace(CostModel.cpu(), weight_split_overhead=0.0, action_overhead=0.0, send_blocking=0.0)

TWO_RANKS = [
    ("gpt", dict(pp=2), ZB, GPT),
    ("gpt", dict(pp=2), dict(ZB, schedule="auto", cost_model=NO_SPLIT_COST, expect="zb-v", eval=True), GPT),
    ("gpt", dict(pp=2), dict(ZB, recompute=True, clip=0.05), GPT),
    ("hf", dict(pp=2), ZB, {}),
    ("hf", dict(pp=2), dict(ZB, recompute="selective"), {}),
    ("family", dict(pp=2), dict(ZB, late_receives=True), dict(family="llama", hidden=32, heads=4, kv_heads=2)),
    ("gpt", dict(pp=2), dict(ZB, schedule="zb-h2"), GPT),    # rank 0 warms up with 3 forwards, not 2
    ("gpt", dict(pp=2), ZBV, GPT),
    ("gpt", dict(pp=2), dict(ZBV, recompute=True, clip=0.05), GPT),
    ("hf", dict(pp=2), ZBV, {}),
    ("family", dict(pp=2), dict(ZBV, late_receives=True), dict(family="llama", hidden=32, heads=4, kv_heads=2)),
]
FOUR_RANKS = [
    ("gpt", dict(pp=2, tp=2), ZB, GPT),
    ("hf", dict(pp=2, tp=2), ZB, {}),
    # what the planner picks for most pipelined rows: ZB-H1 with sequence parallelism and selective recompute
    ("hf", dict(pp=2, tp=2), dict(ZB, sequence_parallel=True, recompute="selective"), {}),
    ("gpt", dict(dp=2, pp=2), dict(ZB, microbatches=2, zero=1), GPT),
    ("gpt", dict(pp=4), ZB, dict(n_layer=4, tie_weights=False)),
    ("gpt", dict(pp=4), dict(ZB, schedule="zb-h2"), dict(n_layer=4, tie_weights=False)),   # ranks 1, 2 warm up deeper
    ("gpt", dict(pp=2, tp=2), dict(ZBV, scatter_gather=True), GPT),   # W split, boundaries sent as tp slices
    ("gpt", dict(dp=2, pp=2), dict(ZBV, microbatches=2, zero=1), GPT),
]


def test_zero_bubble_two_ranks():
    results = run_distributed(run_configs, 2, TWO_RANKS, timeout=600)
    _check(TWO_RANKS, results)


def test_zero_bubble_four_ranks():
    results = run_distributed(run_configs, 4, FOUR_RANKS, timeout=600)
    _check(FOUR_RANKS, results)
