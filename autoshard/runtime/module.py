"""``ParallelModule``: the user-facing module holding one rank's program and its parameter shards."""
from __future__ import annotations

import copy
import hashlib
import warnings
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from autoshard.ir import meta as M
from autoshard.ir.placement import Shard
from autoshard.ir.program import Program
from autoshard.runtime.bind import bind
from autoshard.runtime.comm import AxisComm, Tracer
from autoshard.runtime.layout import gather_full, take_shard


def _key(name):
    return name.replace(".", "__")


class ParallelModule(nn.Module):
    """Runs one rank's compiled program; its parameters are this rank's shards (any torch optimizer).

    ``forward`` takes the same inputs as the original model and returns the same structure.
    ``full_state_dict()`` gathers the original names and full shapes; ``load_full_state_dict`` slices.
    ``comms`` maps each mesh axis to this rank's ``AxisComm`` (``None``: single-rank communicators, for
    compile-only programs of a one-rank mesh).
    """

    def __init__(self, program: Program, model: nn.Module, comms: dict | None = None):
        super().__init__()
        self.program = program
        coords = program.coords
        self.comms = comms if comms is not None else {
            a: AxisComm(a, program.mesh.axis_size(a), coords[a]) for a in coords}
        for a, c in self.comms.items():
            if (c.size, c.rank) != (program.mesh.axis_size(a), coords[a]):
                raise ValueError(f"communicator for axis '{a}' is rank {c.rank} of {c.size}, but the program was "
                                 f"compiled for rank {coords[a]} of {program.mesh.axis_size(a)}")
        self.graph = bind(program.gm, self.comms)
        self.shards = nn.ParameterDict()
        self.records = {r.name: r for r in program.params}
        full = dict(model.named_parameters(remove_duplicate=False))  # tied names too
        for r in program.params:
            p = full[r.name]
            local = self._materialize(model, r.name, p) if p.is_meta else p.detach()
            self.shards[_key(r.name)] = nn.Parameter(self._slice(local, r).clone().contiguous(),
                                                     requires_grad=p.requires_grad)
        self.aliases = dict(program.captured.aliases)
        self._buffer_names = list(program.captured.buffer_names)
        named_buffers = dict(model.named_buffers())
        consts = program.captured.constants
        for name in self._buffer_names:
            b = named_buffers.get(name, consts.get(name))
            if b is None:
                raise ValueError(f"buffer or constant '{name}' of the captured graph was not found in the model")
            self.register_buffer(_key(name), b.detach().clone())
        sd_keys = set(model.state_dict().keys())
        self._persistent_buffers = [b for b in self._buffer_names if b in sd_keys]
        if self.comms["tp"].group is not None:
            self._check_ranks_agree(model)

    @property
    def tp(self) -> AxisComm:
        return self.comms["tp"]

    def tracers(self) -> list:
        return [c.tracer for c in self.comms.values()]

    def comm_counts(self):
        """Calls and bytes run since the last ``reset_comm_counts``, by (axis, phase, kind)."""
        total = Tracer()
        for t in self.tracers():
            total.calls.update(t.calls)
            total.bytes.update(t.bytes)
        return total.calls, total.bytes

    def reset_comm_counts(self):
        for t in self.tracers():
            t.reset()

    def _check_ranks_agree(self, model):
        """All ranks must run the same plan on the same weights; say so (on every rank) if they do not.

        One small all-gather at set-up: a rank with another plan would run other collectives (a hang or
        wrong numbers), and weights drawn without a common seed would be shards of different models.
        """
        plan = hashlib.sha1(repr([(n.name, M.SPEC.get(n, None), M.LOCAL_SHAPE.get(n, None))
                                  for n in self.program.gm.graph.nodes]).encode())
        weights = hashlib.sha1()
        for name, p in model.named_parameters():
            if not p.is_meta:
                weights.update(f"{name}:{float(p.detach().double().sum()):.10e}".encode())
        mine = (plan.hexdigest(), weights.hexdigest())
        group = self.tp.group
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        if len({e[0] for e in every}) > 1:
            raise RuntimeError("tensor-parallel ranks compiled different plans (different example inputs, "
                               "models or autoshard versions?): every rank must call parallelize identically")
        if len({e[1] for e in every}) > 1:
            raise RuntimeError("the model's weights differ between tensor-parallel ranks: seed every rank the "
                               "same (torch.manual_seed) before building the model, or load one checkpoint")

    # --- shards ---------------------------------------------------------------------------------------
    def _slice(self, full, record):
        pl = record.spec.tp
        if isinstance(pl, Shard):
            return take_shard(full, pl.dim, record.global_shape[pl.dim], self.tp.size, self.tp.rank, pl.blocks)
        return full

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of which ``local`` is this rank's shard of parameter ``name`` (a collective when
        the parameter is sharded: every rank must call it). Works for gradients too."""
        record = self.records[name]
        pl = record.spec.tp
        if isinstance(pl, Shard):
            return gather_full(local, pl.dim, record.global_shape[pl.dim], self.tp, pl.blocks, "gather")
        return local

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
        scratch = copy.deepcopy(owner).to_empty(device="cpu", recurse=False)
        if hasattr(scratch, "reset_parameters"):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(name.encode()))
                scratch.reset_parameters()
        else:
            warnings.warn(f"parameter '{name}' is on the meta device and {type(owner).__name__} has no "
                          "reset_parameters(): it starts uninitialised; load weights with load_full_state_dict")
        return getattr(scratch, leaf).detach()

    def local_parameters(self):
        """``{original name: local shard}``."""
        return {r.name: self.shards[_key(r.name)] for r in self.program.params}

    # --- forward ----------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        captured = self.program.captured
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != captured.in_spec:
            raise TypeError(f"inputs do not match the example inputs the model was compiled with: got structure "
                            f"{spec}, compiled for {captured.in_spec}; pass the same arguments")
        for i, (x, ex) in enumerate(zip(leaves, captured.example_leaves)):
            if isinstance(x, torch.Tensor) != isinstance(ex, tuple) or (
                    isinstance(x, torch.Tensor) and (tuple(x.shape), x.dtype) != ex):
                got = (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                raise ValueError(f"input {i} is {got}, compiled for {ex}: autoshard compiles for static shapes "
                                 "and dtypes; call parallelize with example_args like the ones you train with")
            if not isinstance(x, torch.Tensor) and x != ex:
                raise ValueError(f"input {i} is {x!r}, but {ex!r} was compiled into the program: non-tensor "
                                 "arguments are constants of the trace; parallelize again to change them")
        user = [leaves[i] for i in captured.input_leaves]  # the leaves the graph reads (tensors)
        params = [self.shards[_key(r.name)] for r in self.program.params]
        buffers = [getattr(self, _key(b)) for b in self._buffer_names]
        flat = self.graph(*params, *buffers, *user)
        return pytree.tree_unflatten(list(flat), captured.out_spec)

    # --- full state dicts -------------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self):
        """Original names and full shapes (tied names included), loadable by the single-device model."""
        out = {}
        for r in self.program.params:
            out[r.name] = self.gather(r.name, self.shards[_key(r.name)].detach()).clone()
        for alias, main in self.aliases.items():
            out[alias] = out[main]
        for b in self._persistent_buffers:
            out[b] = getattr(self, _key(b)).clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state_dict, strict: bool = True):
        missing = [r.name for r in self.program.params if r.name not in state_dict]
        if strict and missing:
            raise ValueError(f"the state dict lacks parameters {missing}: pass strict=False to load the rest")
        for r in self.program.params:
            if r.name not in state_dict:
                continue
            full = state_dict[r.name]
            if tuple(full.shape) != tuple(r.global_shape):
                raise ValueError(f"'{r.name}': state dict has shape {tuple(full.shape)}, the model "
                                 f"{tuple(r.global_shape)}")
            shard = self.shards[_key(r.name)]
            shard.copy_(self._slice(full.to(shard.dtype), r))
        for b in self._persistent_buffers:
            if b in state_dict:
                getattr(self, _key(b)).copy_(state_dict[b])
