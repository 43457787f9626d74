"""This rank's parameters: created once from the model, shared by every compiled program.

With a device mesh, each parameter is a ``DTensor`` on the tp sub-mesh carrying the placement the
compiler chose, so ``torch.nn.utils.clip_grad_norm_``, torch optimizers and
``torch.distributed.checkpoint`` see the true global tensor:

- ``Shard(d)`` and ``Replicate()`` map to DTensor's own;
- a blocked shard (a fused q|k|v cut per block) is ``_StridedShard(d, split_factor=blocks)``, whose
  local layout is exactly ours (rank r holds its chunk of every block), so ``full_tensor()`` is the
  user's original weight. That placement is private and its meaning moved between releases (torch 2.11
  reads it as a shard order and cannot redistribute it on a 1-D mesh; 2.13 falls back to our reading),
  so ``strided_shards_work`` asks the running torch once, and where it says no a blocked shard is held
  in rank order like unequal blocks (below);
- a shard of unequal blocks (a grouped-query q|k|v) has no DTensor placement: it is an even ``Shard(d)``
  of the blocks in rank order (``held_in_rank_order``), and only our ``gather`` / ``state_dict()``
  give the user's tensor;
- a padded vocab shard (tp does not divide V) is DTensor's uneven ``Shard(0)``: torch's chunking gives
  the last rank fewer rows, which is our layout without the padding. The padding exists only in the
  graph: ``local_inputs`` pads the rows on the way in (and autograd slices the gradient back).

Without a mesh (the in-process simulator, compile-only runs) parameters are plain local tensors.
Under mixed precision the parameters stay fp32 (Megatron's main weights) and are cast to the
program's compute dtype on the way into the graph, so gradients accumulate in fp32.
"""
from __future__ import annotations

import copy
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.ir.errors import InputError, warn_user
from autoshard.ir.partial_grads import sum_over_tp
from autoshard.ir.placement import Shard, local_size, shard_range
from autoshard.runtime import fused_optim
from autoshard.runtime.layout import gather_full, pad_to, take_shard

try:  # DTensor and its strided placement (torch >= 2.5)
    from torch.distributed.tensor import DTensor, Replicate as DReplicate, Shard as DShard
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    DTensor = None


def dtensor_placement(placement):
    """DTensor's placement for ours. Unequal blocks have none: such a parameter is shown as an even
    ``Shard`` of its blocks in rank order (``held_in_rank_order``)."""
    if isinstance(placement, Shard):
        return _StridedShard(placement.dim, split_factor=placement.blocks) if held_strided(placement) \
            else DShard(placement.dim)
    return DReplicate()


_STRIDED_WORKS: bool | None = None   # this process's torch, once asked (strided_shards_work)


def strided_shards_work(mesh) -> bool:
    """Whether this torch's DTensor takes ``_StridedShard(0, split_factor=2)`` on ``mesh`` as our blocked
    layout: ``full_tensor()`` and a norm's reduction give the right values without raising. Asked once
    per process, by every rank of ``mesh`` at the same point (a collective of a few elements)."""
    global _STRIDED_WORKS
    if _STRIDED_WORKS is None:
        n, rank = mesh.size(), mesh.get_local_rank()
        full = torch.arange(4 * n, dtype=torch.float32, device=mesh.device_type)
        local = take_shard(full, 0, 4 * n, n, rank, 2).contiguous()
        try:   # a refusal is raised while planning the redistribution, on every rank alike
            dt = DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=2)], run_check=False,
                                    shape=full.shape, stride=(1,))
            norm = torch.linalg.vector_norm(dt)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            _STRIDED_WORKS = bool(torch.equal(dt.full_tensor(), full)) and \
                bool(torch.allclose(norm, torch.linalg.vector_norm(full)))
        except (ValueError, RuntimeError, NotImplementedError, AssertionError):
            _STRIDED_WORKS = False
    return _STRIDED_WORKS


def held_strided(placement) -> bool:
    """A blocked shard shown to DTensor as ``_StridedShard`` (where this torch reads it as we do)."""
    return isinstance(placement, Shard) and not placement.unequal and placement.blocks > 1 \
        and _STRIDED_WORKS is not False


def held_in_rank_order(placement) -> bool:
    """A shard of unequal blocks (a grouped-query q|k|v), or any blocked shard where this torch's
    ``_StridedShard`` is not ours: the DTensor's global tensor is every rank's blocks in rank order, a
    permutation of the user's. Elementwise optimizers, gradient norms and ZeRO-1 are indifferent to
    that; the true tensor comes from ``gather``, ``full_state_dict`` and ``state_dict``
    (``checkpoint_view``), not from ``full_tensor()``."""
    return isinstance(placement, Shard) and (placement.unequal or (placement.blocks > 1 and _STRIDED_WORKS is False))


def _contiguous_stride(shape):
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


class ShardedParameters(nn.Module):
    """The parameter shards of one rank, keyed by original name, plus how to feed them to a program."""

    def __init__(self, records, model: nn.Module, tp_comm, tp_mesh=None):
        super().__init__()
        self.records = {r.name: r for r in records}
        # ParameterDict keys cannot hold dots, and no encoding of names is safe (a module may be called
        # ``up__proj``): parameters are kept as p0, p1, ... in record order, with the names beside them.
        self.keys = {r.name: f"p{i}" for i, r in enumerate(records)}
        self.names = {v: k for k, v in self.keys.items()}
        self.tp, self.mesh = tp_comm, tp_mesh
        self.shards = nn.ParameterDict()
        if tp_mesh is not None and DTensor is not None:
            strided_shards_work(tp_mesh)     # before any parameter is wrapped
            fused_optim.install()            # fused optimizers over these DTensors at plain tensors' speed
        self._stored = self.shards._parameters   # the dict ParameterDict keeps them in (updated in place)
        full = dict(model.named_parameters(remove_duplicate=False))  # tied names too
        for r in records:
            p = full[r.name]
            source = self._materialize(model, r.name, p) if p.is_meta else p.detach()
            local = self.slice(source.to(p.dtype), r).clone().contiguous()
            self.shards[self.keys[r.name]] = nn.Parameter(self._wrap(local, r), requires_grad=p.requires_grad)

    def param(self, name) -> nn.Parameter:
        """The parameter stored for ``name`` (ParameterDict's own lookup goes through ``getattr``: a few
        microseconds a parameter, on every step)."""
        return self._stored[self.keys[name]]

    # --- layout ---------------------------------------------------------------------------------------
    def slice(self, full, record):
        """This rank's padded shard of a full tensor (the graph's local layout)."""
        pl = record.spec.tp
        if isinstance(pl, Shard):
            return take_shard(full, pl.dim, record.global_shape[pl.dim], self.tp.size, self.tp.rank, pl.blocks)
        return full

    def _wrap(self, local, record):
        if self.mesh is None:
            return local
        pl = record.spec.tp
        if isinstance(pl, Shard) and pl.blocks == 1:
            local = local.narrow(pl.dim, 0, self._real_rows(record)).contiguous()   # no padding in a DTensor
        shape = tuple(record.global_shape)
        return DTensor.from_local(local, self.mesh, [dtensor_placement(pl)], run_check=False, shape=torch.Size(shape),
                                  stride=_contiguous_stride(shape))

    def _real_rows(self, record):
        pl = record.spec.tp
        n, c = record.global_shape[pl.dim], record.local_shape[pl.dim]
        return max(0, min(c, n - self.tp.rank * c))

    def local(self, name):
        """The local tensor of parameter ``name`` as stored (a DTensor's local part, with autograd)."""
        p = self.param(name)
        return p.to_local() if DTensor is not None and isinstance(p, DTensor) else p

    def call_inputs(self, records, graphs: bool = False, partial: tuple = ()) -> list:
        """The graph's parameter inputs for one ``pm(...)`` call, without DTensor's autograd per parameter.

        ``p.to_local()`` on every parameter of every call wraps each in DTensor's autograd functions
        (``_ToTorchTensor`` forward and backward, a DTensor made for each gradient): about 0.16 ms a
        parameter a step on CPU, more than eager's whole step for a small model. Instead the program
        reads plain leaves that share the shards' storage (made once, ``step_leaves``), and each leaf
        hands its gradient to its parameter's ``.grad`` (as a DTensor, ``hand_grad``) the moment autograd
        has accumulated it, as FSDP2 does with its sharded parameters. Without a mesh the parameters
        are plain tensors and are read as they are.

        ``graphs``: the program replays as CUDA graphs, whose backward outputs live in memory the next
        replay overwrites, so each gradient is handed on as a copy (two calls accumulating into one
        ``.grad`` would otherwise read an overwritten first one).

        ``partial``: the parameters whose gradient is this tp rank's share (``ir/partial_grads``). Each
        enters this call's graph through ``_HeldShare``, whose backward keeps the share instead of
        accumulating it; when that backward ends, the call's shares are summed over tp in one call and
        handed on (``_PartialShares``). Bound to the call, not to the module: another program (another
        shape, with or without sequence parallelism) running between this forward and its backward
        changes nothing, and a backward that fails leaves nothing behind."""
        if (self.mesh is None or DTensor is None) and not partial:
            return self.local_inputs(records)
        self.__dict__["_copy_grads"] = graphs
        cached = self.__dict__.get("_call_leaves")
        if cached is None or not self.leaves_current(cached):
            cached = self.__dict__["_call_leaves"] = self.step_leaves(list(self.records))
            for name, leaf in cached.items():
                if leaf.requires_grad:
                    leaf.register_post_accumulate_grad_hook(lambda leaf, name=name: self._hand(name, leaf))
        if partial and torch.is_grad_enabled():
            shares, leaves = _PartialShares(self, graphs), dict(cached)
            for name in partial:
                if name in leaves and leaves[name].requires_grad:
                    leaves[name] = _HeldShare.apply(leaves[name], shares, name)
            cached = leaves
        return self.local_inputs(records, cached)

    def _hand(self, name: str, leaf: torch.Tensor) -> None:
        """A call leaf's gradient, accumulated by autograd, to its parameter (``call_inputs``)."""
        g = _take_grad(leaf)
        if g is None:         # a share _HeldShare kept: autograd still visits the leaf, with nothing
            return
        hand_grad(self.param(name), g.clone() if self.__dict__["_copy_grads"] else g)

    def local_inputs(self, records, leaves: dict | None = None) -> list:
        """The graph's parameter inputs for a program: local shards, padded and cast as it was compiled
        (from ``leaves`` instead of the parameters when given: see ``step_leaves``)."""
        out = []
        for r in records:
            x = self.local(r.name) if leaves is None else leaves[r.name]
            pl = r.spec.tp
            if isinstance(pl, Shard) and x.shape[pl.dim] != r.local_shape[pl.dim]:
                pad = [0, 0] * (x.dim() - 1 - pl.dim) + [0, r.local_shape[pl.dim] - x.shape[pl.dim]]
                x = F.pad(x, pad)
            out.append(x if x.dtype == r.dtype else x.to(r.dtype))
        return out

    def leaves_current(self, leaves: dict) -> bool:
        """Whether ``leaves`` (from ``step_leaves``) still share storage with the shards (they do unless a
        parameter's tensor was replaced rather than updated in place)."""
        for name, leaf in leaves.items():
            p = self.param(name)
            local = p._local_tensor if DTensor is not None and isinstance(p, DTensor) else p
            if local.data_ptr() != leaf.data_ptr() or local.shape != leaf.shape or \
                    leaf.requires_grad != p.requires_grad:     # frozen or unfrozen since: new leaves, buckets
                return False
        return True

    def step_leaves(self, names) -> dict:
        """Plain local leaves sharing the shards' storage, for a step that runs many microbatches: their
        gradients accumulate locally, and ``accumulate_step_grads`` hands them to the parameters once per
        step. (Going through ``DTensor.to_local`` per microbatch wraps every gradient in a DTensor on
        every backward: about a fifth of a pipeline step on CPU.)"""
        leaves = {}
        for name in names:
            p = self.param(name)
            local = p._local_tensor if DTensor is not None and isinstance(p, DTensor) else p
            leaves[name] = local.detach().requires_grad_(p.requires_grad)
        return leaves

    @torch.no_grad()
    def accumulate_step_grads(self, leaves: dict) -> None:
        """Add each leaf's gradient to its parameter's ``.grad`` (as a DTensor on a mesh), as backward would."""
        for name, leaf in leaves.items():
            if leaf.grad is not None:
                hand_grad(self.param(name), leaf.grad)

    # --- full tensors ---------------------------------------------------------------------------------
    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of which ``local`` is this rank's shard of parameter ``name`` (a collective when
        the parameter is sharded: every rank must call it). Works for gradients too. A tensor of another
        shape is an ``InputError`` on the rank that passed it, before the collective (a rank that passed
        the right one then waits in the all-gather for it)."""
        r = self.records[name]
        pl = r.spec.tp
        if DTensor is not None and isinstance(local, DTensor):
            if not held_in_rank_order(pl):
                return local.full_tensor()
            local = local.to_local()
        if isinstance(pl, Shard):
            n = r.global_shape[pl.dim]
            return gather_full(self._padded(name, local, pl, n), pl.dim, n, self.tp, pl.blocks, "gather")
        if tuple(local.shape) != tuple(r.global_shape):
            raise InputError(f"gather('{name}'): the parameter is whole on every tp rank, of shape "
                             f"{tuple(r.global_shape)}, got a tensor of shape {tuple(local.shape)}")
        return local

    def _padded(self, name: str, local: torch.Tensor, pl: Shard, n: int) -> torch.Tensor:
        """``local`` checked against this rank's shard of ``name`` (before the all-gather, where a wrong size
        would abort every rank), and the last rank's short chunk of a padded dim (a vocab of 97 over 2
        ranks holds 49 and 48 rows) padded to the others' length, as the all-gather needs."""
        real = sum(b - a for a, b in shard_range(n, self.tp.size, self.tp.rank, pl.blocks))
        chunk = local_size(n, self.tp.size, pl.blocks)
        want = list(self.records[name].global_shape)
        want[pl.dim] = real
        if local.dim() != len(want) or any(a != b for i, (a, b) in enumerate(zip(local.shape, want)) if i != pl.dim) \
                or local.shape[pl.dim] not in (real, chunk):
            raise InputError(f"gather('{name}'): this tp rank holds a shard of shape {tuple(want)} of the parameter's "
                             f"{tuple(self.records[name].global_shape)}, got a tensor of shape {tuple(local.shape)}: pass "
                             "this rank's own shard of that parameter (or its gradient), p.grad or p.grad.to_local()")
        return pad_to(local, pl.dim, chunk)

    # --- checkpoints ------------------------------------------------------------------------------------
    def checkpoint_view(self, name, value):
        """What ``state_dict()`` shows ``torch.distributed.checkpoint`` for a parameter: itself, except a
        blocked (strided) shard, which DCP's planner cannot describe as one rectangular chunk per rank in
        torch 2.13. That one is shown evenly ``Shard``ed instead (one gather of the parameter, at save time)."""
        pl = self.records[name].spec.tp
        if DTensor is None or not isinstance(value, DTensor) or not (held_strided(pl) or held_in_rank_order(pl)):
            return value
        full = self.gather(name, value)
        # a copy of its own, not a view into ``full`` at an offset: torch.save refuses a DTensor whose local
        # tensor's storage is shared that way ("an invalid python storage")
        local = full.chunk(self.tp.size, dim=pl.dim)[self.tp.rank].clone()
        return DTensor.from_local(local, self.mesh, [DShard(pl.dim)], run_check=False, shape=full.shape,
                                  stride=full.stride())

    def from_checkpoint_view(self, name, value):
        """The inverse of ``checkpoint_view``, for ``load_state_dict``."""
        r, pl = self.records[name], self.records[name].spec.tp
        if DTensor is not None and isinstance(value, DTensor):
            if value.placements == (dtensor_placement(pl),) and not held_in_rank_order(pl):
                return value
            return self._wrap(self.slice(value.full_tensor(), r).contiguous(), r)
        if not torch.is_tensor(value):
            return value       # (nn.Module's own load reports it)
        if tuple(value.shape) == tuple(r.global_shape):   # a single-device state dict's full tensor
            return self._wrap(self.slice(value.to(self.param(name).device), r).clone().contiguous(), r)
        if self.mesh is None:
            return value       # the in-process simulator keeps plain local shards
        raise InputError(f"load_state_dict: '{name}' is a tensor of shape {tuple(value.shape)}, but the parameter's "
                         f"full shape is {tuple(r.global_shape)}: pass pm.state_dict()'s own entries (DTensors), or "
                         "a single-device state dict of full tensors (as model.state_dict() or pm.full_state_dict() "
                         "give; pm.load_full_state_dict(sd) loads one too)")

    @torch.no_grad()
    def load_full(self, name, full):
        r = self.records[name]
        if tuple(full.shape) != tuple(r.global_shape):
            raise ValueError(f"'{name}': the state dict has shape {tuple(full.shape)}, the model {tuple(r.global_shape)}")
        dst = self.local(name)
        src = self.slice(full.to(dst.dtype), r)
        pl = r.spec.tp
        if isinstance(pl, Shard) and src.shape[pl.dim] != dst.shape[pl.dim]:
            src = src.narrow(pl.dim, 0, dst.shape[pl.dim])
        dst.copy_(src)

    @staticmethod
    def _materialize(model, name, p):
        """A full tensor for a parameter on ``meta``: its module's ``reset_parameters`` on a scratch copy.

        One module at a time (the peak is one module's full parameters), seeded from the parameter's name
        so every rank draws the same tensor and two layers do not draw the same one, inside a forked RNG
        so the caller's random stream is untouched. This is the module's default init, not the model's
        own (nanoGPT's normal(0, 0.02), say): load real weights with ``load_full_state_dict``.
        """
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if not hasattr(owner, "reset_parameters"):
            warn_user(f"parameter '{name}' is on the meta device and {type(owner).__name__} has no "
                      "reset_parameters(): it starts uninitialised; load weights with load_full_state_dict")
        scratch = _on_scratch(owner, name, lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
        return getattr(scratch, leaf).detach()


class _HeldShare(torch.autograd.Function):
    """Identity forward; backward hands the parameter's gradient share to the call's ``_PartialShares``
    instead of to the leaf (its gradient, for autograd, is None: nothing accumulates)."""

    @staticmethod
    def forward(ctx, leaf, shares, name):
        ctx.shares, ctx.name = shares, name
        return leaf.view_as(leaf)

    @staticmethod
    def backward(ctx, g):
        ctx.shares.hold(ctx.name, g)
        return None, None, None


class _PartialShares:
    """One ``pm(...)`` call's gradient shares over tp: summed in one all-reduce when the backward that
    produced them ends (a callback autograd runs then), in name order on every rank, and handed on."""

    def __init__(self, params, copy: bool):
        self.params, self.copy, self.held = params, copy, []

    def hold(self, name: str, g: torch.Tensor) -> None:
        if not self.held:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        self.held.append((name, g.clone() if self.copy else g))

    def flush(self) -> None:
        held, self.held = sorted(self.held, key=lambda ng: ng[0]), []
        for (name, _), g in zip(held, sum_over_tp(self.params.tp, [g for _, g in held])):
            hand_grad(self.params.param(name), g)


def _take_grad(leaf: torch.Tensor) -> torch.Tensor:
    """A leaf's gradient, taken away from it: the next backward starts it afresh, so a parameter whose
    ``.grad`` the user set to None (``zero_grad``) does not see this one again."""
    g = leaf.grad
    leaf.grad = None
    return g


def hand_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """Add the local gradient ``g`` to parameter ``p``'s ``.grad``, as a DTensor of ``p``'s own spec where
    ``p`` is one (constructed directly: no ``from_local`` autograd, no DTensor dispatch), as backward
    would: set when ``.grad`` is None, accumulated in place otherwise. (Called per parameter from inside
    backward or under ``accumulate_step_grads``'s no_grad: a ``no_grad`` of its own costs more than it does.)"""
    dtensor = DTensor is not None and isinstance(p, DTensor)
    if p.grad is None:   # the parameter's own spec: same mesh and layout
        p.grad = _new_dtensor(DTensor, g, p._spec, requires_grad=False) if dtensor else g
    elif dtensor and isinstance(p.grad, DTensor) and p.grad._spec == p._spec:
        p.grad._local_tensor.add_(g)   # accumulating onto the last: no DTensor dispatch per parameter
    else:
        p.grad += DTensor(g, p._spec, requires_grad=False) if dtensor else g


def _undecorated(fn):
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


# DTensor's constructor without the decorators around it (dynamo's disable and export's marker: about 1.2 us
# of a 1.9 us call, per parameter per step); its own, where this torch has none
_new_dtensor = _undecorated(DTensor.__new__) if DTensor is not None else None


@torch.no_grad()
def model_buffers(model: nn.Module, persistent: set | None = None) -> dict:
    """The model's buffers by name, as a program reads them: real tensors. A buffer on ``meta`` (a model
    built under ``torch.device("meta")``) is rebuilt on a scratch copy of its module, the way the model
    itself would: HF's ``_init_weights`` recomputes a rotary ``inv_freq`` (what ``from_pretrained`` does for
    its non-persistent buffers), a torch module's ``reset_parameters`` resets BatchNorm statistics. A
    persistent buffer neither rebuilds starts at zeros, with a warning, for ``load_full_state_dict``; a
    non-persistent one (no checkpoint holds it) is an error naming it, before any collective.
    ``persistent``: the names ``model.state_dict()`` holds (computed when not given)."""
    persistent = set(model.state_dict()) if persistent is None else persistent
    out = {}
    for name, b in model.named_buffers():
        out[name] = b if not b.is_meta else _rebuilt_buffer(model, name, b, name in persistent)
    return out


def _rebuilt_buffer(model, name, b, persistent):
    """Rebuild one meta buffer on scratch copies of its module: an init rebuilt it when two copies, filled
    beforehand with different sentinels (0 and 1, False and True), come out equal."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    tried = []
    for how in ("_init_weights", "reset_parameters"):
        if not callable(getattr(model if how == "_init_weights" else owner, how, None)):
            continue
        tried.append(how)
        init = model._init_weights if how == "_init_weights" else (lambda m: m.reset_parameters())
        values = [getattr(_on_scratch(owner, name, init, lambda m, v=sentinel: getattr(m, leaf).fill_(v)), leaf).detach()
                  for sentinel in (0, 1)]
        if torch.equal(values[0], values[1]):
            return values[0]
    rebuilt_by = " or ".join(tried) or "no init"
    if persistent:
        warn_user(f"buffer '{name}' ({type(owner).__name__}) is on the meta device and {rebuilt_by} rebuilds "
                  "it: it starts at zeros; load it with load_full_state_dict")
        return torch.zeros_like(b, device="cpu")
    raise ValueError(f"buffer '{name}' of '{owner_name}' ({type(owner).__name__}) is on the meta device and is not "
                     f"saved in a state dict, and {rebuilt_by} rebuilds it: build the model with that buffer on a "
                     "real device (create it after leaving the meta context), or give "
                     f"{type(owner).__name__} a reset_parameters() that computes it")


def _on_scratch(owner: nn.Module, name: str, init, fill=None) -> nn.Module:
    """A CPU copy of ``owner`` whose own parameters and buffers are fresh (``fill``ed, when given), after
    ``init(copy)`` ran seeded from ``name`` (every rank draws the same values, two tensors not the same
    ones) inside a forked CPU random stream (the caller's, and every CUDA generator, untouched)."""
    scratch = copy.deepcopy(owner).to_empty(device="cpu", recurse=False)
    if fill is not None:
        fill(scratch)
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(zlib.crc32(name.encode()))
        init(scratch)
    return scratch
