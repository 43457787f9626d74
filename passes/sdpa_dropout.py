"""SDPA with ``dropout_p`` on a tp shard, spelled out, so its dropout draws the single device's mask.

``scaled_dot_product_attention(q, k, v, dropout_p=p)`` draws its dropout mask inside the op. Sharded over
tp (by heads, or by batch rows), each rank's call draws from the same RNG state over its own heads, so
every rank drops the *same* pattern on different heads, where one device draws one mask over all of them
(HF GPT-2 trains with ``attn_pdrop=0.1`` through SDPA). On a CPU the single device's SDPA with dropout is
ATen's math attention, ``_scaled_dot_product_attention_math``; this pass writes that same computation
out: q and k^T each scaled by the square root of the scale, their product, the mask (``is_causal``'s
lower triangle, a boolean mask as ``-inf`` where false, or a float mask added), ``_safe_softmax``, an
``aten.dropout``, and the product with v. The ``sharded_dropout`` pass that runs next turns that dropout
into the whole tensor's mask, sliced (the single device's draw), so the attention's mask and every later
one equal the single device's (``tests/harness/loop_edge_checks.py:dropout_on_tp_shards``: the built-in GPT
and HF GPT-2 at tp=4). A half or bf16 call is computed in fp32 and cast back, and a negative scale
negates q, as ATen's math attention does.

On CUDA the single device runs a flash or memory-efficient kernel whose mask no decomposition
reproduces, and spelling it out would cost the s x s scores flash never stores; there the call stays
fused and a warning names the consequence. Grouped-query calls (``enable_gqa``) stay fused too.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir.placement import DistSpec, Shard
from autoshard.passes.fusion import _runs_on_cuda
from autoshard.passes.shapes import module_path
from autoshard.passes.sharded_dropout import _even_shard, like_node
from autoshard.ir.errors import warn_user

aten = torch.ops.aten


def _sdpa_args(n: fx.Node) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    out = dict(zip(names, n.args)) | dict(n.kwargs)
    return {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False} | out


def sdpa_dropout_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    t = ctx.mesh.tp
    if t == 1:
        return gm
    g, changed, fused = gm.graph, False, []
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not aten.scaled_dot_product_attention.default:
            continue
        a = _sdpa_args(n)
        q = a["query"]
        spec, shape = M.SPEC.get(q, None), M.GLOBAL_SHAPE.get(q, None)
        if not a["dropout_p"] or spec is None or not isinstance(spec.on("tp"), Shard):
            continue
        dim = _even_shard(spec, shape, t)
        if dim is None or dim >= len(shape) - 2:     # rows or a blocked shard: not written out, said so
            fused.append(module_path(n) or n.name)
            continue
        if a["enable_gqa"] or _runs_on_cuda():
            fused.append(module_path(n) or n.name)
            continue
        _spell_out(g, n, a, dim)
        changed = True
    if fused:       # one warning a program, naming the modules
        why = "on CUDA, SDPA's fused kernels" if _runs_on_cuda() else "grouped-query SDPA, or a shard of rows"
        shown = ", ".join(f"'{m}'" for m in fused[:4]) + (f" and {len(fused) - 4} more" if len(fused) > 4 else "")
        warn_user(f"autoshard: the attention in {shown} ({why}) drops out attention probabilities on a tp shard "
                  "inside the op: each tp rank draws the same mask over its own heads, not one device's mask "
                  "over all of them (statistically correlated across ranks). Set the attention dropout to 0 (HF: "
                  "attn_pdrop / attention_dropout) or use eager attention to train with the single device's "
                  "masks")
    if changed:
        g.lint()
        gm.recompile()
    return gm


def _spell_out(g: fx.Graph, n: fx.Node, a: dict, dim: int) -> None:
    """Replace SDPA node ``n`` by ATen's math attention with an explicit ``aten.dropout``."""
    q, k, v = a["query"], a["key"], a["value"]
    spec = M.SPEC.get(q)
    qg, kg = M.GLOBAL_SHAPE.get(q), M.GLOBAL_SHAPE.get(k)
    ql, kl = M.LOCAL_SHAPE.get(q), M.LOCAL_SHAPE.get(k)
    scores_g, scores_l = tuple(qg[:-1]) + (kg[-2],), tuple(ql[:-1]) + (kl[-2],)
    like = q.meta.get("val")
    given = like.dtype if isinstance(like, torch.Tensor) else torch.float32
    # ATen's math attention computes a half or bf16 call in fp32 and casts the result back
    dtype = torch.float32 if given in (torch.float16, torch.bfloat16) else given
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(qg[-1])
    root = math.sqrt(abs(scale))          # a negative scale: the root of its size, q negated (as ATen)
    grad = M.REQUIRES_GRAD.get(n, True)

    def add(target, args, glob, loc, node_spec=spec, requires_grad=grad, kind=dtype, kwargs=None):
        return like_node(g.call_function(target, args, kwargs), n, node_spec, glob, loc, requires_grad, kind)

    whole = DistSpec()        # the causal mask: every rank's whole
    with g.inserting_before(n):
        if dtype != given:
            q, k, v = (add(aten._to_copy.default, (x,), M.GLOBAL_SHAPE.get(x), M.LOCAL_SHAPE.get(x), M.SPEC.get(x),
                           kwargs={"dtype": dtype}) for x in (q, k, v))
        qs = add(aten.mul.Tensor, (q, root if scale >= 0 else -root), qg, ql)
        kt = add(aten.transpose.int, (k, -2, -1), kg[:-2] + (kg[-1], kg[-2]), kl[:-2] + (kl[-1], kl[-2]))
        ks = add(aten.mul.Tensor, (kt, root), kg[:-2] + (kg[-1], kg[-2]), kl[:-2] + (kl[-1], kl[-2]))
        scores = add(aten.matmul.default, (qs, ks), scores_g, scores_l)
        mask = a["attn_mask"]
        if a["is_causal"]:
            square = (qg[-2], kg[-2])
            ones = add(aten.ones.default, (list(square),), square, square, whole, False, torch.bool,
                       kwargs={"dtype": torch.bool, "device": torch.device("cpu")})    # on CUDA the call stays fused
            mask = add(aten.tril.default, (ones,), square, square, whole, False, torch.bool)
        if mask is not None:
            mval = mask.meta.get("val")
            if isinstance(mval, torch.Tensor) and mval.dtype == torch.bool:     # ATen: -inf where false
                loc = M.LOCAL_SHAPE.get(mask, tuple(mval.shape))
                hidden = add(aten.logical_not.default, (mask,), M.GLOBAL_SHAPE.get(mask, loc), loc,
                             M.SPEC.get(mask, whole), False, torch.bool)
                scores = add(aten.masked_fill.Scalar, (scores, hidden, float("-inf")), scores_g, scores_l)
            else:           # a float mask adds in the scores' dtype (fp32 under a half call, as ATen)
                scores = add(aten.add.Tensor, (scores, mask), scores_g, scores_l)
        probs = add(aten._safe_softmax.default, (scores, -1), scores_g, scores_l)
        dropped = add(aten.dropout.default, (probs, float(a["dropout_p"]), True), scores_g, scores_l)
        out = add(aten.matmul.default, (dropped, v), M.GLOBAL_SHAPE.get(n), M.LOCAL_SHAPE.get(n), M.SPEC.get(n))
        if dtype != given:
            out = add(aten._to_copy.default, (out,), M.GLOBAL_SHAPE.get(n), M.LOCAL_SHAPE.get(n), M.SPEC.get(n),
                      kind=given, kwargs={"dtype": given})
    n.replace_all_uses_with(out)
    g.erase_node(n)
