"""What a training loop needs beyond forward and backward: the global gradient norm and a replica check.

Both work on local tensors and this rank's communicators, so they hold on any mesh (and in the thread
simulator). ``torch.nn.utils.clip_grad_norm_(pm.parameters(), ...)`` gives the same norm on a real mesh,
where the parameters are DTensors; ``pm.clip_grad_norm_`` is the form that also covers what plain torch
cannot see (the norm over every pipeline stage, a tied weight's two copies counted once).
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from autoshard.ir.errors import InputError
from autoshard.ir.placement import Shard
from autoshard.runtime.comm import AxisComm, CommCounting, collective_device


def _local_grads(pm):
    """(sharded local grads, replicated grads): every replicated gradient is whole on every tp rank."""
    sharded, replicated = [], []
    skip = getattr(pm, "duplicate_params", ())   # a tied weight's second copy on another pp rank
    for name, p in pm.local_parameters().items():
        if p.grad is None or name in skip:
            continue
        g = p.grad
        g = g.to_local() if hasattr(g, "to_local") else g
        (sharded if isinstance(pm.records[name].spec.tp, Shard) else replicated).append(g)
    return sharded, replicated


@torch.no_grad()
def total_norm(pm, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of every gradient of the model, as the single-device model would compute it."""
    norm_type = float(norm_type)
    sharded, replicated = _local_grads(pm)
    tp, pp = pm.tp, pm.comms["pp"]
    device = (sharded + replicated)[0].device if sharded + replicated else collective_device()
    if norm_type == float("inf"):
        local = torch.stack([g.abs().max().float() for g in sharded + replicated] or [torch.zeros((), device=device)]).max()
        local = tp.all_reduce(local.reshape(1), "clip", op=dist.ReduceOp.MAX)
        return pp.all_reduce(local, "clip", op=dist.ReduceOp.MAX)[0]
    # sum |g|^p: shards summed over tp, replicas counted once (they are identical on every rank)
    part = sum((g.float().abs() ** norm_type).sum() for g in sharded) if sharded else torch.zeros((), device=device)
    whole = sum((g.float().abs() ** norm_type).sum() for g in replicated) if replicated else torch.zeros((), device=device)
    total = tp.all_reduce(torch.as_tensor(part, dtype=torch.float32).reshape(1).clone(), "clip")[0] + whole
    total = pp.all_reduce(total.reshape(1).clone(), "clip")[0]   # every pipeline stage's share
    return total ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(pm, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))``, as torch's ``clip_grad_norm_``.

    The norm is the same number on every rank (one all-reduce), so a non-finite norm gives the same
    decision everywhere: with ``error_if_nonfinite`` every rank raises.
    """
    norm = total_norm(pm, norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({float(norm)}): "
                           "every rank stops here; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in pm.local_parameters().values():
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        g.mul_(coef.to(g.dtype))
    return norm


def check_finite(pm, loss, step: int, grads: bool) -> None:
    """Raise on every rank, naming the step, if the loss (the same number on every rank) or, with
    ``grads``, the global gradient norm (one all-reduce, the same everywhere) is NaN or inf: Megatron's
    ``check_for_nan_in_loss_and_grad``. Every rank takes the same decision, so none is left in a
    collective."""
    if loss is not None and not bool(torch.isfinite(loss.detach()).all()):
        raise FloatingPointError(f"step {step}: the loss is {float(loss.detach())} (non-finite): the run diverged or "
                                 "a batch holds NaN/inf; lower the learning rate, clip gradients, check the data, or "
                                 "resume from the last checkpoint")
    if grads:
        norm = total_norm(pm)
        if not bool(torch.isfinite(norm)):
            raise FloatingPointError(f"step {step}: the gradient norm is {float(norm)} (non-finite) with a finite loss: "
                                     "some gradient overflowed; lower the learning rate or clip gradients")


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def check_replicas(pm):
    """Hash every parameter that should be identical on several ranks and compare the hashes: replicated
    parameters across tp ranks, every shard across dp replicas, a tied weight's copies across its pp stages.

    Copies must stay bit-identical: a rank that scaled, clipped or updated them differently trains
    another model from then on. Every rank raises, naming the parameters.
    """
    local = {name: (p.to_local() if hasattr(p, "to_local") else p) for name, p in pm.local_parameters().items()}
    replicated = {n: t for n, t in local.items() if not isinstance(pm.records[n].spec.tp, Shard)}
    _compare(pm.tp, replicated, "tensor-parallel ranks")
    _compare(pm.comms.get("dp"), local, "data-parallel replicas")
    for name, group in getattr(pm, "tie_groups", {}).items():
        if name in local and group is not None:
            tied = AxisComm("pp", dist.get_world_size(group), dist.get_rank(group), group)
            _compare(tied, {name: local[name]}, "pipeline stages holding the tied weight")


def _compare(comm, tensors: dict, who: str) -> None:
    """Raise if ``tensors`` differ (by digest) between the ranks of ``comm`` (an ``AxisComm``, or None)."""
    if comm is None or comm.size == 1:
        return
    mine = {n: _digest(t) for n, t in tensors.items()}
    if comm.group is None:  # the thread simulator: its communicator exchanges tensors, not objects
        every = comm.exchange_objects(mine)
    else:
        every = comm.all_gather_objects(mine)
    drifted = sorted(n for n in mine if len({e.get(n) for e in every}) > 1)
    if drifted:
        raise RuntimeError(f"parameters that should be identical differ between the {comm.size} {who}: {drifted}. "
                           "Something changed them on some ranks only (a per-rank gradient scale, a clip by a "
                           "local norm, a different seed); training from here trains different models")


def check_same_weights(model, where: str, mesh_size: int) -> None:
    """At set-up, on every rank: every rank built its model from the same weights (one digest a rank,
    all-gathered over the whole world). Each rank takes its shards from its own copy, so a forgotten seed
    would make the tp shards pieces of different models, the dp replicas different models, and a tied
    weight's two pipeline copies different tensors: an error naming the fix instead, before training."""
    if mesh_size == 1 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return          # a one-rank module (rank 0's evaluation copy, say) may be built on some ranks only
    digest = hashlib.sha1()
    for name, p in model.named_parameters():
        if not p.is_meta:     # a meta parameter is drawn from its name, the same on every rank
            digest.update(f"{name}:{float(p.detach().double().sum()):.10e}".encode())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest.hexdigest())
    differ = [r for r, d in enumerate(every) if d != every[0]]
    if differ:
        raise RuntimeError(f"{where}: the model's weights on rank {differ[0]} differ from rank 0's, but every rank "
                           "must start from the same weights (each takes its shards, its replica or its tied copy "
                           "from its own model): seed every rank the same (torch.manual_seed) before building the "
                           "model, or load one checkpoint on every rank")


class TrainingMethods(CommCounting):
    """What ``ParallelModule`` gives a training loop, over ``self.params``
    (``ShardedParameters``) and ``self.comms`` (one AxisComm per mesh axis)."""

    @property
    def tp(self):
        return self.comms["tp"]

    @property
    def records(self) -> dict:
        return self.params.records

    def local_parameters(self) -> dict:
        """``{original name: parameter}`` (a DTensor on a real mesh, a local tensor otherwise)."""
        return {name: self.params.param(name) for name in self.params.keys}

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's parameters under the model's own names (``transformer.h.0.attn.c_attn.weight``, not
        the internal ``params.shards.p3``), as the single-device model names them: for param groups,
        logging and clipping by name. A tied weight appears once, under its first name."""
        for name, p in self.local_parameters().items():
            yield (f"{prefix}.{name}" if prefix else name), p

    def model_parameter_names(self) -> dict:
        """Every parameter name of the single-device model, on every stage, to the name ``pm`` gives it (a
        tied weight's other names to the one its copies go by)."""
        captured = self.program.captured
        return {**{n: n for n in captured.param_names}, **captured.aliases}

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of parameter ``name``'s shard (or its gradient); a collective when sharded."""
        return self.params.gather(name, local)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """Clip every gradient by the norm over the whole model: every rank's shards and every pipeline
        stage, replicas and a tied weight's second copy counted once."""
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    @torch.no_grad()
    def load_full_state_dict(self, state_dict, strict: bool = True):
        """Load a single-device state dict (original names, full shapes; a ``from_pretrained`` model's
        ``state_dict()``): each rank copies in its own shards of its own stages' parameters and buffers.
        This is how a model built on ``meta`` gets its real weights."""
        missing = [n for n in self.params.records if n not in state_dict]
        if strict and missing:
            raise InputError(f"the state dict lacks parameters {missing}: pass strict=False to load the rest")
        shapes = [f"'{n}': the state dict has shape {tuple(state_dict[n].shape)}, the model {tuple(r.global_shape)}"
                  for n, r in self.params.records.items()
                  if n in state_dict and tuple(state_dict[n].shape) != tuple(r.global_shape)]
        if shapes:      # before anything is copied: a half-loaded model is worse than none
            raise InputError(f"{shapes[0]}" + (f" (and {len(shapes) - 1} more)" if len(shapes) > 1 else "") +
                             ": this state dict is of another model config; load it into a model built like the "
                             "one that saved it")
        for name in self.params.records:
            if name in state_dict:
                self.params.load_full(name, state_dict[name])
        for name, buf in self._held_buffers().items():
            if name in state_dict:
                buf.copy_(state_dict[name])

    def check_replicas(self):
        """Raise on every rank, naming the parameters, if copies that should be identical have drifted."""
        check_replicas(self)

    def optimizer(self, optimizer_class, params=None, *, zero: int | None = None, **defaults):
        """A torch optimizer over this rank's parameters. ``params``, optional, are torch's param groups
        with parameters given by name or as this module's parameters (``[{"params": ["lm_head.weight"],
        "weight_decay": 0.0}, ...]``); a parameter in no group is not stepped, as in torch. ``zero=1`` (default:
        ``parallelize(zero=...)``) shards its state over the dp group (ZeRO-1, ``runtime/zero.py``)."""
        zero = getattr(self, "zero", 0) if zero is None else zero
        if zero not in (0, 1):
            raise ValueError(f"zero={zero!r}: autoshard implements ZeRO stage 1 (zero=1) or none (zero=0)")
        if zero == 1:
            from autoshard.runtime.zero import ZeroOptimizer
            return ZeroOptimizer(self, optimizer_class, params, **defaults)
        if params is None:
            return optimizer_class(self.parameters(), **defaults)
        from autoshard.runtime.zero import group_names
        local = self.local_parameters()
        return optimizer_class([{"params": [local[n] for n in names], **options}
                                for names, options in group_names(params, local, self.model_parameter_names())],
                               **defaults)


def register_state_dict_names(module) -> None:
    """``state_dict()`` and ``load_state_dict()`` of a ``ParallelModule`` under the model's own names
    (it holds ``params`` and buffers registered as ``b0``, ``b1``, ...)."""
    module._register_state_dict_hook(_state_dict_names)
    module._register_load_state_dict_pre_hook(_load_state_dict_names, with_module=True)


def _state_dict_names(module, state_dict, prefix, local_metadata):
    """``pm.state_dict()`` uses the model's own names (``params.shards.p3`` -> ``transformer.wte.weight``,
    ``b0`` -> the buffer's name, a tied weight under each of its names, as ``model.state_dict()``), and
    shows ``torch.distributed.checkpoint`` only rectangular chunks (``params.checkpoint_view``: for a
    blocked shard, such as a fused q|k|v, one all-gather over tp, so every tp rank calls it)."""
    for k in list(state_dict):
        rest = k[len(prefix):] if k.startswith(prefix) else None
        if rest is not None and rest.startswith("params.shards."):
            name = module.params.names[rest[len("params.shards."):]]
            state_dict[prefix + name] = module.params.checkpoint_view(name, state_dict.pop(k))
        elif rest is not None and rest[:1] == "b" and rest[1:].isdigit():
            state_dict[prefix + module._buffer_names[int(rest[1:])]] = state_dict.pop(k)
    for alias, main in module.aliases.items():     # a tied weight under each of its names, as torch's own
        if prefix + main in state_dict:
            state_dict[prefix + alias] = state_dict[prefix + main]
    return state_dict


def _load_state_dict_names(module, state_dict, prefix, *args):
    for alias, main in module.aliases.items():     # one tied weight: loaded once, from whichever name is there
        if prefix + alias in state_dict:
            value = state_dict.pop(prefix + alias)
            state_dict.setdefault(prefix + main, value)
    _leave_other_stages(module, state_dict, prefix, args[1] if len(args) > 1 else True)
    for name, k in module.params.keys.items():
        if prefix + name in state_dict:
            value = module.params.from_checkpoint_view(name, state_dict.pop(prefix + name))
            state_dict[prefix + "params.shards." + k] = value
    for i, b in enumerate(module._buffer_names):
        if prefix + b in state_dict:
            state_dict[prefix + f"b{i}"] = state_dict.pop(prefix + b)


def _leave_other_stages(module, state_dict, prefix, strict: bool) -> None:
    """A single-device state dict holds every stage's entries: this pipeline rank takes its own and leaves
    those another stage holds (a name no stage holds stays, for torch's strict check to report). First
    every entry is checked against every stage's records, alike on every rank: a rank that raised alone
    would leave the others waiting at the step's first transfer."""
    program = module.program
    chunks = getattr(program, "chunks", None)
    if chunks is None:
        return
    records = {r.name: r for c in chunks for r in c.params} | {r.name: r for r in getattr(program, "unread", [])}
    elsewhere = set(records) | {i.name for c in chunks for i in c.inputs if i.kind == "buffer"}
    held = set(module.params.keys) | set(module._buffer_names)
    given = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not any(name in given for name in elsewhere - held):
        return                        # this rank's own entries (pm.state_dict()): nothing to leave
    wrong = [f"'{n}' {tuple(given[n].shape)} (the model's is {tuple(r.global_shape)})" for n, r in records.items()
             if n in given and torch.is_tensor(given[n]) and not hasattr(given[n], "to_local")
             and tuple(given[n].shape) != tuple(r.global_shape)]
    missing = sorted(n for n in records if n not in given) if strict else []
    if wrong or missing:
        raise InputError("load_state_dict: the single-device state dict does not fit the model" +
                         (f": {len(wrong)} of other shapes, {wrong[:3]}" if wrong else "") +
                         (f"; missing {len(missing)}: {missing[:4]}" if missing else "") +
                         ". Load the state dict of this model's config (strict=False leaves missing ones as they are)")
    for name in (elsewhere - held) & set(given):
        state_dict.pop(prefix + name)
