"""The split of backward a zero-bubble schedule runs: B now, the weight gradients (W) later.

A matmul with a parameter as its weight, ``y = x W^T (+ b)``, has two gradients: ``dx = dy W``, which
the previous pipeline stage waits for, and ``dW = dy^T x``, which nobody waits for. The
``split_weight_grad`` pass (``passes/weight_grad.py``) makes each such matmul of a stage graph a call
of ``deferred_linear``. Its backward computes ``dx`` (and the bias's gradient, a cheap sum) at once;
while a ``deferring`` block is open (the executor's B action), it puts ``(x, dy, W)`` in that block's
``WeightGrads`` instead of computing ``dW``. The W action then runs ``WeightGrads.run``: every ``dW``
of the microbatch, handed to autograd at the weight as the graph saw it, so a cast or a padded copy of
the parameter passes its gradient on to the leaf, and the dp reducer's hooks fire, as a whole backward
would. Outside such a block (a schedule without W, an eval) the op is an ordinary linear.

Only the runtime opens blocks; the pass and this record are data, and run nothing by themselves.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class Deferred:
    """One matmul's weight gradient, waiting for W: its input, its output's gradient and its weight
    (the tensor the graph multiplied by, with its autograd history back to the parameter)."""
    x: torch.Tensor
    dy: torch.Tensor
    weight: torch.Tensor
    transposed: bool          # ``y = x W`` with ``W`` stored (in, out) (HF Conv1D, addmm), else ``x W^T``

    def grad(self) -> torch.Tensor:
        dy = self.dy.reshape(-1, self.dy.shape[-1])
        x = self.x.reshape(-1, self.x.shape[-1])
        return x.t().matmul(dy) if self.transposed else dy.t().matmul(x)


@dataclass
class WeightGrads:
    """The deferred weight gradients of one B action (one stage, one microbatch)."""
    items: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes held from B to W (each tensor once): the memory the split costs."""
        seen, total = set(), 0
        for d in self.items:
            for t in (d.x, d.dy):
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
        return total

    def run(self) -> None:
        """W: every weight gradient, accumulated through autograd into the parameters."""
        items, self.items = self.items, []
        if items:
            torch.autograd.backward([d.weight for d in items], [d.grad().to(d.weight.dtype) for d in items])


_open: list = []        # the innermost open block's WeightGrads, if any
_whole: list = []       # non-empty: matmuls run whole (their dW in B), as ``whole_backward`` asks


@contextlib.contextmanager
def whole_backward():
    """Within the block, ``deferred_linear`` is ATen's linear: its backward computes ``dW`` with ``dx``.
    For a B whose W the schedule runs right after it and whose input gradient nobody waits for (the
    first stage's): splitting it would only cost a second pass over cold inputs."""
    _whole.append(True)
    try:
        yield
    finally:
        _whole.pop()


@contextlib.contextmanager
def deferring(grads: WeightGrads):
    """Within the block, ``deferred_linear``'s backward leaves its weight gradients in ``grads``."""
    _open.append(grads)
    try:
        yield grads
    finally:
        _open.pop()


def defer(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, transposed: bool) -> bool:
    """Leave one weight gradient for W if a block is open (True), else let the caller compute it."""
    if not _open:
        return False
    _open[-1].items.append(Deferred(x, dy, weight, transposed))
    return True


class _KeepForW:
    """The hook on a deferred matmul's output: in B it receives ``dy`` and leaves ``(x, dy, W)`` for W.
    The matmul itself is ATen's, on the detached weight, so autograd's B computes the input's and the
    bias's gradients in C++ and reaches nothing between the matmul and the parameter (a node it reached
    would run, and free its saved tensors, before W needs it)."""
    __slots__ = ("x", "weight", "transposed")

    def __init__(self, x, weight, transposed):
        self.x, self.weight, self.transposed = x, weight, transposed

    def __call__(self, dy):
        x, weight, self.x, self.weight = self.x, self.weight, None, None
        if not defer(x, dy, weight, self.transposed):
            # no block open (a backward outside the schedule's B): the weight's gradient now, through
            # autograd from the weight as the graph saw it (a reentrant backward)
            torch.autograd.backward(weight, Deferred(x, dy, weight, self.transposed).grad().to(weight.dtype))


def deferred_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    transposed: bool = False) -> torch.Tensor:
    """``x W^T + b`` (``x W + b`` when ``transposed``) whose weight gradient waits for W inside a
    ``deferring`` block. On meta tensors (the compiler's shape runs) and without autograd, a plain linear."""
    w = weight.t() if transposed else weight
    if x.is_meta or not torch.is_grad_enabled() or not weight.requires_grad or _whole:
        return F.linear(x, w, bias)
    y = F.linear(x, w.detach(), bias)
    if y.requires_grad:
        y.register_hook(_KeepForW(x.detach(), weight, transposed))
    else:                 # nothing else needs a gradient: W alone would, so keep autograd's own dW
        y = F.linear(x, w, bias)
    return y
