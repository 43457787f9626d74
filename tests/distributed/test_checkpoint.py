"""autoshard.save / autoshard.load on gloo ranks: exact resume, another mesh, interrupted saves.

Trained on (dp, pp, tp) = (2, 2, 1) with ZeRO-1 and a tied head on two stages: 5 steps straight, or 2
steps, a save, and 3 more steps from a fresh model loaded from it, which must give bit-identical losses
and parameters (the RNG state and the step counter are in the checkpoint). The same checkpoint loads
on (1, 2, 2), where two more steps match the straight run's losses (the optimizer state resharded).
"""
from tests.harness.checkpoint_checks import suite
from tests.harness.distributed import run_distributed


def test_resume_reshard_and_refuse_partial(tmp_path):
    results = run_distributed(suite, 4, str(tmp_path / "ckpt"), timeout=600)
    for r in results:
        z = r["zero"]
        assert z["resumed"] == z["straight"][2:]                 # bit-identical losses after the resume
        assert z["same_params"]                                  # and parameters
        assert all(abs(a - b) < 1e-5 * abs(b) for a, b in zip(z["other"], z["straight"][2:4]))
        assert r["refused"] and "not a complete autoshard checkpoint" in r["refused"]


def test_lr_scheduler_state_is_saved_as_plain_json_and_checked_on_load(tmp_path):
    """One process, tp=1: the scheduler resumes where it was; another scheduler class, or state JSON
    cannot hold, is a clear error (the checkpoint stores no pickles)."""
    import pytest
    import torch

    import autoshard
    from autoshard.checkpoint import _plain
    from autoshard.ir.mesh import MeshSpec
    from autoshard.runtime.module import ParallelModule
    from tests.harness.models import batch, build

    model = build("gpt", vocab_size=96, n_layer=1)
    args, kwargs = batch("gpt", 96)

    def make():
        pm = ParallelModule(autoshard.compile_rank(model, MeshSpec(tp=1), 0, args, kwargs), model)
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        return pm, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    pm, opt, sched = make()
    for _ in range(3):
        opt.step()
        sched.step()
    autoshard.save(pm, opt, str(tmp_path / "ckpt"), step=3, scheduler=sched)
    pm2, opt2, sched2 = make()
    assert autoshard.load(pm2, opt2, str(tmp_path / "ckpt"), scheduler=sched2) == 3
    assert sched2.last_epoch == 3 and sched2.get_last_lr() == sched.get_last_lr() == [0.05]
    with pytest.raises(ValueError, match="holds a StepLR scheduler, not a LambdaLR"):
        autoshard.load(pm2, opt2, str(tmp_path / "ckpt"), scheduler=torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1))
    params = list(pm2.parameters())     # two param groups where the run that saved had one: refused, as torch does
    grouped = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}], lr=0.1)
    with pytest.raises(ValueError, match=r"saved from an optimizer with 1 param group\(s\), this one has 2"):
        autoshard.load(pm2, grouped, str(tmp_path / "ckpt"))
    with pytest.raises(TypeError, match=r"scheduler\.fn is a function"):
        _plain({"fn": lambda s: s}, "scheduler")
    # MultiStepLR keeps its milestones in a Counter with int keys: stored as pairs, a Counter again
    pm3, opt3, _ = make()
    multi = torch.optim.lr_scheduler.MultiStepLR(opt3, milestones=[1, 3], gamma=0.1)
    for _ in range(2):
        opt3.step()
        multi.step()
    autoshard.save(pm3, opt3, str(tmp_path / "multi"), scheduler=multi)
    pm4, opt4, _ = make()
    multi2 = torch.optim.lr_scheduler.MultiStepLR(opt4, milestones=[1, 3], gamma=0.1)
    autoshard.load(pm4, opt4, str(tmp_path / "multi"), scheduler=multi2)
    assert multi2.milestones == multi.milestones and type(multi2.milestones) is type(multi.milestones)
    for _ in range(2):
        opt3.step(), opt4.step(), multi.step(), multi2.step()
    assert multi2.get_last_lr() == multi.get_last_lr()


def test_a_tied_weight_saved_under_its_other_name_loads(tmp_path):
    """Checkpoints written before a tied weight took the name ``model.named_parameters()`` gives it
    (``transformer.wte.weight``) hold it as ``lm_head.weight``, optimizer state included: they still load."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    import autoshard
    from autoshard.checkpoint import _optim_state, _renamed
    from autoshard.ir.mesh import MeshSpec
    from autoshard.runtime.module import ParallelModule
    from tests.harness.models import batch, build

    model = build("gpt", vocab_size=96, n_layer=1)
    args, kwargs = batch("gpt", 96)

    def make():
        pm = ParallelModule(autoshard.compile_rank(model, MeshSpec(tp=1), 0, args, kwargs), model)
        return pm, torch.optim.AdamW(pm.parameters(), lr=0.1)
    pm, opt = make()
    assert pm.aliases == {"lm_head.weight": "transformer.wte.weight"}
    pm(*args, **kwargs)[1].backward()          # (logits, loss)
    opt.step()
    autoshard.save(pm, opt, str(tmp_path / "new"), step=1)
    old = {"transformer.wte.weight": "lm_head.weight"}
    dcp.save({"model": _renamed(pm.state_dict(), old), "optim": _renamed(_optim_state(pm, opt), old)},
             checkpoint_id=str(tmp_path / "old"))
    shutil.copy(tmp_path / "new" / "meta.json", tmp_path / "old" / "meta.json")
    pm2, opt2 = make()
    assert autoshard.load(pm2, opt2, str(tmp_path / "old")) == 1
    want, got = pm.full_state_dict(), pm2.full_state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert torch.equal(opt2.state[pm2.local_parameters()["transformer.wte.weight"]]["exp_avg"],
                       opt.state[pm.local_parameters()["transformer.wte.weight"]]["exp_avg"])
