"""The fusion patterns the issue names, as functions of their operands, shared by the benchmark
(``benchmarks/fusion.py``, at GPU sizes) and the tests (``tests/kernels/test_fusion.py``, at odd tiny sizes)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def bias_gelu(x, b):
    return (F.gelu(x + b, approximate="tanh"),)


def bias_dropout_residual(x, b, r):
    return (r + F.dropout(x + b, 0.0, True),)


def scale_mask_softmax(s, m):
    return (torch.softmax(torch.where(m, s * 0.125, -1e4), -1),)


def swiglu(a, c):
    return (F.silu(a) * c,)


def residual_layer_norm(x, r, w, b):
    y = x + r
    return y, F.layer_norm(y, (y.shape[-1],), w, b)


def residual_rms_norm(x, r, w):
    y = x + r
    return y, F.rms_norm(y, (y.shape[-1],), w, 1e-6)


def table_broadcast(x, cos):      # a [S, H] table broadcast over the batch (rotary's cos term)
    return (x * cos + x,)


@dataclass(frozen=True)
class Pattern:
    name: str
    fn: object
    grad_inputs: tuple | None     # None: every floating-point operand


PATTERNS = [Pattern("bias_gelu", bias_gelu, None), Pattern("bias_dropout_residual", bias_dropout_residual, None),
            Pattern("scale_mask_softmax", scale_mask_softmax, (0,)), Pattern("swiglu", swiglu, None),
            Pattern("residual_layer_norm", residual_layer_norm, None),
            Pattern("residual_rms_norm", residual_rms_norm, None), Pattern("table_broadcast", table_broadcast, (0,))]


def operands(name: str, b: int, s: int, h: int, heads: int = 4, dtype=torch.float32, device="cpu", seed=0):
    """Operands for pattern ``name`` on a [b, s, h] activation (scores are [b, heads, s, s])."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)

    mask = (torch.rand(1, 1, s, s, generator=g) > 0.3).to(device)
    return {
        "bias_gelu": [r(b, s, h), r(h)],
        "bias_dropout_residual": [r(b, s, h), r(h), r(b, s, h)],
        "scale_mask_softmax": [r(b, heads, s, s), mask],
        "swiglu": [r(b, s, h), r(b, s, h)],
        "residual_layer_norm": [r(b, s, h), r(b, s, h), r(h), r(h)],
        "residual_rms_norm": [r(b, s, h), r(b, s, h), r(h)],
        "table_broadcast": [r(b, s, h), r(s, h)],
    }[name]
