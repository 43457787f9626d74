"""A call's inputs checked at its start: index ranges (torch's contract, kept across vocab shards), and
dtypes of another kind than the model was compiled for.

A vocab-parallel embedding looks up only the ids its rows hold and writes zeros elsewhere; the
vocab-parallel cross-entropy reads only the targets its columns hold. Both are right for every id in
``[0, V)`` and silently wrong outside it: an id no shard holds reads as a zero embedding, a label no
shard holds as a zero target logit, and the step returns a loss. Torch on one device refuses both
(``index out of range``, ``Target out of bounds``), and so does autoshard, before the masked op:

- on CPU (eager), a clear ``InputError`` naming the input, the bad value, its position and the valid
  range. The check reads one boolean back, which costs nothing on CPU, and every rank holds the same
  ids (tp ranks are handed one batch: ``batch_check.py``), so every rank raises the same error;
- on a GPU, and inside a compiled graph, ``torch._assert_async``: a device-side assert, as torch's own
  embedding and NLL kernels do, so the check adds no host synchronisation.

``ignore_index`` is honoured: a target equal to it is not out of range.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from autoshard.ir.errors import InputError


def _kind(dtype: torch.dtype) -> str:
    return "bool" if dtype == torch.bool else "floating" if dtype.is_floating_point else \
        "complex" if dtype.is_complex else "integer"


def _refused(got: torch.dtype, compiled: torch.dtype, index: bool) -> bool:
    """Whether a call's dtype is the wrong kind: an index input (token ids, labels) that is not an integer
    (torch's embedding and losses refuse them), or a floating input (embeddings, features) given as
    integers or booleans. Masks may switch between bool, int and float, as HF accepts them all."""
    if index:
        return _kind(got) != "integer"
    return _kind(compiled) in ("floating", "complex") and _kind(got) in ("integer", "bool")


def in_example_order(kwargs: dict, captured) -> dict:
    """A call's keywords in the order the example gave them (those it did not give after, in the call's
    order): keywords are by name, so ``pm(attention_mask=m, input_ids=x)`` is the example's call
    ``pm(input_ids=x, attention_mask=m)``, flattened alike, and runs the same program."""
    spec = captured.in_spec
    try:       # TreeSpec.child from torch 2.12; children_specs before
        keys = list((spec.child(1) if hasattr(spec, "child") else spec.children_specs[1]).context)
    except (AttributeError, IndexError, TypeError):
        return kwargs
    if not kwargs or list(kwargs) == keys:
        return kwargs
    ordered = {k: kwargs[k] for k in keys if k in kwargs}
    ordered.update((k, v) for k, v in kwargs.items() if k not in ordered)
    return ordered


def check_dtype_kinds(leaves: list, captured, spec=None) -> None:
    """A tensor of the wrong kind for its place is an error naming the input, before a program is compiled
    for it (``_refused``): float token ids, or int64 ``inputs_embeds``, would otherwise compile a new
    program and fail deep inside the model's trace, or run. Another dtype of an accepted kind (bf16 for
    fp32 activations, a bool mask for an int one) compiles its own program. Inputs of another structure
    (``inputs_embeds=`` where the example gave ``input_ids=``) have no example to compare by place."""
    examples = captured.example_leaves
    if len(leaves) != len(examples) or (spec is not None and spec != captured.in_spec):
        return          # another structure: the program lookup names it
    names = dict(zip(captured.input_leaves, captured.user_input_names))
    indices = {r.input for r in captured.index_ranges}
    labels = {r.input for r in captured.index_ranges if "label" in r.what}
    for i, (x, ex) in enumerate(zip(leaves, examples)):
        if not (isinstance(x, torch.Tensor) and isinstance(ex, tuple) and len(ex) == 2
                and isinstance(ex[1], torch.dtype)):
            continue
        if names.get(i) in labels and ex[1] == torch.int64 and x.dtype != torch.int64 and _kind(x.dtype) == "integer":
            # torch's cross_entropy takes int64 class indices (and refuses int32 on one device); a vocab-parallel
            # shard would take them, so a tp run and a one-rank run would disagree
            raise InputError(f"'{names[i]}' is {str(x.dtype).replace('torch.', '')}, but the loss takes class indices "
                             "as int64, as torch's cross_entropy does: pass labels.long()")
        if "mask" in str(names.get(i, "")) and names.get(i) not in indices:   # HF takes a mask as bool, int or float
            continue
        if _kind(x.dtype) != _kind(ex[1]) and _refused(x.dtype, ex[1], names.get(i) in indices):
            name = f"'{names[i]}'" if i in names else f"input {i}"
            raise InputError(f"{name} is {str(x.dtype).replace('torch.', '')}, but the model was compiled with "
                             f"{str(ex[1]).replace('torch.', '')} there ({_kind(ex[1])}, not {_kind(x.dtype)}): pass "
                             f"{'token ids as integers (.long())' if _kind(ex[1]) == 'integer' else 'a tensor of that dtype'}")


def shape_changes(leaves: list, captured, microbatches: int = 1, spec=None) -> str:
    """The inputs whose shapes differ from the first program's examples, named (for an error about a
    new program that failed to compile): ``"'targets' (4, 9), compiled for (4, 8)"``. A pipeline's
    examples are one microbatch: the batch it was compiled for has ``microbatches`` times their rows."""
    examples = captured.example_leaves
    if len(leaves) != len(examples) or (spec is not None and spec != captured.in_spec):
        return ""
    names = dict(zip(captured.input_leaves, captured.user_input_names))
    out = []
    for i, (x, ex) in enumerate(zip(leaves, examples)):
        if not (isinstance(x, torch.Tensor) and isinstance(ex, tuple) and len(ex) == 2):
            continue
        compiled = tuple(ex[0])
        if compiled and microbatches > 1:
            compiled = (compiled[0] * microbatches,) + compiled[1:]
        if tuple(x.shape) != compiled:
            out.append(f"{repr(names[i]) if i in names else f'input {i}'} {tuple(x.shape)}, compiled for {compiled}")
    return "; ".join(out)


@contextmanager
def naming_new_shapes(leaves: list, captured, microbatches: int = 1, spec=None):
    """Compile a program for new inputs; if that fails, the error's first line says which inputs changed
    shape (usually the cause: labels longer than the ids, a mask of another length), then the compiler's."""
    try:
        yield
    except Exception as e:
        changed = shape_changes(leaves, captured, microbatches, spec)
        if not changed:
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(f"inputs of new shapes ({changed}) could not be compiled: {first}") from e


def check_inputs(ranges: list, values: dict) -> None:
    """Check every user input the compiler found used as an index (``Captured.index_ranges``), by name,
    at a call's start: every rank holds the whole batch, so every rank raises alike, before any
    collective or pipeline transfer."""
    for r in ranges:
        v = values.get(r.input)
        if isinstance(v, torch.Tensor) and not v.is_floating_point():
            check_range(v, r.size, r.what, r.ignore_index, f"'{r.input}'")


def check_call_inputs(captured, leaves: list) -> None:
    """``check_inputs`` on a call's flattened leaves, named as ``captured`` (the program's capture) names them."""
    check_inputs(captured.index_ranges,
                 dict(zip(captured.user_input_names, (leaves[i] for i in captured.input_leaves))))


def check_range(values: torch.Tensor, size: int, what: str, ignore_index: int | None = None,
                name: str = "a tensor") -> None:
    """Raise (or assert on the device) unless every entry of ``values`` is in ``[0, size)`` or equals
    ``ignore_index``. ``what`` names the kind of value ("token id", "label"), ``name`` the input."""
    if values.is_meta or size is None or values.numel() == 0:
        return
    on_host = values.device.type == "cpu" and not torch.compiler.is_compiling()
    if on_host:   # one reduction and two numbers read back: the common case, all in range, costs ~5 us
        lo, hi = torch.aminmax(values)
        if int(lo) >= 0 and int(hi) < size:
            return
    bad = (values < 0) | (values >= size)
    if ignore_index is not None:
        bad = bad & (values != ignore_index)
    allowed = f"[0, {size})" + (f" or ignore_index={ignore_index}" if ignore_index is not None else "")
    if not on_host:
        torch._assert_async(~bad.any(), f"autoshard: a {what} of {name} is outside {allowed}")
        return
    if bool(bad.any()):
        where = bad.nonzero()
        first = tuple(int(i) for i in where[0])
        value = int(values[first])
        raise InputError(f"{what} {value} at position {first} of {name} (shape {tuple(values.shape)}) is "
                         f"outside {allowed} ({len(where)} such entr{'y' if len(where) == 1 else 'ies'}): "
                         f"{_hint(what, size, name)}")


def _hint(what: str, size: int, name: str = "") -> str:
    if "position" in name:
        return (f"the position table has {size} rows (max_position_embeddings); torch's embedding refuses such an "
                f"index on one device: keep the positions, and the sequence, under {size}")
    if "label" in what:
        return (f"the model has {size} classes; torch's cross_entropy refuses such a target on one device "
                "(mark positions to skip with ignore_index, -100 by default)")
    if what == "token id":
        return (f"the embedding has {size} rows; torch's embedding refuses such an id on one device (check the "
                "tokenizer's vocabulary against the model's)")
    return (f"the table has {size} rows; torch's embedding refuses such an index on one device (a sequence longer "
            "than a position table gives one)")
