"""Capture under ``mixed_precision``: the program is traced from a bf16 twin of the model.

``compute_twin`` makes the twin: the floating parameters in the compute dtype, weightless (fake tensors
on the model's own device, or ``meta`` for a model built there); the real fp32 parameters stay in the
``ParallelModule``, which casts them for each step. Buffers stay the model's own, in their dtype: a
rotary table is computed in fp32 on purpose and cast by the model.

One kind of fp32 buffer would break that: one the model adds into its bf16 activations without a cast
(XGLM's sinusoidal position table). Eager PyTorch then promotes the stream to fp32, and the next matmul
meets fp32 activations and bf16 weights. ``capture_in`` finds such buffers from a first trace (walking
back from the matmul along fp32 values only, to buffers alone), traces again with them in the compute
dtype, and casts them on entry to the program, as a model converted with ``.to(torch.bfloat16)`` holds
them. An fp32 value that reaches a matmul from anything but buffers stays a compile-time error naming
the module.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.fx as fx
import torch.nn as nn

from autoshard.ir import meta as M
from autoshard.ir.program import Captured
from autoshard.passes.shapes import module_path
from autoshard.passes.stage_prices import MATMULS

COMPUTE_DTYPES = {"bf16": torch.bfloat16}
aten = torch.ops.aten


def compute_twin(model: nn.Module, dtype: torch.dtype, cast_buffers=frozenset()) -> nn.Module:
    """A weightless copy of ``model`` whose floating parameters are ``dtype``: what a mixed-precision
    program is traced from. Its parameters are fake tensors on the model's own device, not ``meta`` ones:
    a forward that branches on its device (HF's MoE counts tokens per expert with ``histc`` on floats on
    a CPU, on ints elsewhere; Falcon's ALiBi builds its slopes where its mask lives) traces the branch
    the program will run. The buffers are the model's own (shared, not copied: a trace reads them), but
    those named in ``cast_buffers``, which are weightless ``dtype`` copies. A model built on ``meta`` gets
    a ``meta`` twin."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    on_meta = any(p.is_meta for p in model.parameters())
    fake = contextlib.nullcontext() if on_meta else FakeTensorMode(allow_non_fake_inputs=True)
    memo = {}
    with fake:
        for p in model.parameters():
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, device="meta" if on_meta else p.device,
                                                   dtype=dtype if p.is_floating_point() else p.dtype),
                                       requires_grad=p.requires_grad)
        for name, b in model.named_buffers():
            if name in cast_buffers:
                memo[id(b)] = torch.empty(b.shape, device="meta" if on_meta else b.device, dtype=dtype)
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = torch.empty_like(b, device="meta") if on_meta else b
    return copy.deepcopy(model, memo)


def capture_in(model: nn.Module, dtype: torch.dtype, trace) -> Captured:
    """``trace(twin)`` of ``model``'s ``dtype`` twin, checked: every matmul sees ``dtype`` alone. Buffers
    that promote the activations to fp32 are traced again in ``dtype`` and cast on entry."""
    captured = trace(compute_twin(model, dtype))
    promoting = _promoting_buffers(captured.gm, dtype)
    if promoting:
        captured = trace(compute_twin(model, dtype, promoting))
        _cast_on_entry(captured.gm, promoting, dtype, {n: b.dtype for n, b in model.named_buffers()})
    check_compute_dtypes(captured.gm, dtype)
    _real_constants(captured, model)
    return captured


def _float(n) -> torch.dtype | None:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) and val.is_floating_point() else None


def _matmul(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(getattr(n.target, "overloadpacket", None), "__name__", "") in MATMULS


def _promoting_buffers(gm: fx.GraphModule, dtype: torch.dtype) -> frozenset:
    """The buffers whose fp32 values reach a matmul beside ``dtype`` operands, found by walking back from
    the matmul's wider inputs along values of that wider dtype (a tensor made from sizes alone, a mask's
    ``torch.full`` in the promoted stream's dtype, ends a walk); empty unless every walk ends at buffers
    or such factories (a user input, or an activation widened on purpose, is not a buffer to cast)."""
    found = set()
    for n in gm.graph.nodes:
        if not _matmul(n) or len({_float(a) for a in n.all_input_nodes} - {None}) < 2:
            continue
        stack = [a for a in n.all_input_nodes if _float(a) not in (None, dtype)]
        seen = set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if v.op == "placeholder":
                if M.KIND.get(v, None) != "buffer":
                    return frozenset()
                found.add(M.NAME.get(v))
                continue
            wide = [a for a in v.all_input_nodes if _float(a) == _float(v)]
            if not wide and any(_float(a) for a in v.all_input_nodes):
                return frozenset()   # widened here from narrower values (an explicit .float()): not a buffer's
            stack.extend(wide)       # none at all: a factory (a mask's torch.full) in the stream's dtype, which
                                     # follows the stream once the buffer is cast
    return frozenset(found)


def _cast_on_entry(gm: fx.GraphModule, names: frozenset, dtype: torch.dtype, real: dict) -> None:
    """Each buffer placeholder in ``names`` takes the model's real dtype and is cast to ``dtype`` before
    its first use (traced as ``dtype``, so everything after it already is)."""
    g = gm.graph
    for ph in [n for n in g.nodes if n.op == "placeholder" and M.KIND.get(n, None) == "buffer"
               and M.NAME.get(n) in names]:
        narrow = ph.meta["val"]
        ph.meta["val"] = narrow.to(real.get(M.NAME.get(ph), torch.float32))
        with g.inserting_after(next(n for n in g.nodes if n.op != "placeholder").prev):
            cast = g.call_function(aten._to_copy.default, (ph,), {"dtype": dtype})
        cast.meta["val"] = narrow
        ph.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)
    g.lint()
    gm.recompile()


def check_compute_dtypes(gm: fx.GraphModule, dtype: torch.dtype) -> None:
    """Under mixed precision every matmul must see the compute dtype. An fp32 value from anything but a
    buffer (a user's float input, say) that reaches one would fail at the first step inside the
    program: say which module, and what to do, at compile time instead."""
    for n in gm.graph.nodes:
        if not _matmul(n):
            continue
        floats = {_float(a) for a in n.all_input_nodes} - {None}
        if len(floats) > 1:
            raise ValueError(f"mixed_precision: '{module_path(n)}' multiplies {sorted(map(str, floats))} tensors in "
                             f"{n.target}: an fp32 input or constant reaches the {dtype} activations. Cast it in "
                             "the model (for example `pe.to(x.dtype)`), or parallelize without mixed_precision")


def _real_constants(captured: Captured, model: nn.Module) -> None:
    """A ``meta`` twin is weightless, so a tensor export lifted from a module attribute as a constant (HF
    Llama's rotary ``original_inv_freq``, the same tensor as its ``inv_freq`` buffer) is on ``meta`` in
    the trace. It is the model's own tensor: take it from the model by its name."""
    for name, value in captured.constants.items():
        if not (isinstance(value, torch.Tensor) and value.is_meta):
            continue
        real = model
        for part in name.split("."):
            real = getattr(real, part, None)
        if isinstance(real, torch.Tensor) and not real.is_meta and real.shape == value.shape:
            captured.constants[name] = real.detach().to(value.dtype)
