"""The split of backward a zero-bubble schedule runs: B now, the weight gradients (W) later.

A matmul with a parameter as its weight, ``y = x W^T (+ b)``, has two gradients: ``dx = dy W``, which
the previous pipeline stage waits for, and ``dW = dy^T x``, which nobody waits for. The
``split_weight_grad`` pass (``passes/weight_grad.py``) makes each such matmul of a stage graph a call
of ``deferred_linear``. Where the executor splits a microbatch (``splitting``: around its F, and
around its B, whose recompute regions run the forward again), the matmul's backward computes ``dx``
(and the bias's gradient, a cheap sum) at once and puts ``(x, dy, W)`` in the B's ``WeightGrads``
(``deferring``) instead of computing ``dW``. The W action then runs ``WeightGrads.run``: every ``dW``
of the microbatch, handed to autograd at the weight as the graph saw it, so a cast or a padded copy of
the parameter passes its gradient on to the leaf, and the dp reducer's hooks fire, as a whole backward
would. Elsewhere (a schedule without W, an eval, a backward the executor runs whole) the op is ATen's
linear.

Only the runtime opens blocks; the pass and these records are data, and run nothing by themselves.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


WEIGHT_GRAD_PLAN = "autoshard_weight_grad_plan"     # GraphModule.meta key: the WeightGradPlan (split_weight_grad)


@dataclass(frozen=True)
class DeferredMatmul:
    """One matmul whose weight gradient W computes."""
    node: str
    parameter: str
    shape: tuple          # the weight's local shape


@dataclass(frozen=True)
class WeightGradPlan:
    """What ``split_weight_grad`` moved to W, and which parameters keep their gradients in B."""
    deferred: tuple       # DeferredMatmul
    in_b: tuple           # parameter names whose gradients B computes (norms, biases, embeddings, ...)

    @property
    def late(self) -> frozenset:
        """The parameters whose gradients are final only at W."""
        return frozenset(d.parameter for d in self.deferred)


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
_splitting: list = []   # non-empty: deferred matmuls split (the executor's F and B of a split microbatch)


@contextlib.contextmanager
def splitting():
    """Within the block, ``deferred_linear`` (and a deferring ``ColumnParallelMatmul``) leave their
    weight gradients for W. The executor opens it around the F of every microbatch it splits and around
    that microbatch's B (whose recomputed forwards must split alike); everywhere else (an eval, a
    stage-0 backward it runs whole, a program without W) they are ATen's linear, autograd's dW in B."""
    _splitting.append(True)
    try:
        yield
    finally:
        _splitting.pop()


def is_splitting() -> bool:
    return bool(_splitting)


@contextlib.contextmanager
def deferring(grads: WeightGrads):
    """Within the block (a split microbatch's B), the deferred matmuls' backward leaves their weight
    gradients in ``grads``."""
    _open.append(grads)
    try:
        with splitting():
            yield grads
    finally:
        _open.pop()


def defer(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, transposed: bool) -> None:
    """Leave one weight gradient for W, in the open block's ``WeightGrads``."""
    if not _open:       # the executor opens a block around every B of a microbatch whose F split
        raise RuntimeError("internal: a split matmul's backward ran outside its B (no deferring block open): "
                           "its weight gradient would be lost")
    _open[-1].items.append(Deferred(x, dy, weight, transposed))


class _DeferredLinear(torch.autograd.Function):
    """``weight`` comes in detached, so autograd's B reaches nothing between the matmul and the
    parameter (a node it reached would be run, and its saved tensors freed, before W needs it); the
    weight with its history rides along in ``held``, for W. ``x`` is saved as autograd saves any
    activation, so a recompute region drops and recomputes it, and the executor counts it."""
    @staticmethod
    def forward(ctx, x, weight, bias, transposed, held):
        ctx.save_for_backward(x, weight)
        ctx.held, ctx.transposed, ctx.has_bias = held, transposed, bias is not None
        return F.linear(x, weight.t() if transposed else weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        w = weight.t() if ctx.transposed else weight                 # (out, in)
        dx = dy.matmul(w) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        real, ctx.held = ctx.held[0], None
        defer(x, dy, real, ctx.transposed)
        return dx, None, db, None, None


def deferred_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    transposed: bool = False) -> torch.Tensor:
    """``x W^T + b`` (``x W + b`` when ``transposed``) whose weight gradient waits for W when the
    executor splits this microbatch (``splitting``); otherwise, and on meta tensors (the compiler's shape
    runs), ATen's linear."""
    if not _splitting or x.is_meta or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight.t() if transposed else weight, bias)
    return _DeferredLinear.apply(x, weight.detach(), bias, transposed, [weight])
