"""Fold identical transformer blocks into one before the shard ILP: plan a block once, reuse it everywhere.

A 128-layer GPT is the same block 128 times. The ILP over the whole graph (``passes/plan.py``) grows
with the depth (142K variables at 128 layers, 4 s of HiGHS) though every middle block ends up with the
same strategies. ``fold_map`` finds the longest run of consecutive blocks with the same structure (ops,
shapes, dtypes and wiring, read from the graph) and maps each node of the run's middle blocks to its
counterpart in one representative block. The first and last blocks of the run stay unfolded: they meet
the embedding and the head, where a plan may differ. ``build_problem`` then gives a folded node its
representative's variables, adds its costs to them (so a block's cost counts as often as the block
occurs), and adds each folded edge's costs to the representative edge's variables: the ILP of three
blocks, priced as all of them. Any choice the ILP makes is exact, whatever it costs; folding only
restricts the middle blocks to choose alike, as Alpa's and autoparallel's layer reuse do.
"""
from __future__ import annotations

import re

import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.passes.stage_prices import layer_of, layer_prefix
from autoshard.passes.shapes import shape_of, val

FOLD_MIN_LAYERS = 6      # a run shorter than this is planned whole (the saving is small; tests stay as they were)


def _layers(gm: fx.GraphModule, prefix: str) -> dict:
    """layer index -> its nodes in graph order (parameters by their name, the rest by module stack)."""
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    out: dict = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            match = pattern.match(M.NAME.get(n, "") or "")
            layer = int(match[1]) if match and M.KIND.get(n, None) == "parameter" else None
        elif n.op == "call_function":
            layer = layer_of(n, prefix)
        else:
            layer = None
        if layer is not None:
            out.setdefault(layer, []).append(n)
    return out


def _signature(nodes: list, prev: list | None) -> tuple | None:
    """The structure of one layer: per node its op, target, shape and dtype, and where each input comes
    from (a node of this layer or of the previous one by position, or the same node outside both)."""
    here = {n: i for i, n in enumerate(nodes)}
    before = {n: i for i, n in enumerate(prev or [])}
    sig = []
    for n in nodes:
        v = val(n)
        dtype = str(getattr(v, "dtype", type(v).__name__))
        ins = []
        for a in n.all_input_nodes:
            if a in here:
                ins.append(("here", here[a]))
            elif a in before:
                ins.append(("prev", before[a]))
            else:
                ins.append(("outside", a.name))
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: None)   # the literals (dims, scales), nodes blanked
        target = M.KIND.get(n, None) if n.op == "placeholder" else str(n.target)   # not its layer-numbered name
        sig.append((n.op, target, tuple(shape_of(n) or ()), dtype, tuple(ins), repr(args)))
    return tuple(sig)


def fold_map(gm: fx.GraphModule) -> dict:
    """``{node: representative}`` for the nodes of the folded blocks (empty when nothing folds)."""
    prefix = layer_prefix(gm)
    if prefix is None:
        return {}
    layers = _layers(gm, prefix)
    order = sorted(layers)
    if len(order) < FOLD_MIN_LAYERS or order != list(range(order[0], order[0] + len(order))):
        return {}
    sigs = {k: _signature(layers[k], layers.get(k - 1)) for k in order}
    runs, start = [], order[1]            # runs of equal signatures (the first layer reads the embedding)
    for k in order[2:]:
        if sigs[k] != sigs[start]:
            runs.append((start, k - 1))
            start = k
    runs.append((start, order[-1]))
    first, last = max(runs, key=lambda r: r[1] - r[0])
    if last - first + 1 < FOLD_MIN_LAYERS:
        return {}
    rep = first + 1                       # the run's first and last blocks stay their own
    out = {}
    for k in range(rep + 1, last):
        if len(layers[k]) != len(layers[rep]):
            continue
        out.update(zip(layers[k], layers[rep]))
    return out
