"""Launchers and the autograd layer (Liger's layering: kernel -> launcher -> ``autograd.Function``).

A ``Kernel`` is one generated ``@triton.jit`` function with its plan: it allocates the outputs, picks
the tile sizes and grid, launches, and adds the ``colsum`` partials. ``FusedGroup`` is the module the
fusion pass puts in the graph: forward runs the group's forward kernel; backward runs its backward
kernel, which recomputes the forward's pointwise work from the group's inputs, so the only tensors kept
for backward are the inputs the backward reads (``saved``).

Kernels are specialised on their operands' strides and dtypes. The pass compiles them for the traced
layout; a call with another layout (a non-contiguous gradient, a bf16 program) compiles one more
variant the first time it is seen.
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch
import torch.fx as fx

from autoshard.kernels import codegen
from autoshard.kernels.cache import load_source
from autoshard.kernels.lower import ALIAS, COLSUM, KernelPlan, canonical_ids, lower
from autoshard.kernels.trace import GroupTrace

MAX_PROGRAMS = 1024      # instances that keep colsum partials (the launcher adds this many rows)
# Triton's interpreter patches triton.language globally for the length of a launch, so two threads (the
# in-process simulator's ranks) must not interpret at once.
_INTERPRETER_LOCK = threading.Lock()
_COMPILE_LOCK = threading.Lock()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _np2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Launch:
    block_r: int
    block_c: int
    iters: int
    grid: tuple
    num_warps: int


def launch_shape(plan: KernelPlan, interpreter: bool) -> Launch:
    """Tiles of about 2K elements on a GPU (4K for whole rows); 64K under the interpreter, which pays
    1-5 ms per instance whatever its size."""
    target = 1 << 16 if interpreter else (4096 if plan.template == "row" else 2048)
    if plan.template == "row":
        block_c = _np2(plan.cols)
    else:
        block_c = min(_np2(plan.cols), 256 if not interpreter else 1 << 14)
    block_r = min(_np2(plan.rows), max(1, target // block_c))
    row_blocks = -(-plan.rows // block_r)
    iters = 1
    if any(o.kind == COLSUM for o in plan.outputs):
        iters = -(-row_blocks // min(row_blocks, MAX_PROGRAMS))
    programs = -(-row_blocks // iters)
    grid = (programs,) if plan.template == "row" else (programs, -(-plan.cols // block_c))
    warps = max(1, min(16, block_r * block_c // 512))
    return Launch(block_r, block_c, iters, grid, 1 << (warps.bit_length() - 1))


class Kernel:
    """One generated kernel and how to launch it."""

    def __init__(self, plan: KernelPlan, label: str):
        self.plan, self.label = plan, label
        # named by the plan alone: two groups with the same plan (every layer's) share one file
        self.name = self.module_name = f"autoshard_{plan.template}_{plan.key}"
        self.source, self.fn = "", None
        self._shapes: dict = {}     # interpreter or not -> Launch: fixed by the plan, so computed once
        if plan.used:           # else every output is an input handed back: nothing to generate
            self.source = codegen.render(plan, self.name)
            self.fn = getattr(load_source(self.module_name, self.source), self.name)

    def __call__(self, *inputs) -> list:
        plan = self.plan
        if not plan.used:     # nothing to compute: every output is an input handed back
            return [inputs[o.alias].view(o.shape) if o.alias is not None else None for o in plan.outputs]
        # the device of the first operand with elements (a lifted 0-d constant may sit on the CPU)
        device = next((inputs[i].device for i in plan.used if inputs[i].dim() > 0), inputs[plan.used[0]].device)
        inputs = [x.to(device) if isinstance(x, torch.Tensor) and x.dim() == 0 and x.device != device else x
                  for x in inputs]
        interp = interpreting() or device.type != "cuda"
        shape = self._shapes.get(interp)
        if shape is None:
            shape = self._shapes[interp] = launch_shape(plan, interp)
        outs, partials = [], []
        for o in plan.outputs:
            if o.kind == ALIAS:
                continue
            if o.kind == COLSUM:
                acc = torch.float64 if plan.compute == "tl.float64" else torch.float32
                partials.append(torch.empty((shape.grid[0], plan.cols), dtype=acc, device=device))
                outs.append(partials[-1])
            else:
                outs.append(torch.empty(o.shape, dtype=o.dtype, device=device))
        args = [inputs[i] for i in plan.used]
        with _INTERPRETER_LOCK if interpreting() else contextlib.nullcontext():
            self.fn[shape.grid](*args, *outs, ITERS=shape.iters, BLOCK_R=shape.block_r, BLOCK_C=shape.block_c,
                                num_warps=shape.num_warps)
        made, results = iter(outs), []
        for o in plan.outputs:
            if o.kind != ALIAS:
                results.append(_finish(o, next(made)))
            else:
                results.append(results[o.same_as] if o.same_as is not None else inputs[o.alias].view(o.shape))
        return results


def _finish(o, out):
    return out.sum(0).to(o.dtype).view(o.shape) if o.kind == COLSUM else out


def _layout(x):
    return (tuple(x.shape), tuple(x.stride()), x.dtype) if isinstance(x, torch.Tensor) else None


class Variants:
    """A primitive graph's kernels, one per operand layout seen."""

    def __init__(self, graph: fx.GraphModule, anchor: tuple, label: str, input_kinds=None, reuse=None,
                 shared: int = 0):
        self.graph, self.anchor, self.label, self.input_kinds = graph, tuple(anchor), label, input_kinds
        self.reuse, self.shared = reuse, shared
        self.kernels: dict = {}
        self.needed: tuple | None = None    # the inputs the first kernel read: a layout is theirs alone

    def get(self, inputs) -> Kernel:
        key = tuple(_layout(inputs[i]) for i in self.needed) if self.needed is not None else None
        k = self.kernels.get(key)
        if k is None:
            with _COMPILE_LOCK:     # ranks as threads (the simulator) meet a new layout together
                return self._compile(inputs)
        return k

    def _compile(self, inputs) -> Kernel:
        key = tuple(_layout(inputs[i]) for i in self.needed) if self.needed is not None else None
        k = self.kernels.get(key)
        if k is None:
            plan = lower(self.graph, list(inputs), self.anchor, self.input_kinds, self.reuse, self.shared)
            if self.needed is None:
                self.needed = plan.used
                key = tuple(_layout(inputs[i]) for i in self.needed)
            k = self.kernels[key] = Kernel(plan, self.label)
        return k

    def __call__(self, *inputs) -> list:
        return self.get(inputs)(*inputs)


class FusedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group: "FusedGroup", *inputs):
        outs = group.forward_kernels(*inputs)
        ctx.group = group
        ctx.save_for_backward(*[inputs[i] for i in group.saved], *[outs[j] for j in group.saved_outputs])
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        saved = list(ctx.saved_tensors)
        inputs = [None] * group.n_inputs
        outputs = [None] * len(group.output_floating)
        for i in group.saved:
            inputs[i] = saved.pop(0)
        for j in group.saved_outputs:
            outputs[j] = saved.pop(0)
        # contiguous: an incoming gradient of a .sum() is an expand (stride 0), which the compiled
        # variant does not take; unsaved operands are None, so a new variant could not be lowered
        floats = [g.contiguous() for g, o in zip(grads, group.output_floating) if o]
        got = group.backward_kernels(*inputs, *floats, *outputs)
        res = [None] * group.n_inputs
        for i, g in zip(group.trace.grad_inputs, got):
            res[i] = g
        return (None, *res)


class FusedGroup(torch.nn.Module):
    """A fusion group in the compiled graph: ``forward(*inputs)`` returns the group's outputs as a tuple.

    Built from meta ``inputs`` (the layout the program will pass): the forward and backward kernels are
    generated and imported here, so a group that cannot be lowered fails at compile time, not in a step.
    """

    def __init__(self, name: str, trace: GroupTrace, anchor: tuple, inputs: list):
        super().__init__()
        self.group_name, self.trace, self.anchor = name, trace, tuple(anchor)
        self.n_inputs = len(inputs)
        self.forward_kernels = Variants(trace.forward, anchor, f"{name}_fwd")
        fwd = self.forward_kernels.get(inputs)
        self.output_floating = tuple(o.dtype.is_floating_point for o in fwd.plan.outputs)
        self.backward_kernels = None
        self.saved: tuple = ()             # inputs kept for backward
        self.saved_outputs: tuple = ()     # outputs kept for backward (read there instead of recomputed)
        if trace.backward is not None:
            outs = [torch.empty(o.shape, dtype=o.dtype, device="meta") for o in fwd.plan.outputs]
            grads = [o for o in outs if o.dtype.is_floating_point]
            out_kinds = [o.kind if o.kind != "alias" else None for o in fwd.plan.outputs]
            kinds = [None] * len(inputs) + [k for k, o in zip(out_kinds, outs) if o.dtype.is_floating_point] + out_kinds
            first = len(inputs) + len(grads)    # the outputs follow the gradients
            ids = canonical_ids(trace.forward, len(inputs))
            returned = next(n for n in trace.forward.graph.nodes if n.op == "output").args[0]
            reuse = {ids[o]: first + j for j, o in enumerate(returned)
                     if isinstance(o, fx.Node) and o.op == "call_function"}
            self.backward_kernels = Variants(trace.backward, anchor, f"{name}_bwd", kinds, reuse, len(inputs))
            bwd = self.backward_kernels.get([*inputs, *grads, *outs])
            self.saved = tuple(i for i in bwd.plan.used if i < len(inputs))
            self.saved_outputs = tuple(i - first for i in bwd.plan.used if i >= first)

    runs_without_comm = True     # runtime/bind.py binds no communicator to it

    def forward(self, *inputs):
        if any(isinstance(x, torch.Tensor) and x.is_meta for x in inputs):
            return tuple(self.trace.forward(*inputs))   # shape propagation: the primitive graph on meta
        return FusedFunction.apply(self, *inputs)

    def kernels(self) -> list:
        """Every kernel generated so far (forward first); a pass-through (no work) generates none."""
        every = list(self.forward_kernels.kernels.values()) + \
            (list(self.backward_kernels.kernels.values()) if self.backward_kernels else [])
        return [k for k in every if k.fn is not None]

    def extra_repr(self):
        return (f"{self.group_name}: anchor {list(self.anchor)}, backward reads inputs {list(self.saved)} "
                f"and outputs {list(self.saved_outputs)}")


def compile_group(fn, inputs: list, name: str = "group", backward: bool = True,
                  grad_inputs: tuple | None = None) -> FusedGroup:
    """A ``FusedGroup`` for ``fn(*inputs) -> tuple of tensors``, iterating over its largest output's shape
    (what the fusion pass does for a group of graph nodes; tests and benchmarks call it on functions).
    ``grad_inputs``: the inputs that need gradients (default: the floating-point ones)."""
    from autoshard.kernels.trace import trace_group
    metas = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") for x in inputs]
    with torch.no_grad():
        outs = fn(*metas)
    anchor = tuple(max(outs, key=lambda v: v.numel()).shape)
    return FusedGroup(name, trace_group(fn, metas, backward, grad_inputs), anchor, metas)
