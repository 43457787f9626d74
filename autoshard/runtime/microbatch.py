"""Splitting a call's batch into microbatches: every tensor input cut along dim 0, checked against the
compiled microbatch's shapes (``pm.step`` and ``pm.eval_batch`` run each microbatch through the stages)."""
from __future__ import annotations

import torch


def row_counts(leaves: list) -> set:
    """The dim-0 sizes of a call's tensors (one, for a batch ``pm.step`` can split)."""
    return {x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() >= 1}


def named_leaves(call) -> list:
    """``(name, leaf)`` for each flattened leaf of a call ``(args, kwargs)``: a keyword's name (and the
    path inside it), or ``argument i``."""
    out = []
    for path, x in torch.utils._pytree.tree_flatten_with_path(call)[0]:
        keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
        name = (".".join(map(str, keys[1:])) if keys and keys[0] == 1 else
                f"argument {'.'.join(map(str, keys[1:]))}" if len(keys) > 1 else str(keys))
        out.append((name, x))
    return out


def _rows_by_input(call) -> str:
    """``"input_ids (4, 8), position_ids (1, 8)"``: each tensor of a call by its name and shape."""
    return ", ".join(f"{name} {tuple(x.shape)}" for name, x in named_leaves(call)
                     if isinstance(x, torch.Tensor) and x.dim() >= 1)


def split_batch(leaves: list, m: int, example_leaves: list | None = None, call=None) -> list:
    """Per microbatch, the flattened call leaves: every tensor cut into m equal slices along dim 0 (and
    checked against the compiled microbatch's ``example_leaves``, when given). ``call``: the
    ``(args, kwargs)`` the leaves came from, to name the inputs in an error."""
    sizes = row_counts(leaves)
    if len(sizes) > 1:
        named = f" ({_rows_by_input(call)})" if call is not None else ""
        raise ValueError(f"pm.step splits every tensor input along dim 0 into microbatches, but their first "
                         f"dims differ: {sorted(sizes)}{named}; pass batch-first tensors of one batch size "
                         "(a (1, seq) input such as position_ids repeated to the batch's rows)")
    batch = sizes.pop() if sizes else 1
    if batch % m:
        near = " or ".join(str(b) for b in (batch // m * m, batch // m * m + m) if b)
        fits = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ValueError(f"a batch of {batch} rows cannot be split into microbatches={m}: use a batch size that "
                         f"is a multiple of {m} (here {near}), or a microbatch count that divides {batch} "
                         f"({', '.join(map(str, fits))}); for an epoch's short last batch, drop_last=True in the "
                         "DataLoader")
    mb = batch // m
    out = [[x[i * mb:(i + 1) * mb] if isinstance(x, torch.Tensor) and x.dim() >= 1 else x for x in leaves]
           for i in range(m)]
    for x, ex in zip(out[0], example_leaves or ()):
        got = (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
        if got != ex:
            raise ValueError(f"a microbatch input is {got}, but the pipeline was compiled for {ex}: pm.step "
                             "runs the shapes of the example batch (batch size / microbatches); parallelize "
                             "again for another batch shape")
    return out
