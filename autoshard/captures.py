"""Capturing a model for one program, and ``CaptureCache``: one capture per call, shared by a module's programs.

``capture_model`` is what every compile entry point traces: the model in the program's mode (train or
eval: dropout is baked in), a bf16 twin under mixed precision, and ``loss_fn`` after the forward when
given. The captured graph is never modified (the pass manager copies it), so one capture can feed any
number of programs.

At pp = 1 a module may compile two programs for the same call: the forward program (``pm(...)``) and the
step program (``pm.step``) for a batch of the same shapes, which at one microbatch (the default) is the
very same trace. ``parallelize`` compiles one of them for the example inputs (the forward at dp = 1, the
step at dp > 1) and gives its compilers one ``CaptureCache``, so the other, and ``pm.eval()`` forwards
beside ``pm.eval_batch``, trace the model once per call signature, not once per program. (With
``microbatches`` > 1 a step traces one microbatch: a call signature of its own.)
"""
from __future__ import annotations

import inspect
import itertools
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autoshard.ir.options import CompileOptions
from autoshard.ir.program import Captured
from autoshard.passes.capture import capture
from autoshard.passes.mixed_precision import COMPUTE_DTYPES, capture_in
from autoshard.runtime.device import to_device
from autoshard.runtime.program_cache import ProgramCache, program_key


@contextmanager
def _mode(model: nn.Module, training):
    if training is None or training == model.training:
        yield
        return
    was = model.training
    model.train(training)
    try:
        yield
    finally:
        model.train(was)


@contextmanager
def _with_loss(model, loss_fn, kwargs):
    """The model's forward followed by ``loss_fn(output, target)``, with ``target`` a keyword of the call:
    torch.distributed.pipelining's convention (``schedule.step(x, target=y)``), so a model that returns
    logits trains with ``pm.step(x, target=y)``. The loss is traced with the model, so the compiler sees
    (and makes exact over microbatches) a mean-reduced cross-entropy like any other."""
    if loss_fn is None:
        yield
        return
    if "target" not in kwargs:
        raise ValueError("loss_fn= is given, so this call needs target=: pass the targets as a keyword, "
                         "parallelize(model, mesh, (x,), {'target': y}, loss_fn=...) and pm.step(x, target=y) "
                         "(pm(x) without target= returns the model's output)")
    if "target" in inspect.signature(model.forward).parameters:
        raise ValueError(f"loss_fn= takes target= for the loss, but {type(model).__name__}.forward has a 'target' "
                         "parameter of its own: compute the loss in the model and drop loss_fn, or rename it")
    own = model.__dict__.get("forward")            # an instance-level forward (a hook library's) is kept
    inner = model.forward

    def forward(*args, target, **kw):
        return loss_fn(inner(*args, **kw), target)
    model.forward = forward
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def capture_model(model, args, kwargs, options: CompileOptions, training: bool) -> Captured:
    """The model as export sees it in ``training`` mode (a bf16 twin under mixed precision), with
    ``options.loss_fn`` after it when given."""
    def trace(traced):
        # traced where the model is (a CPU model, GPU batches): the program runs on the mesh's device
        # whatever device it was traced on (runtime/device.py)
        where = next((t.device for t in itertools.chain(traced.parameters(), traced.buffers())), None)
        a, kw = (to_device((tuple(args), kwargs), where) if where is not None and where.type != "meta"
                 else (tuple(args), kwargs))
        kw = dict(kw or {})
        with _mode(traced, training), _with_loss(traced, options.loss_fn, kw):
            return capture(traced, tuple(a), kw)
    if options.mixed_precision:
        return capture_in(model, COMPUTE_DTYPES[options.mixed_precision], trace)
    return trace(model)


class CaptureCache:
    """The last ``limit`` captures of one model, by what a trace depends on: the mode, each input's
    shape, dtype, ``requires_grad`` and contiguity (or a non-tensor's value), the inputs' structure, the
    loss function, the compute dtype and the grad mode (a forward may branch on ``torch.is_grad_enabled()``).
    Not the inputs' values: export traces them as fake tensors."""

    def __init__(self, limit: int = 4):
        self._captures = ProgramCache(limit, "capture", quiet=True)
        self.traced = 0          # captures made (not found here): how many traces the module paid for

    def get(self, model: nn.Module, args, kwargs, options: CompileOptions, training: bool) -> Captured:
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
        layout = tuple(x.is_contiguous() for x in leaves if isinstance(x, torch.Tensor))   # export traces strides
        key = (id(model), id(options.loss_fn), options.mixed_precision, torch.is_grad_enabled(), layout,
               program_key(training, leaves, spec))
        found = self._captures.get(key)
        if found is None:
            found = self._captures.put(key, capture_model(model, args, kwargs, options, training))
            self.traced += 1
        return found
