"""``ParallelModule``: the user-facing module holding one rank's parameters and its compiled programs.

A program is compiled for one set of input shapes, dtypes, non-tensor values and one mode (train or
eval: dropout and anything else export bakes in). ``forward`` looks the call up in a bounded cache and,
on a miss, compiles a new program through ``compiler`` (a callable the API hands in; the runtime never
imports the compiler), with every parameter pinned to the placement it already has, so all programs
share the same shards. As ``torch.compile`` does on a new shape, and logged.
"""
from __future__ import annotations

import hashlib
import logging
import time

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autoshard.ir import meta as M
from autoshard.ir.errors import InputError
from autoshard.ir.options import check_finite_enabled, check_replicas_every
from autoshard.ir.program import Program
from autoshard.runtime import training
from autoshard.runtime.batch_check import CHECKED_CALLS, check_same_batch
from autoshard.runtime.bind import bind
from autoshard.runtime.comm import AxisComm
from autoshard.runtime.data_parallel import DEFAULT_BUCKET_BYTES
from autoshard.runtime.input_checks import check_dtype_kinds, check_inputs, naming_new_shapes
from autoshard.runtime.device import mesh_device, owned, owned_constant, to_device
from autoshard.runtime.params import ShardedParameters, model_buffers
from autoshard.runtime.pipeline import PipelineModule
from autoshard.runtime.program_cache import ProgramCache, ProgramKey, program_key

log = logging.getLogger("autoshard")


class ParallelModule(training.TrainingMethods, nn.Module):
    """Runs this rank's compiled programs on its parameter shards (any torch optimizer).

    ``forward`` takes the same inputs as the original model and returns the same structure.
    ``comms`` maps each mesh axis to this rank's ``AxisComm`` (``None``: single-rank communicators);
    ``tp_mesh`` (a 1-D DeviceMesh) makes the parameters DTensors; ``compiler(args, kwargs, training,
    pins)`` compiles a program for a new call (``None``: other shapes are an error).
    """

    def __init__(self, program: Program, model: nn.Module, comms: dict | None = None, tp_mesh=None,
                 compiler=None, max_programs: int = 8, step_compiler=None):
        super().__init__()
        coords = program.coords
        self.comms = comms if comms is not None else {
            a: AxisComm(a, program.mesh.axis_size(a), coords[a]) for a in coords}
        for a, c in self.comms.items():
            if (c.size, c.rank) != (program.mesh.axis_size(a), coords[a]):
                raise ValueError(f"communicator for axis '{a}' is rank {c.rank} of {c.size}, but the program was "
                                 f"compiled for rank {coords[a]} of {program.mesh.axis_size(a)}")
        self.params = ShardedParameters(program.params, model, self.comms["tp"], tp_mesh)
        self.aliases = dict(program.captured.aliases)
        self.device = mesh_device(tp_mesh)              # where this rank computes (runtime/device.py)
        self._persistent = set(model.state_dict().keys())
        self._model_buffers = model_buffers(model, self._persistent)   # a buffer on meta rebuilt, as the model would
        self._buffer_names = []              # the model's buffers, registered as b0, b1, ... (names may hold "__")
        self._buffer_attr = {}               # buffer name -> its attribute (b0, b1, ...)
        self._check_every = check_replicas_every()
        self._compiler, self.max_programs = compiler, max_programs
        self._programs = ProgramCache(lambda: self.max_programs, "program")   # key -> (Program, bound graph, constants)
        self.compile_log = []              # (ProgramKey, seconds) per program compiled after the first
        self._batch_checks = {}              # ProgramKey -> calls whose batch was checked across tp ranks
        self._steps = 0
        self._step_compiler = step_compiler
        self.bucket_bytes = DEFAULT_BUCKET_BYTES   # dp gradient buckets of pm.step (DDP's bucket_cap_mb)
        self.first_bucket_bytes = None             # None: 1 MiB on CUDA, as the others on CPU (data_parallel.py)
        self.zero = 0                              # pm.optimizer's default ZeRO stage (parallelize(zero=...))
        self.__dict__["_stepper"] = None     # the last pm.step executor: shares self.params, not a submodule
        self.__dict__["_steppers"] = ProgramCache(lambda: self.max_programs, "pm.step program", on_drop=lambda s: s.close())
        self.train(model.training)
        self._check_ranks_agree(program)
        training.check_same_weights(model, "parallelize", program.mesh.size)   # over the world: tp, dp, pp ranks
        captured = program.captured
        sig = tuple(leaf + (rg,) if isinstance(leaf, tuple) and len(leaf) == 2 and isinstance(leaf[1], torch.dtype)
                    else leaf for leaf, rg in zip(captured.example_leaves, captured.example_requires_grad))
        self._first = program
        self._add(ProgramKey(bool(model.training), sig, str(captured.in_spec)), program)
        training.register_state_dict_names(self)

    # --- programs -------------------------------------------------------------------------------------
    @property
    def program(self) -> Program:
        """The first program compiled (the example inputs', in the model's mode at parallelize time)."""
        return self._first

    @property
    def programs(self) -> list:
        return [entry[0] for entry in self._programs.values()]

    def _buffer(self, name):
        return getattr(self, self._buffer_attr[name])

    def _ensure_buffer(self, name) -> bool:
        """Register model buffer ``name`` here (a copy, once) if a program reads it; False if it is not one."""
        if name not in self._model_buffers:
            return False
        if name not in self._buffer_attr:
            self._buffer_attr[name] = f"b{len(self._buffer_names)}"
            self.register_buffer(self._buffer_attr[name], owned(self._model_buffers[name], self.device),
                                 persistent=name in self._persistent)
            self._buffer_names.append(name)
        return True

    def _step_buffer(self, name):
        """A buffer for the ``pm.step`` executor: this module's own, so loads and ``.to()`` reach the step."""
        if not self._ensure_buffer(name):
            raise ValueError(f"buffer '{name}' of the step program was not found in the model")
        return self._buffer(name)

    def _add(self, k, program):
        """Cache a program. The model's buffers are shared by every program; constants the forward makes
        (``torch.tensor(...)``, lifted by export as ``lifted_tensor_0``, ...) belong to their program alone:
        export numbers them per trace, so another program's ``lifted_tensor_0`` is another tensor."""
        constants = {}
        for name in program.captured.buffer_names:
            if self._ensure_buffer(name):
                continue
            if name in program.captured.constants:
                constants[name] = owned_constant(program.captured.constants[name], name, self.device)
            else:
                raise ValueError(f"buffer or constant '{name}' of the captured graph was not found in the model")
        self._programs.put(k, (program, bind(program.gm, self.comms, self.device, program.options.codegen), constants))   # (.program keeps the first)

    def _program_for(self, leaves, spec):
        k = program_key(self.training, leaves, spec)
        if k in self._programs:
            return self._programs.get(k)
        first = self.program
        check_dtype_kinds(leaves, first.captured)     # dtypes are in the key: only a new program can be wrong
        if self._compiler is None:
            self._explain_mismatch(leaves, spec, first)
        start = time.perf_counter()
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        pins = {r.name: r.spec.tp for r in first.params}
        with naming_new_shapes(leaves, first.captured):
            program = self._compiler(args, kwargs, self.training, pins)
        theirs = {(r.name, r.global_shape) for r in program.params}
        ours = {(r.name, r.global_shape) for r in first.params}
        if not theirs <= ours:
            raise RuntimeError(f"the {'train' if self.training else 'eval'}-mode program for these inputs reads "
                               f"parameters the first one did not: {sorted(theirs - ours)}")
        self._check_ranks_agree(program)
        self._add(k, program)
        seconds = time.perf_counter() - start
        self.compile_log.append((k, seconds))
        log.info("autoshard: compiled a %s-mode program for new inputs %s in %.2f s (%d of at most %d cached)",
                 "train" if self.training else "eval", k.inputs, seconds, len(self._programs), self.max_programs)
        return self._programs.get(k)

    @staticmethod
    def _explain_mismatch(leaves, spec, program):
        captured = program.captured
        if spec != captured.in_spec:
            raise InputError(f"inputs do not match the example inputs the model was compiled with: got structure "
                            f"{spec}, compiled for {captured.in_spec}; pass the same arguments")
        for i, (x, ex) in enumerate(zip(leaves, captured.example_leaves)):
            got = (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
            if got != ex:
                raise ValueError(f"input {i} is {got}, compiled for {ex}: this program was compiled for static "
                                 "shapes and dtypes; parallelize compiles new ones on first use")
        raise ValueError("this program was compiled for the other mode (train/eval); parallelize compiles both")

    # --- forward ----------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.training and self.comms["dp"].size > 1:
            raise RuntimeError(f"with data parallelism (dp={self.comms['dp'].size}) train with pm.step(*local_batch): "
                               "it sums the gradients over dp ranks; a training forward here would leave each "
                               "replica's gradients unsynchronised. pm.eval() forwards are fine")
        leaves, spec = pytree.tree_flatten(to_device((args, kwargs), self.device))
        program, graph, constants = self._program_for(leaves, spec)
        key = program_key(self.training, leaves, spec)
        if self._batch_checks.get(key, 0) < CHECKED_CALLS:   # every tp rank given the same batch
            self._batch_checks[key] = self._batch_checks.get(key, 0) + 1
            check_same_batch(self.comms, leaves, "pm(...)")
        user = [leaves[i] for i in program.captured.input_leaves]  # the leaves the graph reads (tensors)
        check_inputs(program.captured.index_ranges, dict(zip(program.captured.user_input_names, user)))
        buffers = [constants[b] if b in constants else self._buffer(b) for b in program.captured.buffer_names]
        flat = graph(*self.params.call_inputs(program.params), *buffers, *user)
        if self.training:
            self._steps += 1
            if check_finite_enabled(program.options.check_finite):
                training.check_finite(self, _scalar_loss(flat), self._steps, grads=False)
            if self._check_every and self._steps % self._check_every == 0:
                self.check_replicas()
        return pytree.tree_unflatten(list(flat), program.captured.out_spec)

    def step(self, *args, **kwargs):
        """Forward and backward of the whole batch: returns the loss and leaves the gradients in ``.grad``.
        With ``parallelize(..., microbatches=m)`` the batch runs as m microbatches (gradient accumulation)
        whose loss is the whole batch's: the mean cross-entropy is summed and divided by the batch's count
        of non-ignored targets (``passes/microbatch_loss.py``), so uneven ``ignore_index`` counts are exact.
        Another batch shape (an epoch's short last batch) compiles its own step program on first use, as
        ``forward`` does; the executors share the parameters (at most ``max_programs`` are kept)."""
        return self._stepper_for(args, kwargs).step(*args, **kwargs)     # it moves the batch to the device

    def eval_batch(self, *args, **kwargs):
        """The loss of a batch in eval mode (no dropout, no gradients), as ``step`` takes it and returns it
        (with dp, the global batch's loss on every rank): a validation loss."""
        return self._stepper_for(args, kwargs).eval_batch(*args, **kwargs)

    def _stepper_for(self, args, kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = program_key(True, leaves, spec)
        stepper = self._steppers.get(key)
        if stepper is None:     # a new batch shape (the last, short batch of an epoch): its own step program
            check_dtype_kinds(leaves, self.program.captured)     # before a step program is compiled for them
            if self._step_compiler is None:
                raise RuntimeError("pm.step needs the compiler: build the module with autoshard.parallelize")
            pins = {r.name: r.spec.tp for r in self.program.params}
            start = time.perf_counter()
            with naming_new_shapes(leaves, self.program.captured):
                program = self._step_compiler(args, kwargs, pins)
            stepper = PipelineModule(program, None, self.comms, params=self.params, buffer_source=self._step_buffer,
                                     device=self.device)
            stepper.bucket_bytes, stepper.first_bucket_bytes = self.bucket_bytes, self.first_bucket_bytes
            stepper._twin_compiler = (lambda train, a, kw, training, p=pins:
                                      self._step_compiler(a, kw, p, training=training))
            self._steppers.put(key, stepper)
            if len(self._steppers) > 1:
                log.info("autoshard: compiled a pm.step program for new inputs %s in %.2f s", key.inputs,
                         time.perf_counter() - start)
        stepper.max_programs = self.max_programs      # its twins (eval mode) follow this module's limit
        stepper.train(self.training)                  # pm.eval(): steps run the eval-mode program (no dropout)
        self.__dict__["_stepper"] = stepper
        return stepper

    # --- checks ----------------------------------------------------------------------------------------------
    def _check_ranks_agree(self, program):
        """All tp ranks must run the same plan; say so (on every rank) if they do not. One small all-gather
        per program: a rank with another plan would run other collectives (a hang or wrong numbers)."""
        group = self.tp.group
        if group is None:
            return
        plan = hashlib.sha1(repr([(n.name, M.SPEC.get(n, None), M.LOCAL_SHAPE.get(n, None))
                                  for n in program.gm.graph.nodes]).encode()).hexdigest()
        every = self.tp.all_gather_objects(plan)
        if len(set(every)) > 1:
            raise RuntimeError("tensor-parallel ranks compiled different plans (different example inputs, "
                               "models or autoshard versions?): every rank must call parallelize identically")

    # --- full state dicts -------------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self):
        """Original names and full shapes (tied names included), loadable by the single-device model."""
        out = {name: self.gather(name, p.detach()).clone() for name, p in self.local_parameters().items()}
        for alias, main in self.aliases.items():
            out[alias] = out[main]
        for b in self._buffer_names:
            if b in self._persistent:
                out[b] = self._buffer(b).clone()
        return out

    def _held_buffers(self) -> dict:
        return {b: self._buffer(b) for b in self._buffer_names}


def _scalar_loss(flat):
    """The loss among a program's outputs: its first scalar floating tensor (None if it returns none)."""
    return next((x for x in flat if isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point()), None)
