"""autoshard.save / autoshard.load on gloo ranks: exact resume, another mesh, interrupted saves.

Trained on (dp, pp, tp) = (2, 2, 1) with ZeRO-1 and a tied head on two stages: 5 steps straight, or 2
steps, a save, and 3 more steps from a fresh model loaded from it, which must give bit-identical losses
and parameters (the RNG state and the step counter are in the checkpoint). The same checkpoint loads
on (1, 2, 2), where two more steps match the straight run's losses (the optimizer state resharded).
"""
from tests.checkpoint_checks import suite
from tests.distributed import run_distributed


def test_resume_reshard_and_refuse_partial(tmp_path):
    results = run_distributed(suite, 4, str(tmp_path / "ckpt"), timeout=600)
    for r in results:
        z = r["zero"]
        assert z["resumed"] == z["straight"][2:]                 # bit-identical losses after the resume
        assert z["same_params"]                                  # and parameters
        assert all(abs(a - b) < 1e-5 * abs(b) for a, b in zip(z["other"], z["straight"][2:4]))
        assert r["refused"] and "not a complete autoshard checkpoint" in r["refused"]
