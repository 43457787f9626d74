"""``ForwardRunner``: the forward programs of a pp = 1 ``ParallelModule``, for ``pm(...)``.

A program is compiled for one set of input shapes, dtypes, non-tensor values and one mode (train or
eval: dropout and anything else export bakes in). ``run`` looks the call up in a bounded cache and, on a
miss, compiles a new program through ``compiler`` (a callable the API hands in; the runtime never
imports the compiler), with every parameter pinned to the placement it already has, so all programs
share the module's shards. As ``torch.compile`` does on a new shape, and logged.

A module built from a step program (pp = 1 with dp > 1, where ``pm(...)`` does not train and ``pm.step``
does) starts with no forward program: the first ``pm(...)`` (an eval forward) compiles one, pinned to
the step program's placements.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autoshard.ir import meta as M
from autoshard.ir.errors import InputError, warn_user
from autoshard.ir.partial_grads import TP_PARTIAL_GRADS
from autoshard.ir.program import Program
from autoshard.runtime.batch_check import CHECKED_CALLS, check_same_batch
from autoshard.runtime.bind import bind
from autoshard.runtime.input_checks import check_call_inputs, check_dtype_kinds, naming_new_shapes
from autoshard.runtime.program_cache import ProgramCache, ProgramKey, constants_only_change, program_key
from autoshard.runtime.microbatch import named_leaves

log = logging.getLogger("autoshard")


@dataclass
class Bound:
    """A forward program ready to run: the program, its graph bound to this rank's communicators, and
    the constants export lifted from its trace (its own: they are numbered per trace)."""
    program: Program
    graph: fx.GraphModule
    constants: dict
    batch_checks: int = 0        # calls whose batch was checked to be the same on every tp rank


class ForwardRunner:
    """The forward programs of ``module``: the first (the example inputs', or None when the module was
    built from a step program) and those compiled since."""

    def __init__(self, module, first: Program | None, compiler=None):
        self.module, self.first, self.compiler = module, first, compiler
        self.programs = ProgramCache(lambda: module.max_programs, "program")
        self.compile_log = []            # (ProgramKey, seconds) per program compiled after the first
        if first is None:
            if compiler is None:
                raise ValueError("a module with no forward program needs the compiler to make one")
            return
        self.check_ranks_agree(first)
        captured = first.captured
        sig = tuple(leaf + (rg,) if isinstance(leaf, tuple) and len(leaf) == 2 and isinstance(leaf[1], torch.dtype)
                    else leaf for leaf, rg in zip(captured.example_leaves, captured.example_requires_grad))
        self._add(ProgramKey(bool(module.training), sig, str(captured.in_spec)), first)

    def _add(self, key, program: Program) -> None:
        """Cache a program. The model's buffers are the module's, shared by every program; constants the
        forward makes (``torch.tensor(...)``, lifted by export as ``lifted_tensor_0``) are the program's."""
        m = self.module
        constants = {name: m.program_constant(program, name) for name in program.captured.buffer_names
                     if m.buffer(name) is None}
        graph = bind(program.gm, m.comms, m.device, program.options.codegen, program.options.cuda_graphs)
        self.programs.put(key, Bound(program, graph, constants))

    def bound_for(self, leaves, spec, training: bool) -> Bound:
        key = program_key(training, leaves, spec)
        found = self.programs.get(key)
        if found is not None:
            return found
        captured, microbatches = self.module.first_capture()
        check_dtype_kinds(leaves, captured, spec)     # dtypes are in the key: only a new program can be wrong
        warn_constant_inputs(key, self.programs.keys(), leaves, spec)
        if self.compiler is None:
            _explain_mismatch(leaves, spec, self.first)
        start = time.perf_counter()
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        held = self.module.params.records.values()        # every program shares the module's shards
        pins = {r.name: r.spec.tp for r in held}
        with naming_new_shapes(leaves, captured, microbatches, spec):
            program = self.compiler(args, kwargs, training, pins)
        theirs = {(r.name, r.global_shape) for r in program.params}
        ours = {(r.name, r.global_shape) for r in held}
        if not theirs <= ours:
            raise RuntimeError(f"the {'train' if training else 'eval'}-mode program for these inputs reads "
                               f"parameters the first one did not: {sorted(theirs - ours)}")
        self.check_ranks_agree(program)
        self._add(key, program)
        seconds = time.perf_counter() - start
        self.compile_log.append((key, seconds))
        log.info("autoshard: compiled a %s-mode program for new inputs %s in %.2f s (%d of at most %d cached)",
                 "train" if training else "eval", key.inputs, seconds, len(self.programs), self.module.max_programs)
        return self.programs.get(key)

    def run(self, leaves, spec, training: bool):
        """The program's flat outputs on a call's flattened (device-placed) inputs, and the program."""
        bound = self.bound_for(leaves, spec, training)
        program, m = bound.program, self.module
        if bound.batch_checks < CHECKED_CALLS:       # every tp rank given the same batch
            bound.batch_checks += 1
            check_same_batch(m.comms, leaves, "pm(...)")
        user = [leaves[i] for i in program.captured.input_leaves]  # the leaves the graph reads (tensors)
        check_call_inputs(program.captured, leaves)
        buffers = [bound.constants[b] if b in bound.constants else m.buffer(b) for b in program.captured.buffer_names]
        partial = program.gm.meta.get(TP_PARTIAL_GRADS)
        inputs = m.params.call_inputs(program.params, program.options.cuda_graphs, partial.names if partial else ())
        return bound.graph(*inputs, *buffers, *user), program

    def check_ranks_agree(self, program: Program) -> None:
        """All tp ranks must run the same plan; say so (on every rank) if they do not. One small all-gather
        per program: a rank with another plan would run other collectives (a hang or wrong numbers)."""
        tp = self.module.comms["tp"]
        if tp.group is None:
            return
        plan = hashlib.sha1(repr([(n.name, M.SPEC.get(n, None), M.LOCAL_SHAPE.get(n, None))
                                  for n in program.gm.graph.nodes]).encode()).hexdigest()
        if len(set(tp.all_gather_objects(plan))) > 1:
            raise RuntimeError("tensor-parallel ranks compiled different plans (different example inputs, "
                               "models or autoshard versions?): every rank must call parallelize identically")


def warn_constant_inputs(key: ProgramKey, held: list, leaves, spec) -> None:
    """Warn when a new program is compiled only because a Python number among the inputs took a new value
    (export compiles it in as a constant): HF's ``num_items_in_batch`` given as an int compiles a program
    every step. The fix is a tensor, whose value is an input."""
    diff = constants_only_change(key, held)
    if not diff:
        return
    named = named_leaves(pytree.tree_unflatten(list(leaves), spec))
    said = ", ".join(f"'{named[i][0]}' = {named[i][1]!r}" for i in diff if i < len(named))
    warn_user(f"autoshard: a new program is compiled because a Python number among the inputs took a new value "
              f"({said}): export compiles a number in as a constant, so each new value compiles (and caches) "
              "another program; pass it as a tensor (torch.tensor(n)) to make it an input")


def _explain_mismatch(leaves, spec, program: Program):
    """Why a module built without a compiler cannot run these inputs: structure, shape, dtype or mode."""
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
