"""Capture: ``torch.export`` (non-strict) to an ATen-level FX graph with parameters as explicit inputs.

Non-strict export runs the model's Python under fake tensors, so a model built on the ``meta`` device
compiles without allocating its weights. Every placeholder is annotated with ``meta.KIND`` (parameter /
buffer / input), ``meta.NAME`` (its name in the original model) and ``meta.REQUIRES_GRAD``.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from autoshard.ir import meta as M
from autoshard.ir.program import Captured
from autoshard.passes.functionalize import WritesParameters, functionalize
from autoshard.passes.index_ranges import check_static_indices, index_ranges
from autoshard.passes.regions import RegionError, inline_regions
from autoshard.passes.shapes import module_path, writes_in_place

aten = torch.ops.aten


class CaptureError(ValueError, RuntimeError):
    """The model's forward could not be traced; the message names the module and the construct. A
    ValueError (the input model is the problem) and, as before, a RuntimeError."""


_HINTS = [
    ("data-dependent", "Python control flow or sizes that depend on tensor *values* cannot be traced: "
                       "use torch.where / torch.cond, or move the branch out of forward()."),
    ("item()", "Tensor.item() reads a value at trace time: keep the computation in tensors."),
    ("mutation", "In-place updates of module state during forward cannot be captured: return the value."),
]


def _module_stack_tracker(model):
    stack, handles = [], []

    def enter(name):
        def hook(module, args):
            stack.append(name)
        return hook

    def leave(module, args, output):
        stack.pop()

    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(enter(name)))
        handles.append(mod.register_forward_hook(leave))
    return stack, handles


def _unalias(args, kwargs):
    """Clone a tensor passed twice (``labels=ids``): export would read one placeholder for both, and the
    program would then be wrong for any later call that passes two different tensors."""
    seen = set()

    def once(x):
        if id(x) in seen:
            return x.clone()
        seen.add(id(x))
        return x
    return torch.utils._pytree.tree_map_only(torch.Tensor, once, (args, kwargs))


@contextmanager
def _training_forward(model, kwargs):
    """Trace without a KV cache: HF models default to ``config.use_cache=True``, which returns a cache
    object export cannot flatten. A cache is for generation; autoshard compiles the training forward."""
    if kwargs.get("use_cache"):
        raise CaptureError("use_cache=True asks for a KV cache, which is for generation: autoshard compiles the "
                           "training forward; pass use_cache=False (or leave it out)")
    config = getattr(model, "config", None)
    old = getattr(config, "use_cache", None)
    if old:
        config.use_cache = False
    try:
        yield
    finally:
        if old:
            config.use_cache = old


def _export(model, args, kwargs):
    stack, handles = _module_stack_tracker(model)
    try:
        with _training_forward(model, kwargs):
            return torch.export.export(model, tuple(args), kwargs, strict=False)
    except CaptureError:
        raise
    except Exception as e:  # name the module the tracer was in and the construct, with a hint
        where = stack[-1] if stack and stack[-1] else "<top>"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = next((h for key, h in _HINTS if key.lower() in str(e).lower()),
                    "see the torch.export docs on non-strict tracing for what the forward may contain.")
        module = f"'{where}' ({type(model.get_submodule(where)).__name__})" if where != "<top>" else "the top module"
        raise CaptureError(f"cannot capture the forward of {module}: {type(e).__name__}: {first}\n"
                           f"hint: {hint}") from e
    finally:
        for h in handles:
            h.remove()


# ops whose output always shares its input's storage: a write through them writes the input. (``reshape``,
# ``contiguous`` and ``to`` may copy instead, so a write after them proves nothing about the parameter)
_TRUE_VIEWS = {aten.view, aten._unsafe_view, aten.t, aten.transpose, aten.permute, aten.select, aten.slice,
               aten.expand, aten.unsqueeze, aten.squeeze, aten.detach, aten.alias, aten.narrow, aten.as_strided,
               aten.diagonal, aten.unfold}


def _viewed(x: fx.Node) -> fx.Node:
    """The tensor ``x`` is a view of through ``_TRUE_VIEWS`` (``x`` itself when it is none)."""
    while (x.op == "call_function" and getattr(x.target, "overloadpacket", None) in _TRUE_VIEWS and x.args
           and isinstance(x.args[0], fx.Node)):
        x = x.args[0]
    return x


def _refuse_parameter_writes(ep) -> None:
    """A forward that writes its own weights in place (under ``no_grad``: RWKV's eval-mode rescaling,
    ``rescale_every``) is not a pure function of them: the captured program would repeat the write on
    every call, where the model guards it with a Python flag, and on a shard of the weight. Refuse it
    by name before any pass reports it as a write into a view or a stage cut drops it. Read once export's
    ``no_grad`` regions are inlined (the write sits in one); where functionalization ran first, it has
    found such writes already (``functionalize.WritesParameters``). A write into a copy of a weight
    (``w.float().mul_(2)``) is no write of the weight, and passes."""
    placeholders = [n for n in ep.graph_module.graph.nodes if n.op == "placeholder"]
    params = {n: spec.target for n, spec in zip(placeholders, ep.graph_signature.input_specs)
              if spec.kind is InputKind.PARAMETER}
    for n in ep.graph_module.graph.nodes:
        x = n.args[0] if n.args else None
        written = _viewed(x) if writes_in_place(n) and isinstance(x, fx.Node) else None
        if written in params:
            raise CaptureError(_parameter_write_message(module_path(n), params[written], n.target))


def _parameter_write_message(where: str, parameter: str, op, count: int = 1) -> str:
    more = f" (and {count - 1} more)" if count > 1 else ""
    place = f"'{where}'" if where else "the top module"
    hint = ("RWKV does this in eval mode to guard fp16 against overflow: set config.rescale_every = 0 (its layer "
            "norms leave the loss the same but for their eps)" if "rwkv" in f"{where}.{parameter}".lower()
            else "update the weight outside forward (after the optimizer step), or compute the changed weight "
                 "out of place (w = self.weight * c) and use that")
    return (f"the forward of {place} writes its parameter '{parameter}'{more} in place ({op}): autoshard captures "
            f"forwards that are pure functions of their weights, and shards them.\nhint: {hint}")


def capture(model: nn.Module, args: tuple, kwargs: dict | None = None) -> Captured:
    kwargs = kwargs or {}
    on_meta = any(p.is_meta for p in model.parameters())
    args, kwargs = _unalias(args, kwargs)
    example_leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    device = next((x.device for x in example_leaves if isinstance(x, torch.Tensor)), torch.device("cpu"))
    if on_meta:  # trace a weightless model with weightless inputs; constants are retargeted below
        args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, lambda x: x.to("meta"), (args, kwargs))
    ep = _export(model, args, kwargs)
    for spec in ep.graph_signature.output_specs:
        if spec.kind not in (OutputKind.USER_OUTPUT,):
            raise CaptureError(f"the forward mutates {spec.kind.name.lower()} '{spec.target}'; autoshard "
                               "captures pure forwards only (hint: return the new value instead)")
    try:
        ep, functionalized = functionalize(ep)
    except WritesParameters as e:
        raise CaptureError(_parameter_write_message("", e.targets[0], "an in-place op", len(e.targets))) from None
    gm = ep.graph_module
    try:
        regions = inline_regions(gm)
    except RegionError as e:
        raise CaptureError(str(e)) from None
    _refuse_parameter_writes(ep)
    _check_static_sizes(model, gm)
    for n in list(gm.graph.nodes):  # export's dtype asserts: no output, and sharding never changes dtypes
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(n)
    if on_meta:
        meta = torch.device("meta")
        for n in gm.graph.nodes:
            n.args = tuple(device if a == meta else a for a in n.args)
            n.kwargs = {k: (device if v == meta else v) for k, v in n.kwargs.items()}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params, buffers, users = [], [], []
    for node, spec in zip(placeholders, ep.graph_signature.input_specs):
        if spec.kind is InputKind.PARAMETER:
            kind, params = "parameter", params + [spec.target]
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            kind, buffers = "buffer", buffers + [spec.target]
        else:
            kind, users = "input", users + [spec.arg.name]
        M.KIND.set(node, kind)
        M.REQUIRES_GRAD.set(node, kind == "parameter")
        M.NAME.set(node, spec.target if kind != "input" else spec.arg.name)
    input_leaves = _user_inputs(gm, [n for n in placeholders if M.KIND.get(n) == "input"], example_leaves)
    users = [n for n in users if n in {M.NAME.get(p) for p in gm.graph.nodes if p.op == "placeholder"}]
    aliases = _resolve_tied(model, gm, placeholders, params)
    gm.recompile()
    return Captured(gm, ep.call_spec.in_spec, ep.call_spec.out_spec, params, buffers, aliases, users,
                    dict(ep.constants),
                    [x if not isinstance(x, torch.Tensor) else (tuple(x.shape), x.dtype) for x in example_leaves],
                    input_leaves=input_leaves, regions=regions, functionalized=functionalized,
                    index_ranges=_checked_index_ranges(gm),
                    example_requires_grad=[isinstance(x, torch.Tensor) and bool(x.requires_grad) for x in example_leaves])


def _checked_index_ranges(gm) -> list:
    """The user inputs used as indices (checked at each call), after refusing indices that overflow for
    these shapes alone (``index_ranges.py``)."""
    check_static_indices(gm)
    return index_ranges(gm)


def _check_static_sizes(model, gm) -> None:
    """Refuse a graph whose sizes depend on tensor values (export's unbacked symbols, ``u0``): an MoE
    that loops over experts with per-expert token counts (JetMoE) traces, but then every size after it
    is unknown, and sharding, stage cuts and the executor's buffers all need static ones."""
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if v is None or not free_unbacked_symbols(v):
            continue
        where = module_path(n)
        top = where == "the top module"
        try:
            kind = type(model if top else model.get_submodule(where)).__name__
        except AttributeError:
            kind = "module"
        raise CaptureError(f"{where if top else repr(where)} ({kind}) makes a size from tensor values ({n.target} gives "
                           f"{v if not isinstance(v, torch.Tensor) else tuple(v.shape)}): autoshard needs "
                           "sizes known at compile time.\nhint: compute every expert on every token and mask, "
                           "or use the model's dense / grouped-matmul expert path; a loop over "
                           "per-expert token counts cannot be sharded or cut into stages")


def _user_inputs(gm, inputs, leaves) -> list:
    """Which flattened call leaves the graph reads, in placeholder order.

    Export makes one placeholder per leaf, tensor or not. A non-tensor leaf (``use_cache=False``) is
    specialised into the trace: its placeholder has no users and is dropped, and the runtime checks the
    value against the example instead. Inputs that require grad (inputs_embeds, prompt tuning) are marked
    so they get Megatron's f like any replicated value.
    """
    if len(inputs) != len(leaves):
        raise CaptureError(f"export made {len(inputs)} input placeholders for {len(leaves)} input leaves: an "
                           "input layout autoshard does not know; pass tensors and plain Python values only")
    kept = []
    for i, (node, x) in enumerate(zip(inputs, leaves)):
        if isinstance(x, torch.Tensor):
            M.REQUIRES_GRAD.set(node, bool(x.requires_grad and x.is_floating_point()))
            kept.append(i)
        elif node.users:
            raise CaptureError(f"the non-tensor input '{M.NAME.get(node)}' = {x!r} is read by the graph as a value; "
                               "autoshard compiles non-tensor inputs in as constants: pass it as a tensor")
        else:
            gm.graph.erase_node(node)
    return kept


def _resolve_tied(model, gm, placeholders, params) -> dict:
    """Tied weights: export lists every name of a shared tensor, but the graph reads only one of them.
    Keep the used placeholder under the name ``model.named_parameters()`` yields (the first: HF's
    ``model.embed_tokens.weight``, not ``lm_head.weight``, so a user's name filters and param groups see
    the names they know), drop the other placeholders, and return ``{alias: that name}`` for state dicts."""
    by_id = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    node_of = {M.NAME.get(n): n for n in placeholders if M.KIND.get(n) == "parameter"}
    aliases = {}
    for names in by_id.values():
        names = [n for n in names if n in node_of]
        if len(names) < 2:
            continue
        main, used = names[0], next((n for n in names if node_of[n].users), names[0])
        if used != main and not node_of[main].users:   # the graph reads the tensor under an alias
            gm.graph.erase_node(node_of[main])
            params.remove(main)
            M.NAME.set(node_of[used], main)
            params[params.index(used)] = main
            node_of[main] = node_of.pop(used)
        for n in names:
            if n != main:
                aliases[n] = main
                if n in node_of and not node_of[n].users:
                    gm.graph.erase_node(node_of[n])
                    params.remove(n)
    return aliases
