"""``pm.state_dict()`` / ``pm.load_state_dict()`` as a torch user meets them at tp=2, on gloo: the
model's own keys (a tied weight under both its names), ``torch.save`` of the DTensors on every rank
(a fused q|k|v's blocked shard included), a DCP checkpoint that loads into the single-device model,
and a single-device state dict of full tensors loaded straight into ``pm``."""
import copy
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import autoshard
from autoshard.ir.errors import InputError
from tests.harness.distributed import run_distributed
from tests.harness.models import batch, build


def _state_dicts(rank, world, tmp):
    out = {}
    model = build("gpt", vocab_size=96, tie_weights=True)
    (idx, tgt), _ = batch("gpt", 96, B=4)
    pm = autoshard.parallelize(copy.deepcopy(model), autoshard.init_mesh(tp=world), (idx, tgt))
    opt = torch.optim.AdamW(pm.parameters(), lr=0.05)
    pm(idx, tgt)[1].backward()
    opt.step()
    trained = pm.full_state_dict()

    sd = pm.state_dict()
    out["keys"] = (sorted(sd), sorted(model.state_dict()))
    # torch.save of this rank's entries, and back
    path = os.path.join(tmp, f"rank{rank}.pt")
    torch.save(sd, path)
    back = torch.load(path, weights_only=True)
    out["saved"] = all(torch.equal(back[k].to_local(), sd[k].to_local()) if hasattr(sd[k], "to_local")
                       else torch.equal(back[k], sd[k]) for k in sd)

    # a DCP checkpoint of pm.state_dict() into the single-device model (one process reads it)
    dcp.save(sd, checkpoint_id=os.path.join(tmp, "dcp"))
    dist.barrier()
    if rank == 0:
        plain = build("gpt", vocab_size=96, tie_weights=True)
        want = plain.state_dict()
        dcp.load(want, checkpoint_id=os.path.join(tmp, "dcp"), no_dist=True)
        plain.load_state_dict(want)
        out["dcp into one device"] = max(float((plain.state_dict()[k] - trained[k]).abs().max()) for k in trained)
    dist.barrier()

    # a single-device state dict of full tensors, loaded straight into pm, and pm's own back
    fresh = autoshard.parallelize(copy.deepcopy(model), autoshard.init_mesh(tp=world), (idx, tgt))
    other = build("gpt", vocab_size=96, tie_weights=True)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    fresh.load_state_dict(other.state_dict())
    got = fresh.full_state_dict()
    out["full tensors"] = max(float((got[k] - v).abs().max()) for k, v in other.state_dict().items())
    fresh.load_state_dict(pm.state_dict())
    got = fresh.full_state_dict()
    out["round trip"] = max(float((got[k] - trained[k]).abs().max()) for k in trained)
    # on a pipeline each rank takes its own stage's entries of a single-device state dict (strict)
    piped = autoshard.parallelize(copy.deepcopy(model), autoshard.init_mesh(pp=world), (idx, tgt), microbatches=2)
    piped.load_state_dict(other.state_dict())
    got = piped.full_state_dict()
    out["pipeline full tensors"] = max(float((got[k] - v).abs().max()) for k, v in other.state_dict().items())
    # a wrong entry of either stage is an error on every pipeline rank (one raising alone would leave the
    # other waiting at the step's first transfer)
    for name in ("transformer.h.0.mlp.c_fc.weight", "transformer.h.1.mlp.c_fc.weight"):
        cut = dict(other.state_dict())
        cut[name] = cut[name][:3]
        try:
            piped.load_state_dict(cut)
            out[f"pipeline wrong {name}"] = None
        except InputError as e:
            out[f"pipeline wrong {name}"] = str(e)
    bad = dict(other.state_dict())
    bad["transformer.h.0.mlp.c_fc.weight"] = bad["transformer.h.0.mlp.c_fc.weight"][:5]
    try:
        fresh.load_state_dict(bad)
        out["wrong shape"] = None
    except InputError as e:
        out["wrong shape"] = str(e)
    return out


def test_state_dict_as_torch_users_use_it(tmp_path):
    results = run_distributed(_state_dicts, 2, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        mine, model = r["keys"]
        assert mine == model                          # lm_head.weight (tied) included
        assert r["saved"]
        assert r["full tensors"] == 0.0 and r["round trip"] == 0.0 and r["pipeline full tensors"] == 0.0
        assert r["wrong shape"] and "transformer.h.0.mlp.c_fc.weight" in r["wrong shape"] \
            and "(5, 32)" in r["wrong shape"] and "(128, 32)" in r["wrong shape"]
        for name in ("transformer.h.0.mlp.c_fc.weight", "transformer.h.1.mlp.c_fc.weight"):
            message = r[f"pipeline wrong {name}"]
            assert message and name in message and "(3, 32)" in message, (rank, name, message)
    assert results[0]["dcp into one device"] == 0.0
