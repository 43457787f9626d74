"""The loss of a whole batch from microbatches: the mean cross-entropy rewritten as a sum and a count.

A microbatched step (``pm.step``: gradient accumulation, a pipeline, data parallelism) must give the
single-device loss and gradients on the whole batch. Averaging microbatch means is wrong when
microbatches hold different numbers of non-ignored targets (``ignore_index``): the bug HF
``transformers`` shipped in 2024. So the mean ``cross_entropy_loss`` the model returns becomes a *sum*
over the microbatch, and the runtime divides by ``num_items``, the count of non-ignored targets over the
whole (global) batch: it seeds each microbatch's backward with ``1 / num_items`` and divides the summed
loss by it. The sum over microbatches (and dp ranks) is then the exact mean, and so are the gradients.

The same holds for ``nll_loss`` of a ``log_softmax`` (a ``loss_fn`` that spells cross-entropy out).
``num_items`` depends only on the labels: this pass cuts the labels' own (input-only) computation out of
the graph into a small count graph that the runtime runs per microbatch. Only the first backward needs
the total, so its all-reduce over dp overlaps the first forward. A loss it cannot analyse (class
weights, a loss computed from several terms, targets computed from a buffer) stays as it is and is
divided by the number of microbatches (the mean of microbatch means); ``LossRewrite.reason`` says why,
and ``pipeline.md`` prints it. A ``reduction='sum'`` cross-entropy is already exact: its microbatch
sums are summed (no count, a denominator of 1). So is a summed one divided by one number for the whole
batch, as HF models do when given ``num_items_in_batch`` (which must then count the whole global batch,
as HF's Trainer counts it across devices).
"""
from __future__ import annotations


import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir.pipeline import LOSS_REWRITE, LossRewrite
from autoshard.passes.rules_vocab import cross_entropy_args
from autoshard.passes.walk import upstream
from autoshard.ir.errors import warn_user

aten = torch.ops.aten
MEAN, SUM = 1, 2


class LossError(ValueError):
    """The model's output has no loss that ``pm.step`` can run backward from."""


def loss_node(gm: fx.GraphModule, pipelined: bool = False) -> fx.Node:
    """The scalar floating output ``pm.step`` minimises (and ``pm.eval_batch`` returns): the only one, or the
    one every other scalar output feeds (an HF MoE model returns ``loss`` and the ``aux_loss`` that was
    added into it). ``pipelined``: pp > 1, where the runtime returns no other output (no logits)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = []
    fx.node.map_arg(out.args[0], leaves.append)
    scalars = list(dict.fromkeys(a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
                                 and a.meta["val"].dim() == 0 and a.meta["val"].is_floating_point()))
    total = [s for s in scalars if all(o is s or _reads(s, o) for o in scalars)]
    if len(total) != 1:
        raise LossError(f"pm.step and pm.eval_batch run from the model's loss, but the model returns {len(scalars)} "
                        "scalar outputs, none of which is made from all the others: return exactly one loss (for an "
                        "HF model pass labels=...), or give parallelize a loss_fn(output, target) and call "
                        "pm.step(x, target=y)" + (" (a pipeline runs the batch into that one loss: it returns no "
                                                  "logits)" if pipelined else
                                                  ", or call pm(...) and compute the loss yourself"))
    return total[0]


def _count_graph(target: fx.Node, ignore_index: int):
    """A graph from the user inputs to ``(target != ignore_index).sum()``, or a reason it cannot be cut
    out (the targets depend on a parameter or a buffer)."""
    needed = []
    for n in upstream([target]):
        if n.op == "placeholder" and M.KIND.get(n, None) != "input":
            return None, f"the targets are computed from {M.KIND.get(n, 'a')} '{M.NAME.get(n, n.name)}'"
        if n.op not in ("placeholder", "call_function"):
            return None, f"the targets are computed by {n.op} '{n.name}'"
        needed.append(n)
    order = {n: i for i, n in enumerate(target.graph.nodes)}
    g, env, inputs = fx.Graph(), {}, []
    for n in sorted(needed, key=order.__getitem__):
        if n.op == "placeholder":
            env[n] = g.placeholder(n.name)
            inputs.append(M.NAME.get(n))
        else:
            env[n] = g.node_copy(n, lambda u: env[u])
    ne = g.call_function(aten.ne.Scalar, (env[target], ignore_index))
    g.output(g.call_function(aten.sum.dim_IntList, (ne, []), {"dtype": torch.float32}))
    return fx.GraphModule(torch.nn.Module(), g), inputs


def _shared_divisor(loss: fx.Node) -> str | None:
    """For ``loss = sum_cross_entropy / d`` with ``d`` the same for every microbatch (a number, or computed
    from 0-dim inputs, buffers and constants alone: HF's ``num_items_in_batch``), what ``d`` is; else None.
    Such a loss is a sum over the batch scaled by one number, so the microbatches' losses add up."""
    if loss.target not in (aten.div.Tensor, aten.div.Scalar) or len(loss.args) != 2:
        return None
    total, d = loss.args
    if not (isinstance(total, fx.Node) and getattr(total.target, "overloadpacket", None) is aten.cross_entropy_loss):
        return None
    a = cross_entropy_args(total)
    if a["weight"] is not None or a["reduction"] != SUM:
        return None
    if not isinstance(d, fx.Node):
        return repr(d) if isinstance(d, (int, float)) else None
    names = []
    for n in upstream([d]):
        if n.op == "placeholder":
            kind, v = M.KIND.get(n, None), n.meta.get("val")
            if kind == "parameter" or (kind == "input" and not (isinstance(v, torch.Tensor) and v.dim() == 0)):
                return None       # split over microbatches (an input with a batch dim), or trained
            names.append(M.NAME.get(n, n.name))
        elif n.op not in ("call_function", "get_attr"):
            return None
    return ", ".join(f"'{x}'" for x in sorted(names)) or "a constant"


SCALE_INPUT = "autoshard_loss_scale"


def _mean_term(loss: fx.Node) -> fx.Node | None:
    """In ``loss = a + b`` (HF's MoE loss: ``loss += coef * aux_loss``), the one addend that is a
    cross-entropy term the other does not read: a plain mean cross-entropy, or a summed one divided by one
    number for the whole batch (``_shared_divisor``: HF's ``num_items_in_batch``, as the Trainer passes it
    to an MoE model); else None."""
    if loss.target is not aten.add.Tensor or len(loss.args) != 2 or loss.kwargs.get("alpha", 1) != 1:
        return None
    found = []
    for mine, other in (loss.args, loss.args[::-1]):
        if not isinstance(mine, fx.Node) or len(mine.users) != 1 or (isinstance(other, fx.Node) and _reads(other, mine)):
            continue
        if getattr(mine.target, "overloadpacket", None) is aten.cross_entropy_loss:
            a = cross_entropy_args(mine)
            if a["weight"] is None and a["reduction"] == MEAN:
                found.append(mine)
        elif _shared_divisor(mine) is not None:
            found.append(mine)
    return found[0] if len(found) == 1 else None


def _reads(n: fx.Node, target: fx.Node) -> bool:
    return any(x is target for x in upstream([n]))


def _scale_placeholder(gm: fx.GraphModule, like: fx.Node) -> fx.Node:
    g = gm.graph
    first = next(n for n in g.nodes if n.op != "placeholder")
    with g.inserting_before(first):
        scale = g.placeholder(SCALE_INPUT)
    scale.meta["val"] = torch.empty((), dtype=torch.float32, device=like.meta["val"].device)
    M.KIND.set(scale, "input")
    M.NAME.set(scale, SCALE_INPUT)
    M.REQUIRES_GRAD.set(scale, False)
    return scale


def _scaled_term(gm: fx.GraphModule, ce: fx.Node, loss: fx.Node) -> LossRewrite:
    """The cross-entropy term times a scale input that the runtime sets (see ``LossRewrite.scale_input``);
    the other terms stay as they are. A mean cross-entropy becomes its microbatch sum first (the scale then
    holds 1 / the global count); a sum divided by one number for the whole batch already is the
    microbatch's share of the global loss (the scale holds microbatches x dp, which the runtime's division
    of the whole loss undoes)."""
    g = gm.graph
    if (divisor := _shared_divisor(ce)) is not None:
        scale = _scale_placeholder(gm, ce)
        with g.inserting_before(ce.next):
            scaled = g.call_function(aten.mul.Tensor, (ce, scale))
            scaled.meta.update(ce.meta)
        loss.replace_input_with(ce, scaled)
        return LossRewrite(True, f"cross-entropy (reduction='sum') divided by {divisor}, one number for the whole batch "
                                 f"(HF's num_items_in_batch), plus other terms ({loss.target}): the cross-entropy "
                                 "summed over microbatches (and dp), the other terms as their mean", None, [],
                           SCALE_INPUT)
    a = cross_entropy_args(ce)
    count, inputs = _count_graph(a["target"], a["ignore_index"])
    if count is None:
        return LossRewrite(False, inputs)
    scale = _scale_placeholder(gm, ce)
    with g.inserting_before(ce.next):    # (inserting_after would put each new node before the last)
        total = g.call_function(aten.cross_entropy_loss.default,
                                (a["logits"], a["target"], None, SUM, a["ignore_index"], a["label_smoothing"]))
        total.meta.update(ce.meta)
        scaled = g.call_function(aten.mul.Tensor, (total, scale))
        scaled.meta.update(ce.meta)
    ce.replace_all_uses_with(scaled)
    g.erase_node(ce)
    return LossRewrite(True, f"cross-entropy (ignore_index={a['ignore_index']}) plus other terms ({loss.target}): the "
                             "cross-entropy as a sum over the global batch's count of non-ignored targets, the other "
                             "terms as the mean over microbatches (and dp)", count, inputs, SCALE_INPUT)


NLL_LOSSES = (aten.nll_loss_nd.default, aten.nll_loss.default)


def _nll_rewrite(gm: fx.GraphModule, loss: fx.Node) -> LossRewrite:
    """``nll_loss(log_softmax(x), t)`` (a ``loss_fn`` spelling cross-entropy out): as the mean
    cross-entropy, its microbatch sum over the global batch's count of non-ignored targets; a summed one is
    already exact; class weights are not analysed."""
    names = ("input", "target", "weight", "reduction", "ignore_index")
    a = dict(zip(names, (None, None, None, MEAN, -100)))
    a.update(zip(names, loss.args))
    a.update({("input" if k == "self" else k): v for k, v in loss.kwargs.items() if k in names or k == "self"})
    if a["weight"] is not None:
        return LossRewrite(False, "nll_loss with class weights (its mean divides by the targets' total weight)")
    if a["reduction"] == SUM:
        return LossRewrite(True, "nll_loss (reduction='sum'): the microbatches' sums, summed")
    if a["reduction"] != MEAN:
        return LossRewrite(False, f"nll_loss with reduction={a['reduction']} (not a mean or a sum)")
    return _mean_as_sum(gm, loss, loss.target, (a["input"], a["target"], None, SUM, a["ignore_index"]), a["target"],
                        a["ignore_index"], "nll_loss")


def _mean_as_sum(gm: fx.GraphModule, loss: fx.Node, op, args: tuple, target: fx.Node, ignore_index: int,
                 what: str) -> LossRewrite:
    """The mean ``loss`` replaced by its sum over the microbatch, ``op(*args)``, which the runtime divides
    by the global batch's count of non-ignored targets (its count graph); unchanged where the targets'
    count cannot be cut out of the graph."""
    count, inputs = _count_graph(target, ignore_index)
    if count is None:
        return LossRewrite(False, inputs)
    with gm.graph.inserting_after(loss):
        total = gm.graph.call_function(op, args)
    total.meta.update(loss.meta)
    loss.replace_all_uses_with(total)
    gm.graph.erase_node(loss)
    return LossRewrite(True, f"{what} (ignore_index={ignore_index}) as a sum over the microbatch divided by the "
                             "global batch's count of non-ignored targets", count, inputs)


def microbatch_loss_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if ctx.options.pipeline is None:
        return gm
    loss = loss_node(gm, pipelined=ctx.mesh.pp > 1)
    rewrite = LossRewrite(False, "")
    if getattr(loss.target, "overloadpacket", None) is aten.cross_entropy_loss:
        a = cross_entropy_args(loss)
        if a["weight"] is not None:
            rewrite.reason = "cross-entropy with class weights (its mean divides by the targets' total weight)"
        elif a["reduction"] == SUM:   # a sum over the whole batch is the sum of the microbatches' sums
            rewrite = LossRewrite(True, "cross-entropy (reduction='sum'): the microbatches' sums, summed")
        elif a["reduction"] != MEAN:
            rewrite.reason = f"cross-entropy with reduction={a['reduction']} (not a mean or a sum)"
        else:
            rewrite = _mean_as_sum(gm, loss, aten.cross_entropy_loss.default,
                                   (a["logits"], a["target"], None, SUM, a["ignore_index"], a["label_smoothing"]),
                                   a["target"], a["ignore_index"], "cross-entropy")
    elif loss.target in NLL_LOSSES:
        rewrite = _nll_rewrite(gm, loss)
    elif (term := _mean_term(loss)) is not None:
        rewrite = _scaled_term(gm, term, loss)
    elif (divisor := _shared_divisor(loss)) is not None:
        rewrite = LossRewrite(True, f"cross-entropy (reduction='sum') divided by {divisor}, one number for the "
                                    "whole batch (HF's num_items_in_batch): the microbatches' losses, summed")
    else:
        rewrite.reason = (f"the loss is computed by {loss.target} (analysed: a mean cross_entropy_loss or nll_loss "
                          "alone, a cross-entropy plus other terms, or a summed cross-entropy divided by one number "
                          "for the whole batch)")
    gm.graph.eliminate_dead_code()
    gm.recompile()
    gm.meta[LOSS_REWRITE] = rewrite
    pieces = ctx.options.pipeline.microbatches * ctx.mesh.dp
    if not rewrite.exact and pieces > 1 and ctx.rank == 0:   # said once, where the user looks (not only in the dump)
        warn_user(f"autoshard: pm.step combines this loss as the mean of its {pieces} microbatch losses "
                  f"(microbatches x dp), which equals the whole batch's loss only when every microbatch "
                  f"weighs alike in it (as many non-ignored targets; with class weights, the same total "
                  f"weight): {rewrite.reason}")
    return gm
