"""The comparisons every parity test makes against the single-device model (one copy, used by all)."""
from __future__ import annotations

import torch


def rel(a, b, floor=1e-12):
    """Max-abs error relative to the reference's max-abs (at least ``floor``)."""
    return float((a - b).abs().max() / max(float(b.abs().max()), floor))


def gradient_errors(pm, ref) -> dict:
    """Every gathered gradient against the reference's; the compared set must be the model's whole set.

    An analytically zero gradient (the key bias) is rounding noise with no relative accuracy: it is
    measured against a thousandth of the model's largest gradient instead of against itself.
    """
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    floor = 1e-3 * max(float(p.grad.abs().max()) for p in ref.parameters())
    errs = {f"grad {name}": rel(pm.gather(name, p.grad), ref_params[name].grad, floor)
            for name, p in pm.local_parameters().items()}
    compared = set(pm.local_parameters()) | set(pm.aliases)
    assert compared == set(ref_params), f"parameters compared {sorted(compared)} != the model's {sorted(ref_params)}"
    return errs


def adamw_errors(pm, ref, step, steps: int) -> dict:
    """``steps`` AdamW steps on both (``step()`` runs one forward+backward on each), then every parameter.

    Adam's first step is ~lr * sign(grad). A gradient that is analytically zero (the key bias: softmax
    ignores it) is fp32 rounding noise whose sign differs between any two summation orders, so with the
    default eps=1e-8 *any* two correct implementations drift by lr there. The step's sensitivity to a
    gradient error is about lr/eps; eps=1e-4 keeps the comparison about our gradients, not rounding.
    Parameters are compared against the model's weight scale: the key bias starts at zero and only ever
    moves by noise-driven steps (~1e-8), which no relative-to-itself measure can compare.
    """
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-4)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    opt.step(); ropt.step()
    for _ in range(steps - 1):
        opt.zero_grad(); ropt.zero_grad()
        step()
        opt.step(); ropt.step()
    full = pm.full_state_dict()
    ref_state = ref.state_dict()
    assert set(full) >= {k for k, v in ref_state.items() if v.is_floating_point()}, sorted(set(ref_state) - set(full))
    scale = max(float(p.abs().max()) for p in ref.parameters())
    return {f"after {steps} AdamW steps: {name}": rel(full[name], p, scale)
            for name, p in ref_state.items() if p.is_floating_point()}
