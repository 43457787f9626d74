"""``chunk_loss``: the LM head and its cross-entropy as one op chunked over tokens, when nothing else reads
the logits (``loss_only``, and every ``pm.step`` program).

The pattern is the head's matmul (``ColumnParallelMatmul`` at tp > 1; ``linear`` at tp = 1, or at tp > 1
with ``overlap_grad_allreduce`` disabled; with or without a bias, weight stored ``(out, in)``), read by nothing but views
and a cast to fp32, and any scale or tanh soft cap of the logits (applied per chunk), then the cross-entropy (``VocabParallelCrossEntropy`` at tp > 1, ``cross_entropy_loss``
at tp = 1) with mean or sum reduction, any ``ignore_index`` and label smoothing, no class weights. It
becomes one ``VocabParallelLinearCrossEntropy`` record (at tp = 1 too, where its collectives are the
identity): the ``[rows, V/t]`` logits never exist whole. ``reduction='none'`` is left alone (its per-row
losses are an output as large as the rows anyway, and nothing in a training step asks for it).

The input gradient of a column-parallel head is a partial sum over vocab shards. A ``ColumnParallelMatmul``
all-reduces it in its backward, so the record does it instead (``reduce_input_grad``); a plain ``linear``
at tp > 1 is fed by an ``f`` node that stays in the graph and does it, so the record must not.

What was rewritten, or why not, is a ``ChunkedLoss`` record in ``gm.meta`` that ``plan.md`` prints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir import ops
from autoshard.passes.fusion import _runs_on_cuda, fusion_enabled
from autoshard.passes.rules_vocab import cross_entropy_args

aten = torch.ops.aten
CHUNKED_LOSS = M.CHUNKED_LOSS
_PASS_THROUGH = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten._to_copy.default,
                 aten.to.dtype, aten.clone.default}


AUTO_MIN_LOGITS_BYTES = 64 * 2**20   # "auto" leaves smaller logits whole: chunking them saves little, costs calls


# On a GPU each chunk costs the host its ~15 launches and their Python whatever its size (0.3-0.55 ms a
# chunk, cProfile on an H100's host), and its three GEMMs must outlast that or the GPU waits on the host.
# One H100, the built-in GPT at h=1024, 8 layers, 8192 rows, V=32000, bf16, one call: the step took 58.4 ms
# at Liger's 256 rows (32 chunks), 39.5 at 1024, 37.6 at 2048 (+0.24 GiB peak) and 34.7 unchunked (+2.7
# GiB). So on CUDA "auto" gives a chunk at least this much GEMM work (~0.4 ms at an H100's 700 TFLOP/s) ...
GPU_MIN_CHUNK_FLOPS = 3e11
GPU_MAX_CHUNK_BYTES = 512 * 2**20    # ... but never fp32 logits over this for one chunk


def default_chunk(rows: int, local_vocab: int, hidden: int, floor: int = 256, gpu: bool = False) -> int:
    """Liger's rule (rows / ceil(V / H), to a power of two: a chunk's logits about the size of the
    hidden states), never below ``floor`` rows so each matmul stays large, and at most ``rows``. On a GPU
    (``gpu``), also at least ``GPU_MIN_CHUNK_FLOPS`` of GEMM a chunk (6 V H flops a row: the logits, then
    the input's and the weight's gradients), within ``GPU_MAX_CHUNK_BYTES`` of fp32 logits."""
    parts = max(1, -(-local_vocab // hidden))
    chunk = _pow2_at_least(-(-rows // parts))
    if gpu:
        busy = _pow2_at_least(math.ceil(GPU_MIN_CHUNK_FLOPS / (6 * local_vocab * hidden)))
        cap = 1 << max(0, (GPU_MAX_CHUNK_BYTES // (4 * local_vocab)).bit_length() - 1)
        chunk = min(max(chunk, busy), cap)
    return min(rows, max(floor, chunk))


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class ChunkedLoss:
    """One rewritten loss, or why a loss was left as it was."""
    node: str
    rewritten: bool
    why: str = ""
    rows: int = 0
    local_vocab: int = 0
    chunk: int = 0
    logits_bytes: int = 0          # the unchunked [rows, V/t] fp32 logits
    chunk_bytes: int = 0           # one chunk's
    label_smoothing: float = 0.0
    reduces_input_grad: bool = False   # the op all-reduces the head input's gradient (the fused f's job)
    epilogue: tuple = ()               # pointwise steps between the head and the loss, applied per chunk

    @property
    def chunks(self) -> int:
        return -(-self.rows // self.chunk) if self.chunk else 0


@dataclass
class ChunkedLossReport:
    """``gm.meta[CHUNKED_LOSS]``: one ``ChunkedLoss`` per cross-entropy the pass looked at."""
    losses: list[ChunkedLoss] = field(default_factory=list)


def _loss_args(gm, n) -> dict | None:
    """The arguments of a cross-entropy node, and ``size``: the tp ranks its vocab is split over (1 for
    ``aten.cross_entropy_loss``, which sees whole rows of logits even at tp > 1)."""
    if n.op == "call_module":
        op = gm.get_submodule(n.target)
        if isinstance(op, ops.VocabParallelCrossEntropy):
            return dict(logits=n.args[0], target=n.args[1], ignore_index=op.ignore_index, reduction=op.reduction,
                        start=op.start, valid=op.valid, smoothing=op.label_smoothing, vocab=op.vocab, weight=None,
                        size=op.size)
    if n.op == "call_function" and n.target is aten.cross_entropy_loss.default:
        a = cross_entropy_args(n)
        return dict(logits=a["logits"], target=a["target"], ignore_index=a["ignore_index"],
                    reduction=a["reduction"], start=0, valid=None, smoothing=a["label_smoothing"], vocab=None,
                    weight=a["weight"], size=1)   # whole rows of logits on this rank: no collective
    return None


def _epilogue_step(n: fx.Node):
    """``(kind, constant)`` when ``n`` is a pointwise op on the logits that the chunked loss can apply per
    chunk: a scale (Cohere's ``logit_scale``, Granite's ``logits_scaling``) or the tanh of a soft cap
    (Gemma 2's ``final_logit_softcapping``: ``cap * tanh(logits / cap)``); else None."""
    if n.op != "call_function" or not n.args:
        return None
    if n.target is aten.tanh.default:
        return ("tanh", None)
    if n.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar) and len(n.args) == 2 \
            and not n.kwargs and isinstance(n.args[1], (int, float)) and not isinstance(n.args[1], bool):
        return ("mul" if n.target in (aten.mul.Tensor, aten.mul.Scalar) else "div", float(n.args[1]))
    return None


def _head(gm, logits: fx.Node) -> tuple:
    """Walk back from the loss's logits through views, casts and epilogue ops (``_epilogue_step``) read by
    nothing else: ``(matmul node, chain, epilogue in program order, why not)``; the matmul is None where
    the pattern does not hold."""
    chain, epilogue, cur = [], [], logits
    while cur.op == "call_function" and len(cur.users) == 1 and \
            (cur.target in _PASS_THROUGH or _epilogue_step(cur) is not None):
        step = _epilogue_step(cur)
        if step is not None:
            epilogue.insert(0, step)
        chain.append(cur)
        cur = cur.args[0]
    what = f"{cur.op} {getattr(cur.target, '__name__', cur.target)}"
    if len(cur.users) != 1:
        return None, chain, (), (f"the logits ({cur.name}) are read by more than the loss (returned, or used "
                                 "twice)")
    if cur.op == "call_module" and isinstance(gm.get_submodule(cur.target), ops.ColumnParallelMatmul):
        if gm.get_submodule(cur.target).transposed:
            return None, chain, (), "the LM head stores its weight (in, out) (HF Conv1D): not chunked"
        return cur, chain, tuple(epilogue), ""
    if cur.op == "call_function" and cur.target is aten.linear.default:
        return cur, chain, tuple(epilogue), ""
    return None, chain, (), (f"the loss's logits come from {what}, not from a linear LM head through views, "
                             "casts, scales and a tanh soft cap alone")


def _loss_kernels(options) -> bool:
    """Whether each chunk's loss runs as ``kernels/cross_entropy.py``'s Triton kernels: with ``fuse=True``
    only (and where fusion runs). ``"auto"`` keeps the composed ops until a GPU has timed the two
    (``benchmarks.chunked_loss --kernel``, in ``make gpu-session``)."""
    return options.fuse is True and fusion_enabled(options)[0]


def _chunking(rows: int, local_vocab: int, hidden: int, chunk_rows) -> tuple:
    """``(rows a chunk, why the loss stays whole or "")`` for ``loss_chunk_rows=chunk_rows``."""
    chunk = default_chunk(rows, local_vocab, hidden, gpu=_runs_on_cuda()) if chunk_rows == "auto" \
        else min(int(chunk_rows), rows)
    logits_bytes = rows * local_vocab * 4
    if chunk_rows == "auto" and logits_bytes < AUTO_MIN_LOGITS_BYTES:
        return chunk, (f"the logits are {logits_bytes / 2**20:.1f} MiB, under the "
                       f"{AUTO_MIN_LOGITS_BYTES // 2**20} MiB that loss_chunk_rows='auto' chunks")
    if chunk >= rows:
        return chunk, f"{rows} rows fit in one chunk of {chunk}: nothing to gain"
    return chunk, ""


def heads_with_the_loss(gm: fx.GraphModule, chunk_rows, tp: int) -> set:
    """The LM head matmuls this pass will fold into their chunked loss, which then computes their weight
    gradient with the loss: in a split schedule's B, not W. Asked before the pass runs (the stage
    balancer prices B and W), on the captured graph's global shapes, the vocab split over ``tp``."""
    if not chunk_rows:
        return set()
    heads = set()
    for n in gm.graph.nodes:
        a = _loss_args(gm, n)
        head = _foldable(gm, a)[0] if a is not None else None
        if head is None:
            continue
        logits, weight = a["logits"].meta.get("val"), head.args[1].meta.get("val")
        if weight is None or logits is None or weight.dim() != 2:
            continue
        vocab = logits.shape[-1]
        if not _chunking(logits.numel() // max(vocab, 1), -(-vocab // tp), weight.shape[1], chunk_rows)[1]:
            heads.add(head)
    return heads


def _foldable(gm, a) -> tuple:
    """``_head``'s ``(head, chain, epilogue, why not)`` for a loss the pass can fold its LM head into."""
    if a["weight"] is not None:
        return None, (), (), "class weights: the unchunked loss handles them"
    if a["reduction"] not in (1, 2):
        return None, (), (), "reduction='none': per-row losses are returned whole"
    return _head(gm, a["logits"])


def _rewrite(gm, n, a, chunk_rows, kernel: bool = False) -> ChunkedLoss:
    head, chain, epilogue, why = _foldable(gm, a)
    if head is None:
        return ChunkedLoss(n.name, False, why)
    h, weight = head.args[0], head.args[1]
    bias = head.args[2] if len(head.args) > 2 else None
    rows, local_vocab = M.LOCAL_SHAPE.get(a["logits"])
    hidden = M.LOCAL_SHAPE.get(weight)[1]
    if math.prod(M.LOCAL_SHAPE.get(h)) != rows * hidden:
        return ChunkedLoss(n.name, False, "the head's input is not the loss's rows")
    chunk, why = _chunking(rows, local_vocab, hidden, chunk_rows)
    record = ChunkedLoss(n.name, False, why, rows, local_vocab, chunk, rows * local_vocab * 4, chunk * local_vocab * 4)
    if why:
        return record
    # the head's f: fused into a ColumnParallelMatmul, its all-reduce of the input gradient moves into the
    # chunked op; a plain linear at tp > 1 (overlap_grad_allreduce disabled) keeps its f node, which does it
    fused_f = head.op == "call_module" and a["size"] > 1 and M.REQUIRES_GRAD.get(h, True)
    vocab = a["vocab"] if a["vocab"] is not None else local_vocab      # tp = 1: the logits' own width
    val = n.meta.get("val")
    with gm.graph.inserting_before(n):
        h2 = gm.graph.call_function(aten.reshape.default, (h, [rows, hidden]))
        valid = a["valid"] if a["valid"] is not None else local_vocab
        op = ops.VocabParallelLinearCrossEntropy(
            "tp", a["size"], rows, hidden, a["start"], valid, a["ignore_index"], a["reduction"], chunk,
            label_smoothing=a["smoothing"], vocab=vocab, reduce_input_grad=fused_f, epilogue=epilogue,
            out_dtype=val.dtype if isinstance(val, torch.Tensor) else None,
            kernel=kernel)
        name = f"chunked_cross_entropy_{sum(1 for _ in gm.named_children())}"
        gm.add_submodule(name, op)
        new = gm.graph.call_module(name, (h2, weight, a["target"]) + ((bias,) if bias is not None else ()))
    M.LOCAL_SHAPE.set(h2, (rows, hidden))
    M.GLOBAL_SHAPE.set(h2, (rows, hidden))            # replicated on tp: the local shape is the global one
    for key in (M.SPEC, M.REQUIRES_GRAD):
        if key.has(h):
            key.set(h2, key.get(h))
    for key in (M.LOCAL_SHAPE, M.GLOBAL_SHAPE, M.SPEC, M.REQUIRES_GRAD):
        if key.has(n):
            key.set(new, key.get(n))
    new.meta["val"] = val
    n.replace_all_uses_with(new)
    for dead in [n] + chain + [head]:
        gm.graph.erase_node(dead)
    record.rewritten = True
    record.label_smoothing = float(a["smoothing"] or 0.0)
    record.reduces_input_grad = fused_f
    record.epilogue = epilogue
    return record


def chunk_loss_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    chunk_rows = ctx.options.loss_chunk_rows
    report = ChunkedLossReport()
    gm.meta[CHUNKED_LOSS] = report
    if not chunk_rows:
        return gm
    for n in list(gm.graph.nodes):
        a = _loss_args(gm, n)
        if a is not None:
            report.losses.append(_rewrite(gm, n, a, chunk_rows, _loss_kernels(ctx.options)))
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm
