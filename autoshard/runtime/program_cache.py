"""One bounded cache for the programs a module compiles after its first.

Every new call shape (an epoch's short last batch, a longer validation sequence) or mode compiles a
program of its own: a ``forward`` program, a ``pm.step`` executor, a pipeline twin. A training loop with
many sequence lengths would otherwise keep one of each forever, with its bound graph and its saved
buffers. The modules keep them here instead: the ``limit`` most recently used, by ``ProgramKey``. A
dropped entry is closed (an executor removes its gradient hooks) and logged; if its inputs come back it
is compiled again.
"""
from __future__ import annotations

import logging
import numbers
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

import torch

log = logging.getLogger("autoshard")

V = TypeVar("V")


def _checked(limit) -> int:
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"max_programs={limit!r}: keep at least one program (an int >= 1)")
    return limit


class ProgramCache(Generic[V]):
    """The ``limit`` most recently used values by key; ``on_drop(value)`` runs on each one dropped.
    ``limit`` is an int, or a function giving it (the owner's ``max_programs``, which a user may change
    after building the module). ``quiet``: a drop is not logged (a cache of something cheap to remake)."""

    def __init__(self, limit: int | Callable[[], int], what: str, on_drop: Callable[[V], None] | None = None,
                 quiet: bool = False):
        self._limit = limit if callable(limit) else _checked(limit)
        self.what, self._on_drop, self._quiet = what, on_drop, quiet
        self._entries: OrderedDict = OrderedDict()

    @property
    def limit(self) -> int:
        return _checked(self._limit()) if callable(self._limit) else self._limit

    def get(self, key) -> V | None:
        """The value for ``key``, now the most recently used; None if there is none."""
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key, value: V) -> V:
        """Keep ``value`` for ``key``, dropping the least recently used beyond the limit."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.limit:
            old_key, old = self._entries.popitem(last=False)
            if self._on_drop is not None:
                self._on_drop(old)
            if not self._quiet:
                log.info("autoshard: dropped the least recently used %s (%s) to keep %d; it compiles again if its "
                         "inputs come back (parallelize(max_programs=...) keeps more)", self.what,
                         getattr(old_key, "inputs", old_key), self.limit)
        return value

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> list[V]:
        return list(self._entries.values())

    def keys(self) -> list:
        return list(self._entries)


@dataclass(frozen=True)
class ProgramKey:
    """What a compiled program is specific to. ``requires_grad`` is part of it: whether a floating input
    needs a gradient decides whether the program all-reduces that gradient (Megatron's f)."""
    training: bool
    inputs: tuple         # per flattened leaf: (shape, dtype, requires_grad) of a tensor, or the value itself
    structure: str        # the pytree spec of (args, kwargs)


def constants_only_change(key: ProgramKey, held: list) -> list:
    """The flattened positions where ``key`` differs from a held key of the same mode, structure and
    tensors only in a Python number's value (compiled in as a constant): each new value of such an input
    compiles a program. Empty when no held key is that close. (A module built from a step program keeps
    the first program's key apart, so there the second new value is the first said.)"""
    for other in held:
        if (other.training, other.structure) != (key.training, key.structure) or len(other.inputs) != len(key.inputs):
            continue
        diff = [i for i, (a, b) in enumerate(zip(key.inputs, other.inputs)) if a != b]
        if diff and all(_is_number(key.inputs[i]) and _is_number(other.inputs[i]) for i in diff):
            return diff
    return []


def _is_number(x) -> bool:
    """A Python number an input took (not a flag: ``use_cache=True`` is a choice, not a count)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def program_key(training: bool, leaves, spec) -> ProgramKey:
    sig = tuple((tuple(x.shape), x.dtype, bool(x.requires_grad)) if isinstance(x, torch.Tensor) else x
                for x in leaves)
    return ProgramKey(bool(training), sig, str(spec))
