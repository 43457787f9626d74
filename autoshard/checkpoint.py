"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): ``autoshard.save`` / ``autoshard.load``.

Every rank writes its own shards: the parameters as the DTensors ``pm.state_dict()`` shows (original
names, global shapes), and the optimizer state keyed by parameter *name* (not torch's integer ids), its
tensors DTensors with their parameter's placement. DCP records each shard's place in the global
tensor, so a checkpoint loads on another mesh (another tp, pp or dp size): each rank asks for what it
now holds and DCP reads and reshards it. Non-tensor facts (the step, the optimizer's hyper-parameters,
the LR scheduler's state, the mesh) go to ``meta.json``, and each rank's RNG state to ``rng/rank<N>.pt`` as a plain tensor, read
back with ``weights_only=True``: loading unpickles nothing.

A save is written to ``<path>.partial`` and renamed to ``<path>`` by rank 0 after every rank has
finished, with ``meta.json`` written last: a directory without it (an interrupted save) is refused.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from autoshard.ir.errors import InputError

FORMAT = 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _named(pm, optimizer) -> list:
    """``[(name, parameter)]`` the optimizer updates on this rank (all of pm's, or a ZeRO-1 share)."""
    inner = getattr(optimizer, "inner", optimizer)
    by_id = {id(p): n for n, p in pm.local_parameters().items()}
    return [(by_id[id(p)], p) for g in inner.param_groups for p in g["params"] if id(p) in by_id]


def _optim_state(pm, optimizer) -> dict:
    """``{"<param>.<key>": tensor}``: each parameter's optimizer state under its name. A state tensor
    shaped like its parameter is shown as the parameter is (``checkpoint_view``: a strided shard as an
    even one), so DCP can reshard it."""
    inner = getattr(optimizer, "inner", optimizer)
    out = {}
    for name, p in _named(pm, optimizer):
        for key, value in inner.state.get(p, {}).items():
            if torch.is_tensor(value):
                if value.dim() and value.shape == p.shape:
                    value = pm.params.checkpoint_view(name, value)
                out[f"{name}.{key}"] = value
    return out


def _init_state(pm, optimizer) -> None:
    """Give every parameter its optimizer state (Adam's moments are made on the first step), with a step
    at lr 0 on zero gradients, as ``torch.distributed.checkpoint.state_dict`` does; nothing moves."""
    inner = getattr(optimizer, "inner", optimizer)
    named = [(n, p) for n, p in _named(pm, optimizer) if p.requires_grad]    # a frozen one has no state
    if all(p in inner.state for _, p in named):
        return
    saved_grads = {n: p.grad for n, p in named}
    lrs = [g["lr"] for g in inner.param_groups]
    for _, p in named:
        p.grad = torch.zeros_like(p)
    for g in inner.param_groups:
        g["lr"] = 0.0
    inner.step()
    for g, lr in zip(inner.param_groups, lrs):
        g["lr"] = lr
    for n, p in named:
        p.grad = saved_grads[n]


def _hyper(optimizer) -> list:
    inner = getattr(optimizer, "inner", optimizer)
    return [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str, list, tuple))
             and not torch.is_tensor(v)} for g in inner.param_groups]


def _rng_paths(path: str) -> tuple:
    return (os.path.join(path, "rng", f"rank{_rank()}.pt"), os.path.join(path, "rng", f"rank{_rank()}_cuda.pt"))


_PAIRS = "__pairs__"     # a dict whose keys are not all strings (MultiStepLR's milestones), as key-value pairs


def _plain(value, where: str):
    """``value`` as JSON holds it (numbers, strings, lists, dicts; a dict with other keys as its pairs),
    else a clear error naming the entry: the checkpoint stores no pickles."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value) and _PAIRS not in value:
        return {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, dict) and all(isinstance(k, (bool, int, float, str)) for k in value):
        return {_PAIRS: [[k, _plain(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise TypeError(f"{where} is a {type(value).__name__}, which an autoshard checkpoint does not store (it holds "
                    "no pickles): save this scheduler's state yourself, or pass scheduler=None")


def _restored(value, like):
    """What ``_plain`` wrote, back: pairs become a dict of ``like``'s type (a ``Counter`` stays one)."""
    if isinstance(value, dict) and set(value) == {_PAIRS}:
        kind = type(like) if isinstance(like, dict) else dict
        return kind({k: v for k, v in value[_PAIRS]})
    if isinstance(value, dict):
        return {k: _restored(v, like.get(k) if isinstance(like, dict) else None) for k, v in value.items()}
    return value


def _scheduler_meta(scheduler) -> dict | None:
    if scheduler is None:
        return None
    return {"class": type(scheduler).__name__, "state": _plain(scheduler.state_dict(), "scheduler.state_dict()")}


def save(pm, optimizer, path: str, step: int | None = None, scheduler=None) -> str:
    """Write a sharded checkpoint of ``pm``, ``optimizer`` (may be None) and an LR ``scheduler`` (optional)
    to ``path``; every rank calls it. Returns the path."""
    path = os.path.normpath(path)      # "ckpt/" and "ckpt" are one checkpoint (and tmp is its sibling)
    schedule = _scheduler_meta(scheduler)   # before any file is written: an unstorable one is refused first
    tmp = f"{path}.partial"
    if _rank() == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    _barrier()
    state = {"model": _model_state(pm)}
    if optimizer is not None:
        state["optim"] = _optim_state(pm, optimizer)
    dcp.save(state, checkpoint_id=tmp)
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    cpu_rng, cuda_rng = _rng_paths(tmp)
    torch.save(torch.get_rng_state(), cpu_rng)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # dropout on a GPU draws from its generator
        torch.save(torch.cuda.get_rng_state(), cuda_rng)
    _barrier()
    if _rank() == 0:
        prog = pm.program
        meta = {"format": FORMAT, "step": step, "mesh": {a: prog.mesh.axis_size(a) for a in ("dp", "pp", "tp")},
                "optimizer": type(getattr(optimizer, "inner", optimizer)).__name__ if optimizer is not None else None,
                "param_groups": _hyper(optimizer) if optimizer is not None else [], "scheduler": schedule}
        with open(os.path.join(tmp, "meta.json"), "w") as f:   # last: its presence marks a whole checkpoint
            json.dump(meta, f, indent=1)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    _barrier()
    return path


def _model_state(pm) -> dict:
    """``pm.state_dict()`` with each tied weight under one name: a checkpoint holds it once."""
    return {k: v for k, v in pm.state_dict().items() if k not in pm.aliases}


def _tied_names_held(pm, held) -> dict:
    """``{name: alias}`` for each tied weight the checkpoint holds under its other name only (saved before
    autoshard named a tied weight as ``model.named_parameters()`` does: ``lm_head.weight``)."""
    return {main: alias for alias, main in pm.aliases.items()
            if f"model.{main}" not in held and f"model.{alias}" in held}


def _renamed(values: dict, names: dict) -> dict:
    """``values`` with each key ``<name>`` or ``<name>.<state key>`` under ``names[name]`` instead."""
    if not names:
        return values
    out = {}
    for key, value in values.items():
        for old, new in names.items():
            if key == old or key.startswith(old + "."):
                key = new + key[len(old):]
                break
        out[key] = value
    return out


def _read_metadata(path: str) -> dict:
    """DCP's index of the checkpoint's tensors (name -> metadata), or a clear error for an unreadable one."""
    try:
        return dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a truncated index fails in pickle, io or DCP, each its own way
        raise InputError(f"{path}: the checkpoint's index (.metadata) could not be read ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}): it is truncated or corrupt; use an "
                         "earlier checkpoint") from e


def _first_cause(e: BaseException) -> str:
    """The first line of what failed, under DCP's wrapper (which lists every rank's traceback)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    causes = [line for line in lines if not line.startswith(("Traceback", "File ", "CheckpointException"))
              and ("Error" in line or "error" in line)]
    return (causes or lines or [type(e).__name__])[-1 if causes else 0][:300]


def _check_model_keys(path: str, mine: dict, held: dict) -> None:
    """Every rank's model entries against the checkpoint's, before DCP reads a byte: the keys it lacks,
    the keys it holds that no rank of this model has, and shapes that differ, gathered over the world so
    that every rank raises the same error (a rank that raised alone would leave the others in DCP's
    collectives)."""
    saved = {k[len("model."):]: v for k, v in held.items() if k.startswith("model.")}
    problems = {"missing": sorted(k for k in mine if k not in saved),
                "shapes": sorted(f"{k}: checkpoint {tuple(saved[k].size)}, model {tuple(v.shape)}"
                                 for k, v in mine.items() if k in saved and hasattr(saved[k], "size")
                                 and tuple(saved[k].size) != tuple(v.shape))}
    every = [(problems, sorted(mine))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (problems, sorted(mine)))
    ours = set().union(*(set(names) for _, names in every))
    missing = sorted(set().union(*(set(p["missing"]) for p, _ in every)))
    shapes = sorted(set().union(*(set(p["shapes"]) for p, _ in every)))
    unexpected = sorted(k for k in saved if k not in ours)
    if missing or unexpected or shapes:
        parts = [f"missing {len(missing)} entr{'y' if len(missing) == 1 else 'ies'} {missing[:6]}" if missing else "",
                 f"unexpected {len(unexpected)} {unexpected[:6]}" if unexpected else "",
                 f"other shapes {shapes[:4]}" if shapes else ""]
        raise InputError(f"{path} is a checkpoint of another model: " + "; ".join(p for p in parts if p) +
                         ". Load it into the model that saved it (same config), or load the matching weights "
                         "with pm.load_full_state_dict(sd, strict=False)")


def load(pm, optimizer, path: str, scheduler=None) -> int | None:
    """Load a checkpoint written by ``save`` (on this mesh or another) into ``pm``, ``optimizer`` and the
    LR ``scheduler`` (optional; build it on ``optimizer`` first, as for the run that saved); every rank
    calls it. Returns the saved step."""
    path = os.path.normpath(path)
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{path} is not a complete autoshard checkpoint (no meta.json): the save that wrote "
                                "it did not finish; use an earlier checkpoint")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')}, this autoshard reads {FORMAT}")
    if optimizer is not None:
        saved_class, want = meta.get("optimizer"), type(getattr(optimizer, "inner", optimizer)).__name__
        if saved_class is None:
            raise ValueError(f"{path} was saved without an optimizer (autoshard.save(pm, None, ...)): load it with "
                             "autoshard.load(pm, None, path), and the optimizer starts fresh")
        if saved_class != want:
            raise ValueError(f"{path} holds {saved_class} state, not {want}: load it into a {saved_class}, or "
                             "pass optimizer=None to load the model alone")
        groups, saved_groups = len(getattr(optimizer, "inner", optimizer).param_groups), len(meta.get("param_groups", []))
        if groups != saved_groups:   # torch's load_state_dict refuses this too: the hyperparameters would land
            raise ValueError(f"{path} was saved from an optimizer with {saved_groups} param group(s), this one has "
                             f"{groups}: build it with the same groups (in the same order) as the run that saved")
    saved_schedule = meta.get("scheduler")
    if scheduler is not None and (saved_schedule or {}).get("class") != type(scheduler).__name__:
        raise ValueError(f"{path} holds " + (f"a {saved_schedule['class']} scheduler" if saved_schedule else
                                             "no LR scheduler (autoshard.save(..., scheduler=None))")
                         + f", not a {type(scheduler).__name__}: pass the scheduler the run saved, or scheduler=None")
    held = _read_metadata(path)
    renamed = _tied_names_held(pm, held)
    state = {"model": _renamed(_model_state(pm), renamed)}
    _check_model_keys(path, state["model"], held)
    if optimizer is not None:
        _init_state(pm, optimizer)
        # a parameter not yet stepped when it was saved has no state there: it gets none here either
        optim = _renamed(_optim_state(pm, optimizer), renamed)
        state["optim"] = {k: v for k, v in optim.items() if f"optim.{k}" in held}
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:   # DCP's own is a BaseException carrying every rank's failure
        raise InputError(f"{path}: reading the checkpoint's tensors failed ({_first_cause(e)}): a file is truncated "
                         "or corrupt, or comes from another save; use an earlier checkpoint") from e
    back = {v: k for k, v in renamed.items()}
    state = {part: _renamed(values, back) for part, values in state.items()}
    pm.load_state_dict(state["model"])
    if optimizer is not None:
        inner = getattr(optimizer, "inner", optimizer)
        with torch.no_grad():
            for name, p in _named(pm, optimizer):
                values = inner.state.get(p, {})
                if any(torch.is_tensor(v) and f"{name}.{k}" not in state["optim"] for k, v in values.items()):
                    inner.state.pop(p)
                    continue
                for key, value in values.items():
                    if torch.is_tensor(value):
                        loaded = state["optim"][f"{name}.{key}"]
                        if value.dim() and value.shape == p.shape:
                            loaded = pm.params.from_checkpoint_view(name, loaded)
                        value.copy_(loaded)
        for g, saved in zip(inner.param_groups, meta.get("param_groups", [])):
            g.update({k: tuple(v) if isinstance(g.get(k), tuple) else v for k, v in saved.items()})
    if scheduler is not None:
        scheduler.load_state_dict(_restored(saved_schedule["state"], scheduler.state_dict()))
        if optimizer is None:    # the schedule's next rate starts from its optimizer's current one
            for g, saved in zip(scheduler.optimizer.param_groups, meta.get("param_groups", [])):
                if "lr" in saved:
                    g["lr"] = saved["lr"]
    cpu_rng, cuda_rng = _rng_paths(path)
    if os.path.exists(cpu_rng) and meta.get("mesh") == {a: pm.program.mesh.axis_size(a) for a in ("dp", "pp", "tp")}:
        torch.set_rng_state(torch.load(cpu_rng, weights_only=True))
        if os.path.exists(cuda_rng) and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.load(cuda_rng, weights_only=True))
    return meta.get("step")
