"""Which user inputs are indices, and into what: token ids into an embedding, labels into a loss.

Read off the captured graph, before any sharding: an ``embedding`` whose indices are a user input (seen
through reshapes, slices and copies, which keep the values), and a ``cross_entropy_loss`` / ``nll_loss``
whose target is one (HF's shift ``labels[..., 1:]``, and its pad with ``ignore_index``, keep the values
too). The runtime checks each such input on every rank at a call's start, where torch on one device
would raise and a vocab-parallel shard would mask (``runtime/input_checks.py``). An index computed from
values (a position id made with ``arange``) is not an input and is not listed; the sharded ops check
their own indices as well.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir.errors import InputError
from autoshard.ir.program import IndexRange
from autoshard.passes.shapes import module_path

aten = torch.ops.aten

# ops whose output holds (some of) the input's values and no others
_SAME_VALUES = {aten.view, aten.reshape, aten._unsafe_view, aten.slice, aten.select, aten.clone, aten.contiguous,
                aten.squeeze, aten.unsqueeze, aten.flatten, aten.alias, aten.detach, aten.expand, aten.permute,
                aten.transpose, aten.t, aten.lift_fresh_copy, aten.narrow}
_LOSSES = {aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.nll_loss2d}


def _input_behind(node, ignore_index=None):
    """The user-input placeholder whose values ``node`` carries unchanged, or None."""
    seen = set()
    while isinstance(node, fx.Node) and node not in seen:
        seen.add(node)
        if node.op == "placeholder":
            return node if M.KIND.get(node, None) == "input" else None
        if node.op != "call_function":
            return None
        packet = getattr(node.target, "overloadpacket", None)
        if packet in (aten._to_copy, aten.to) and \
                node.kwargs.get("dtype", torch.int64) in (torch.int64, torch.int32) and \
                not any(isinstance(a, torch.dtype) and a not in (torch.int64, torch.int32) for a in node.args[1:]):
            node = node.args[0]
        elif _pads_with(node, packet, ignore_index):
            node = node.args[0]          # padded with ignore_index: still only the input's values and skips
        elif packet in _SAME_VALUES:
            node = node.args[0]
        else:
            return None
    return None


def _pads_with(node, packet, value) -> bool:
    """Whether ``node`` pads its input with the constant ``value`` (HF's ``F.pad(labels, (0, 1),
    value=ignore_index)``, captured as ``constant_pad_nd`` or ``pad(..., "constant", value)``)."""
    if value is None:
        return False
    if packet is aten.constant_pad_nd:
        return (node.args[2] if len(node.args) > 2 else 0) == value
    if packet is aten.pad:
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        fill = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", 0)
        return mode == "constant" and fill is not None and fill == value
    return False


def _ignore_index(node) -> int:
    """A loss's ``ignore_index``: the fifth argument of ``cross_entropy_loss`` and of every ``nll_loss``."""
    args = dict(zip(("self", "target", "weight", "reduction", "ignore_index"), node.args))
    return int(node.kwargs.get("ignore_index", args.get("ignore_index", -100)))


def _shape_only(node) -> bool:
    """Whether ``node`` is computed from no placeholder at all (only from sizes and constants: an
    ``arange`` of the sequence length, as position ids are)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            return False
        todo.extend(n.all_input_nodes)
    return True


def _evaluate(node):
    """The value of a shape-only node, computed on the CPU from its ancestors (a handful of small ops)."""
    order, seen = [], set()

    def visit(n):
        if n in seen:
            return
        seen.add(n)
        for a in n.all_input_nodes:
            visit(a)
        order.append(n)
    visit(node)
    env = {}
    load = lambda a: env[a] if isinstance(a, fx.Node) else a      # noqa: E731
    for n in order:
        args = fx.node.map_aggregate(n.args, load)
        kwargs = dict(fx.node.map_aggregate(n.kwargs, load))
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        env[n] = n.target(*args, **kwargs)
    return env[node]


def check_static_indices(gm: fx.GraphModule) -> None:
    """Refuse, at compile time, an embedding indexed past its rows by indices that depend on shapes alone:
    position ids past the position table for a sequence longer than the model takes. The first line
    names the table, its rows and the largest index; on one device torch would raise an opaque
    ``index out of range in self`` at run time."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or getattr(n.target, "overloadpacket", None) is not aten.embedding:
            continue
        weight, idx = n.args[0], n.args[1]
        val = weight.meta.get("val") if isinstance(weight, fx.Node) else None
        if val is None or not isinstance(idx, fx.Node) or not _shape_only(idx):
            continue
        try:
            values = _evaluate(idx)
        except Exception:  # noqa: BLE001 - an op we cannot run here: the run-time checks remain
            continue
        rows = int(val.shape[0])
        if values.numel() and (int(values.max()) >= rows or int(values.min()) < 0):
            raise InputError(f"'{module_path(n)}' has {rows} rows but is indexed up to {int(values.max())} for these "
                             f"inputs: a sequence longer than the model's {rows} positions (its block_size / "
                             f"max_position_embeddings); pass sequences of at most {rows} tokens")


def index_ranges(gm: fx.GraphModule) -> list:
    """``[IndexRange]`` for every user input that indexes an embedding or a loss's classes (one per input
    and use; an input used twice, as ``labels=ids``, is listed for both)."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        packet = getattr(n.target, "overloadpacket", None)
        if packet is aten.embedding:
            weight, idx = n.args[0], n.args[1]
            size = weight.meta["val"].shape[0] if isinstance(weight, fx.Node) and "val" in weight.meta else None
            src = _input_behind(idx)
            if src is not None and size is not None:
                out.append(IndexRange(M.NAME.get(src), int(size), "token id", None, module_path(n)))
        elif packet in _LOSSES:
            logits, target = n.args[0], n.args[1]
            val = logits.meta.get("val") if isinstance(logits, fx.Node) else None
            if val is None or val.dim() < 1:
                continue
            classes = val.shape[1] if val.dim() > 1 else val.shape[0]
            ignore = _ignore_index(n)
            src = _input_behind(target, ignore)
            if src is not None:
                out.append(IndexRange(M.NAME.get(src), int(classes), "label", ignore, module_path(n)))
    return list(dict.fromkeys(out))
