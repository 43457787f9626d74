"""Output shaping before planning."""
from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.ir.errors import InputError


def loss_only_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """With ``loss_only``, return None for every non-scalar output so the logits are never gathered
    (and nothing is priced for gathering them)."""
    if not ctx.options.loss_only:
        return gm
    out = next(n for n in gm.graph.nodes if n.op == "output")

    def keep(a):
        v = a.meta.get("val")
        return a if isinstance(v, torch.Tensor) and v.dim() == 0 else None

    kept = tuple(keep(a) if isinstance(a, fx.Node) else a for a in out.args[0])
    if not any(isinstance(a, fx.Node) for a in kept) and ctx.options.pipeline is None:   # pm.step: LossError
        raise InputError("loss_only=True, but the model returns no loss for these inputs (it returns no scalar): "
                         "pass the labels (labels= for an HF model, the targets for the built-in GPT), or "
                         "loss_only=False for the logits")
    out.args = (kept,)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
