"""Smoke test of the tensor-parallel benchmark harness (``python -m benchmarks.tp``) at a tiny size.

One timed step of every variant on 2 gloo ranks: each must produce a finite time, and all step-0 losses
must agree (the harness aborts with ``LossMismatch`` otherwise). Megatron-Core is optional (it is in the
``bench`` extra): without it the Megatron variant is reported as skipped, not failed.
"""
import importlib.util
import math
import os

import pytest

from benchmarks import tp as bench

TINY = ["--tp", "2", "--vocab", "64", "--layers", "1", "--hidden", "32", "--heads", "4", "--seq", "8",
        "--batch", "2", "--steps", "1", "--warmup", "0", "--timeout", "120"]


def test_bench_smoke(tmp_path):
    res = bench.main(TINY + ["--out", str(tmp_path)])
    (run,) = res["runs"]
    assert run["tp"] == 2 and run["vocab"] == 64
    rows = run["variants"]
    assert set(rows) == set(res["config"]["variants"]) and "autoshard" in rows

    have_megatron = importlib.util.find_spec("megatron") is not None
    for name, row in rows.items():
        if name == "megatron" and not have_megatron:
            assert not row["available"] and "megatron" in row["reason"]
            continue
        assert row["available"], f"{name}: {row}"
        assert len(row["step_ms"]) == 1
        assert all(math.isfinite(t) and t > 0 for t in row["step_ms"]), (name, row["step_ms"])
        assert math.isfinite(row["median_ms"]) and math.isfinite(row["min_ms"])
        assert math.isfinite(row["loss"])
    # the TP variants communicate; the single-process ones do not
    for name in ("dtensor", "autoshard") + (("megatron",) if have_megatron else ()):
        assert rows[name]["calls_per_step"] > 0 and rows[name]["bytes_per_step"] > 0
    assert rows["single_1t"]["calls_per_step"] == 0

    # every variant on every rank agreed on the step-0 loss (main() raises LossMismatch otherwise)
    losses = [v for per_rank in run["losses"] for v in per_rank.values()]
    ref = losses[0]
    assert all(abs(v - ref) <= bench.RTOL * abs(ref) for v in losses), run["losses"]

    assert os.path.exists(tmp_path / "tp_results.md") and os.path.exists(tmp_path / "tp_results.json")
    assert "autoshard" in (tmp_path / "tp_results.md").read_text()


def test_loss_check_catches_a_wrong_program():
    ok = [{"single_1t": 4.0, "megatron": 4.0 + 1e-6, "autoshard": 4.0}, {"megatron": 4.0, "autoshard": 4.0}]
    assert bench.check_losses(ok) is None
    bad = [{"single_1t": 4.0, "autoshard": 4.0}, {"autoshard": 4.01}]
    msg = bench.check_losses(bad)
    assert msg and "autoshard on rank 1" in msg
    assert "nan" in bench.check_losses([{"single_1t": 4.0, "dtensor": float("nan")}])


def test_pipeline_and_data_parallel_bench_smoke(tmp_path):
    """``benchmarks.pp`` (its torch comparison, which checks the losses agree first) and ``benchmarks.dp``
    at a tiny size: the one-command benchmarks keep running."""
    from benchmarks import dp as dp_bench
    from benchmarks import pp as pp_bench
    res = pp_bench.main(["--only", "torch", "--steps", "1", "--warmup", "0", "--hidden", "32", "--seq", "8",
                         "--batch", "4", "--m", "4", "--vocab", "64", "--out", str(tmp_path)])
    assert [r["v"] for r in res["torch"]] == [1, 2]
    assert all(abs(r["loss"] - r["torch_loss"]) <= 1e-5 * abs(r["torch_loss"]) for r in res["torch"])
    dp_bench.main(["--dp", "2", "--steps", "1", "--warmup", "0", "--layers", "2", "--hidden", "32", "--seq", "8",
                   "--batch", "2", "--vocab", "64", "--out", str(tmp_path)])
    assert (tmp_path / "dp_results.md").read_text().count("| 2 |") == 1


def test_recompute_bench_smoke(tmp_path):
    """``python -m benchmarks.recompute`` at a tiny size: equal losses, and less memory with recompute."""
    from benchmarks import recompute
    r = recompute.main(["--layers", "4", "--hidden", "64", "--seq", "64", "--batch", "2", "--vocab", "64",
                        "--reps", "1", "--out", str(tmp_path)])
    assert r["memory"]["recompute"] < r["memory"]["plain"], r["memory"]
    assert (tmp_path / "recompute_results.md").exists()


@pytest.mark.slow   # an extra benchmark; test_pipeline_carried.py checks the carried router logits
def test_moe_pipeline_bench_smoke(tmp_path):
    """``python -m benchmarks.pp_moe`` at a tiny size: the same loss either way, and the residual-only rule
    (no values carried) leaves stage 0 with layer 0 alone while carried router logits allow a later cut."""
    from benchmarks import pp_moe
    r = pp_moe.main(["--layers", "4", "--hidden", "64", "--seq", "8", "--batch", "4", "--vocab", "64",
                     "--reps", "1", "--rounds", "1", "--out", str(tmp_path)])
    v = r["variants"]
    assert v["residual only"]["layers"][0] == [0] and v["residual only"]["carried"] == [0]
    assert v["carried"]["carried"][0] >= 1 and v["carried"]["layers"][0][-1] >= 1
    assert (tmp_path / "pp_moe_results.md").exists()


def test_gpu_check_runs_on_cpu_ranks(tmp_path, monkeypatch):
    """``tests.gpu_check`` (the GPU machines' one command) runs here with ``--backend gloo``: its
    one-rank configurations pass and it writes its table (its NCCL run needs GPUs). Three of them, the
    script being what is checked here (the configurations' own parity runs in test_parity.py and
    test_pipeline.py), one of them CUDA-only, which the gloo run must leave out."""
    from tests import gpu_check
    configs = [c for c in gpu_check.CONFIGS[1] if c[2].get("cuda_graphs")][:1] + gpu_check.CONFIGS[1][1:3]
    monkeypatch.setitem(gpu_check.CONFIGS, 1, configs)
    assert gpu_check.main(["--backend", "gloo", "--world", "1", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "gpu_check.md").read_text()
    cpu = [c for c in configs if not c[2].get("cuda_graphs")]     # CUDA graphs run on GPUs only
    assert len(cpu) == 2
    assert table.count("| pass |") == len(cpu) and "FAIL" not in table


@pytest.mark.slow   # an extra benchmark; test_pipeline_compile.py and test_runtime.py check what it reports
def test_startup_bench_smoke():
    """``python -m benchmarks.startup`` at a tiny size: one trace a module, one program a step loop at dp=2."""
    from benchmarks import startup
    rows = startup.main(["--layers", "1", "--hidden", "32", "--seq", "16", "--vocab", "64", "--batch", "4",
                         "--out", "none"])
    assert all(r["traced"] == 1 for _, _, r in rows)
    assert [r["programs"] for m, loop, r in rows] == [2, 1, 1, 1]
