"""The step time and memory of one configuration, from the model's sizes and the cluster's numbers.

A configuration is Megatron-LM's (SC'21) tuple: tensor size t, pipeline size p, data-parallel size d,
microbatch size b, microbatches per step m, virtual stages v, recompute and ZeRO. Ranks are laid out as
``init_mesh`` builds its (dp, pp, tp) mesh: t varies fastest, then p, then d. A tp group of at most a
node's GPUs stays on NVLink; a pp group (t ranks apart) crosses nodes once t x p outgrows a node, and a
dp group (t x p ranks apart) as soon as the replicas do not share a node. No rule of
the paper is written here: its takeaways come out of these costs (``tests/unit/test_planner.py``).

Per microbatch of b sequences on one pipeline chunk (L / (p v) layers):

- compute: each GEMM at the cluster's efficiency for its shape (sharded t ways), backward twice the
  forward; memory-bound ops (norms, pointwise, softmax) at HBM bandwidth;
- tensor parallelism: two all-reduces of the residual stream (b s h) per layer forward, two backward,
  two more when the forward is recomputed, on the tp group's link; exposed, unless the runtime pipelines
  them under their GEMMs (``Runtime.tp_overlap``: Megatron Core's, under SP);
  the first rank adds the vocab-parallel embedding's all-reduce, the last the LM head's input gradient's
  and the loss's two small ones;
- the pipeline: ``(m + (p - 1) / v)`` chunk-rounds of the slowest rank, so the bubble is
  ``(p - 1) / (v m)`` of the ideal; under ZB-H1 each backward is split and its weight gradients (the
  layers' weight GEMMs again) fill the bubble: ``(p - 1)(T_F + T_B - T_W)``, Qi et al.'s (a third of
  1F1B's where the layers are all GEMMs, without recompute or tp collectives; more otherwise); each
  boundary a send forward and one backward, exposed;
- data parallelism: the gradients' ring all-reduce (fp32 main grads) on the dp group's link, less the
  part hidden behind the last microbatch's backward (as ``runtime/data_parallel.py`` overlaps it);
  ZeRO-1 adds the parameters' all-gather after the optimizer step and divides the optimizer's work.
  A ``Runtime`` that reduce-scatters under ZeRO-1, gathers beside the next forward, or pipelines its tp
  collectives under the GEMMs (Megatron Core's) hides more; whatever hides still takes
  ``Cluster.comm_compute_share`` of its time from the compute beside it (``_exposed``).

On a CPU host the measured cluster adds three facts a GPU cluster does not have: transcendental
elements (GeLU's erf, softmax's exp) cost a measured rate, not only their bytes; ranks that share cores
(``Cluster.oversubscription``) lend a core when idle, so a pipeline's step is the longer of the host's
whole work and the critical path at the unshared rate (``_shared_cores``); and the gradient all-reduce
hides behind nothing, its thread competing for the same cores.

Memory per rank: bf16 weights, fp32 gradients and fp32 master weights with Adam's two moments (18 bytes
a parameter, the 12 of the optimizer divided by d under ZeRO-1), plus the activations in flight: the
first rank of 1F1B holds p microbatches of its layers, of the interleaved schedule more (its warm-up).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from autoshard.ir.options import boundary_transfer, scatter_gather_pays

from autoshard.planner.cluster import Cluster
from autoshard.planner.runtimes import AUTOSHARD, Runtime
from autoshard.planner.shape import ModelShape

BF16, FP32 = 2, 4
OPS_PER_LAYER = 30        # ops a transformer layer's forward launches (norms, projections, attention, MLP, adds)
OPS_HEAD = 12             # the LM head and the loss's
TENSORS_PER_LAYER = 12    # parameter tensors of a layer (weights, biases, norms): the optimizer's ops go per tensor
NORM_TENSORS = 6          # under SP, a layer's norm weights and biases and its two row-parallel biases meet
                          # the sequence shard: their tp shares are summed once a step
OPS_PER_TENSOR = 15       # a foreach AdamW's ops per parameter tensor (on a host that pays per op)


@dataclass(frozen=True)
class Candidate:
    """One configuration to price (Megatron-LM's names)."""
    dp: int
    pp: int
    tp: int
    b: int                    # microbatch size (sequences)
    m: int                    # microbatches per step on each dp replica
    v: int = 1                # virtual stages (chunks) per pipeline rank: 1 is plain 1F1B
    recompute: str = "none"   # "none", "selective" (attention cores run again) or "full" (whole layers)
    zero: int = 0             # 1: the optimizer state sharded over dp (ZeRO-1)
    sp: bool | str = False    # sequence parallelism: the stream sharded along the sequence over tp
                              # ("regather": the column-parallel inputs kept as shards, gathered again)
    zb: bool = False          # ZB-H1 (v = 1, p > 1): each backward split into B and W, W filling 1F1B's
                              # bubbles (Qi et al., ICLR 2024), at 1F1B's activation memory

    def __post_init__(self):
        if self.zb and (self.pp == 1 or self.v != 1):
            raise ValueError(f"ZB-H1 needs a pipeline of one chunk a rank: pp={self.pp}, v={self.v}")

    @property
    def gpus(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def schedule(self) -> str:
        if self.zb:
            return "zb-h1"
        return "1f1b" if self.pp == 1 or self.v == 1 else "interleaved"

    @property
    def global_batch(self) -> int:
        return self.dp * self.b * self.m


@dataclass(frozen=True)
class Breakdown:
    """Seconds of one step on the slowest rank, by cause (they add up to ``total``)."""
    compute: float            # forward and backward of every microbatch, without recompute
    recompute: float          # the forwards run again in backward
    tp_comm: float            # exposed tensor-parallel collectives
    bubble: float             # the pipeline's idle time: (p - 1) / v chunk-rounds (less ZB-H1's W)
    p2p: float                # pipeline boundary sends, exposed
    dp_comm: float            # data-parallel gradient collectives not hidden behind backward
    optimizer: float          # the optimizer step (memory-bound)

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.bubble + self.p2p + self.dp_comm
                + self.optimizer)

    def items(self) -> list:
        return [("compute", self.compute), ("recompute", self.recompute), ("tp communication", self.tp_comm),
                ("pipeline bubble", self.bubble), ("pipeline sends", self.p2p),
                ("dp communication", self.dp_comm), ("optimizer", self.optimizer)]


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds at its peak (the most loaded rank: the first stage, or the last with the head)."""
    parameters: float         # bf16 weights
    gradients: float          # fp32 main gradients
    optimizer: float          # fp32 master weights and Adam's two moments (divided by dp under ZeRO-1)
    activations: float        # saved for backward, over the microbatches in flight

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    step_seconds: float
    breakdown: Breakdown
    memory: Memory
    model_flops: float                  # of one step, without recompute
    notes: tuple = field(default_factory=tuple)

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (recompute not counted: the MFU numerator)."""
        return self.model_flops / self.step_seconds / self.candidate.gpus / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        """TFLOP/s per GPU counting the recomputed forwards too (Megatron-LM's paper reports this one)."""
        extra = self.model_flops / 3 * (1 if self.candidate.recompute == "full" else 0)   # selective: a few %, not counted
        return (self.model_flops + extra) / self.step_seconds / self.candidate.gpus / 1e12


def ring_all_reduce_seconds(nbytes: float, n: int, link) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` ranks: ``2(n-1)/n * bytes / bandwidth``, plus a latency
    per ring step (2(n-1) of them)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """The pipeline bubble over the ideal time: ``(p - 1) / (v m)`` (Narayanan et al., SC'21)."""
    return (p - 1) / (v * m)


def in_flight(p: int, m: int, v: int, rank: int = 0) -> int:
    """Chunk-microbatches whose activations pipeline rank ``rank`` holds at once: p - rank for 1F1B (at
    most m), and the interleaved schedule's warm-up ``2 (p - rank - 1) + (v - 1) p + 1`` (Megatron's)."""
    if p == 1:
        return 1
    if v == 1:
        return min(m, p - rank)
    return min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1)


def activation_bytes_per_layer(shape: ModelShape, b: int, t: int, recompute: str, flash: bool = True,
                               sp: bool = False) -> float:
    """Bytes one layer saves for backward for one microbatch (Korthikanti et al. 2022, 16-bit
    activations): ``s b h (10 + 24/t + 5 a s / (h t))``, without the attention matrix's term when the
    attention is flash (it keeps no s x s matrix) or its core runs again (selective recompute), and only
    the layer's input (2 s b h) under full recompute. Sequence parallelism shards the replicated 10 too:
    ``(s b h / t)(34 + 5 a s / h)``, except that autoshard keeps the two column-parallel inputs (the
    gathered norm outputs, 2 s b h bytes each) whole for the weight gradient: ``4 s b h (1 - 1/t)`` more,
    unless ``sp="regather"`` keeps their shards and gathers them again in backward, as Megatron does."""
    s, h, a = shape.seq, shape.hidden, shape.heads
    if recompute == "full":
        return 2.0 * s * b * h / (t if sp else 1)
    ffn_scale = shape.active_ffn * (3 if shape.gated else 2) / (8 * h)     # 1 for GPT's 4h two-matrix MLP
    # q and the attention's output are q_width wide, k and v kv_width: 1 where both are h (GPT's); a
    # grouped-query layer keeps less, Gemma's wider heads (q 4096 on h 3072) more
    attention_scale = (shape.q_width + shape.kv_width) / (2 * h) if shape.attention else 0.0
    # another token mixer keeps each matrix's input that is not the stream, and its scan's input (2 bytes
    # an element, split t ways): an estimate from its sizes, as the paper has no term for it
    mixer_scale = 0.0
    if shape.mixer is not None:
        kept = sum(g.inner for g in shape.mixer.gemms if g.inner != h) + shape.mixer.state_width
        mixer_scale = kept / (6 * h)
    # the stream's share (10 for GPT's two blocks: their norms' inputs, dropout masks and matmul inputs)
    per_token = 5 * shape.blocks / (t if sp else 1) + 12 / t * (attention_scale + ffn_scale + mixer_scale)
    if sp and t > 1 and sp != "regather":
        per_token += 2 * shape.blocks * (1 - 1 / t)
    if not flash and recompute != "selective" and shape.attention:
        per_token += 5 * a * s / (h * t)
    return s * b * h * per_token


def predict(shape: ModelShape, cluster: Cluster, c: Candidate, flash: bool = True,
            runtime: Runtime = AUTOSHARD) -> Prediction:
    """The step time and memory of ``c`` training ``shape`` on ``cluster``, run by ``runtime``."""
    t, p, b, m, v = c.tp, c.pp, c.b, c.m, c.v
    s, h = shape.seq, shape.hidden
    tokens = b * s
    # the GEMMs a layer's tp collectives can run beside, where the runtime pipelines them: its weight
    # GEMMs forward and twice in backward (and again when recomputed). A bound: userbuffers pairs each
    # collective with the one GEMM beside it, so at a small h or a large t (the attention output's
    # GEMM the tightest pair) less may hide
    overlap = (4 if c.recompute == "full" else 3) if runtime.tp_overlap and c.sp else 0
    layers = _busiest_stage(shape, cluster, c, tokens, flash, overlap)
    head_f = _with_host(cluster, cluster.gemm_seconds(tokens, shape.vocab / t, h)
                        + _pointwise(cluster, 3 * tokens * shape.vocab / t * FP32), OPS_HEAD)
    last_extra = 3 * head_f                      # the LM head and the loss, forward and backward, last rank
    per_micro = 3 * layers.forward + (last_extra if p == 1 else 0)
    per_micro_last = 3 * layers.forward + last_extra
    embedding, loss = _vocab_parallel_seconds(shape, cluster, c, tokens)
    # (compute, tp collectives) of a microbatch on the first, a middle and the last rank: the first adds
    # the embedding's collective, the last its loss's; the slowest of them paces the pipeline
    tp = layers.tp
    stages = ([(per_micro, tp + embedding + loss)] if p == 1 else
              [(per_micro, tp + embedding), (per_micro, tp), (per_micro_last, tp + loss)])
    slowest, tp = max(stages, key=sum)
    recompute = layers.recompute
    round_time = slowest + recompute + tp        # one microbatch through this rank, all its chunks
    # a round's part that the pipeline's fill and drain leave idle: all of it under 1F1B and the
    # interleaved schedule; under ZB-H1 the weight gradients W (the layers' weight GEMMs again; the LM
    # head's dW stays in B, where the chunked loss computes it) fill the bubble, which leaves the paper's
    # (p - 1)(T_F + T_B - T_W). Not where ranks share cores: an idle rank lends its core already, and
    # on this 2-core host ZB-H1 measured 1F1B's step (68.3 against 68.2 ms at pp=4, m=4)
    w = layers.weight_gemms
    credit = c.zb and cluster.oversubscription <= 1
    idle_round = round_time - (2 * w if credit else 0.0)
    compute = m * slowest
    bubble = (p - 1) / v * idle_round
    if p > 1 and cluster.oversubscription > 1:
        compute, bubble = _shared_cores(cluster, m, p, v, slowest, (per_micro * (p - 1) + per_micro_last) / p,
                                        recompute + tp, idle_round)
    p2p = 2 * _send_seconds(shape, cluster, c, tokens) * (m * v + p - 1) if p > 1 else 0.0
    if runtime.p2p_overlap and v > 1:
        p2p = _exposed(cluster, p2p, compute)
    # the dp buckets launch during the last backward (B and W, 1F1B's), or after the last W (ZB-H1)
    overlap = (w if c.zb else 2.0 / 3.0 * round_time / v) if runtime.dp_overlap else 0.0
    # ZeRO-1's parameter all-gather, where the runtime overlaps it, beside the next step's first forward:
    # one microbatch through the first chunk (under the interleaved schedule, a lower bound: its warm-up
    # runs p forwards of chunk 1 before chunk 2 needs its parameters)
    first_forward = layers.forward / v if runtime.param_gather_overlap else 0.0
    dp_comm, optimizer = _data_parallel(shape, cluster, c, overlap, runtime, first_forward)
    # SP: the norms' weight and bias gradients are each tp rank's share, summed after the step's
    # backward in one all-reduce (ir/partial_grads), exposed
    norms = ring_all_reduce_seconds(FP32 * h * NORM_TENSORS * layers.count, t, cluster.link(t, 1, c.gpus)) if c.sp else 0.0
    breakdown = Breakdown(compute, m * recompute, m * tp + norms, bubble, p2p, dp_comm, optimizer)
    return Prediction(c, breakdown.total, breakdown, _memory(shape, cluster, c, flash),
                      shape.model_flops(c.global_batch * s))


def _send_seconds(shape: ModelShape, cluster: Cluster, c: Candidate, tokens: float) -> float:
    """One microbatch's boundary (or its gradient) sent to the next pipeline rank, exposed. Under SP it is
    a sequence shard, 1/t of the bytes. Without, it is whole on every tp rank: where the runtime scatters
    it (``scatter_gather_pays(cluster.backend)``: NCCL) each tp rank sends 1/t and the receivers
    all-gather over tp (Megatron's scatter/gather, SC'21 section 4.1), else each sends all of it."""
    link, tp_link = cluster.link(c.pp, c.tp, c.gpus), cluster.link(c.tp, 1, c.gpus)
    send = boundary_transfer(c.tp, c.sp, scatter_gather_pays(cluster.backend), link.bandwidth, link.latency,
                             tp_link.bandwidth, tp_link.latency)
    return send.seconds(BF16 * tokens * shape.hidden)


def _vocab_parallel_seconds(shape: ModelShape, cluster: Cluster, c: Candidate, tokens: float) -> tuple:
    """(first rank, last rank) seconds a microbatch spends in the tp collectives at the two ends of the
    model, outside its layers. The first rank's vocab-parallel embedding sums its output over tp: an
    all-reduce of the stream (under SP a reduce-scatter, whose backward all-gathers: the same bytes). The
    last rank's LM head is column-parallel: its input's gradient is summed in backward (under SP its
    input is gathered forward and the gradient reduce-scattered back), and the loss adds two
    all-reduces of a few floats a token (the logits' row max, then the exp-sums and the target's logit;
    ``runtime/losses.py``), latency-bound: nothing on NVLink, a few ms a step on a CPU host's gloo."""
    if c.tp == 1:
        return 0.0, 0.0
    link = cluster.link(c.tp, 1, c.gpus)
    stream = ring_all_reduce_seconds(BF16 * tokens * shape.hidden, c.tp, link)
    loss = ring_all_reduce_seconds(FP32 * tokens, c.tp, link) + ring_all_reduce_seconds(2 * FP32 * tokens, c.tp, link)
    return stream, stream + loss


def _shared_cores(cluster: Cluster, m: int, p: int, v: int, slowest: float, mean: float, extra: float,
                  idle_round: float) -> tuple:
    """(compute, bubble) of a pipeline whose ranks share cores (``cluster.oversubscription`` ranks a
    core, each measured rate a rank's share). A rank idle in the bubble lends its core, so the step is
    the longer of two bounds: the host's whole work at the shared rate (``m`` rounds of the mean rank),
    and the critical path at the unshared rate: ``m`` rounds of the slowest rank and ``(p - 1) / v`` of
    the part of a round the fill and drain leave idle (``idle_round``: all of it but ZB-H1's W). Compute
    is then the mean rank's; the bubble is what the critical path adds over the host's work (the stages'
    imbalance included)."""
    busy = m * (mean + extra)
    critical = (m * (slowest + extra) + (p - 1) / v * idle_round) / cluster.oversubscription
    return m * mean, max(0.0, critical - busy)


def _with_host(cluster: Cluster, device: float, ops: float) -> float:
    """Seconds of work taking ``device`` seconds of compute in ``ops`` ops: the host's overhead added
    where one processor does both, the longer of the two where the host launches ahead (a GPU)."""
    host = ops * cluster.op_overhead
    return max(device, host) if cluster.launch_ahead else device + host


def _pointwise(cluster: Cluster, nbytes: float) -> float:
    return nbytes / cluster.hbm_bandwidth


@dataclass(frozen=True)
class LayerSeconds:
    """Seconds of layers for one microbatch: of one layer (``_layer_seconds``), or of a stage's
    (``_busiest_stage``, with ``count`` layers)."""
    forward: float
    recompute: float          # the part of forward run again in backward
    tp: float                 # the tp collectives over forward, backward and recompute (a stage's: exposed)
    weight_gemms: float       # the weight GEMMs' forward: as long as their weight gradients, W, which a
                              # zero-bubble schedule defers
    count: int = 1


def _busiest_stage(shape: ModelShape, cluster: Cluster, c: Candidate, tokens: float, flash: bool,
                   overlap: int) -> LayerSeconds:
    """The layers of the pipeline stage that takes longest a microbatch, when ``c.pp`` stages cut the
    stack evenly: ceil(layers / pp) alike layers, or the costliest mix of the model's layer kinds (an MoE
    model's dense layers, a hybrid's mixer layers: ``ModelShape.stage_mixes``). Its tp collectives are the exposed part: each layer's beside
    ``overlap`` times its weight GEMMs (0: the runtime does not pipeline them)."""
    kinds = []
    for kind, _ in shape.layer_kinds():
        one = _layer_seconds(kind, cluster, c, tokens, flash)
        kinds.append(LayerSeconds(one.forward, one.recompute, _exposed(cluster, one.tp, overlap * one.weight_gemms),
                                  one.weight_gemms))
    mixes = shape.stage_mixes(c.pp)
    if len(kinds) == 1:
        k, (n,) = kinds[0], mixes[0]
        return LayerSeconds(n * k.forward, n * k.recompute, n * k.tp, n * k.weight_gemms, count=n)

    def total(mix):
        return LayerSeconds(*(sum(n * getattr(k, f) for n, k in zip(mix, kinds))
                              for f in ("forward", "recompute", "tp", "weight_gemms")), count=sum(mix))
    return max((total(mix) for mix in mixes), key=lambda x: 3 * x.forward + x.recompute + x.tp)


def _layer_seconds(shape: ModelShape, cluster: Cluster, c: Candidate, tokens: float, flash: bool) -> LayerSeconds:
    """One layer of ``shape`` (a uniform one: a kind of ``ModelShape.layer_kinds``) for one microbatch:
    its softmax attention, other token mixer and MLP, those it has (``ModelShape.blocks``)."""
    t, h, s = c.tp, shape.hidden, shape.seq
    gemms = (sum(cluster.gemm_seconds(tokens, *g.local(t)) for g in shape.token_mixer_gemms())
             + _mlp_seconds(shape, cluster, tokens, t))
    # memory-bound ops: a norm, a dropout and a residual add on the whole stream a block; the activation
    # on the MLP's width; the attention's softmax (an s x s matrix per head unless flash keeps none); the
    # other mixer's scan or convolution, a pass over its state a token (read, written, and again backward)
    stream = BF16 * tokens * h * 7 * shape.blocks
    sharded = BF16 * tokens * (4 * shape.active_ffn * (2 if shape.gated else 1) + (6 * h if shape.attention else 0)) / t
    core = 0.0
    if shape.attention:
        heads = c.b * shape.heads / t
        core = cluster.gemm_seconds(s, s, shape.core_head_dim, count=2 * heads)     # Q K^T and P V
        softmax = 0 if flash else BF16 * 4 * c.b * shape.heads * s * s / t
        core += _pointwise(cluster, softmax) + c.b * shape.heads * s * s / t / cluster.transcendental_rate
    scan = _pointwise(cluster, BF16 * tokens * shape.mixer.state_width * 4 / t) if shape.mixer is not None else 0.0
    activation = tokens * shape.active_ffn / t / cluster.transcendental_rate
    forward = _with_host(cluster, gemms + core + scan + _pointwise(cluster, stream + sharded) + activation,
                         OPS_PER_LAYER * shape.blocks / 2)
    link = cluster.link(t, 1, c.gpus)
    one = ring_all_reduce_seconds(BF16 * tokens * h, t, link)
    collectives = 2 * shape.blocks * one + (shape.blocks * one if c.recompute == "full" else 0)
    if c.sp == "regather" and c.recompute != "full":   # each column-parallel input gathered again: an
        collectives += shape.blocks / 2 * one          # all-gather, half an all-reduce's traffic
    again = {"full": forward, "selective": core}.get(c.recompute, 0.0)
    return LayerSeconds(forward, again, collectives, gemms)


def _mlp_seconds(shape: ModelShape, cluster: Cluster, tokens: float, t: int) -> float:
    """The MLP's GEMMs over ``tokens``, each matrix's inner width split t ways: a dense MLP's up (and
    gate) and down; an MoE's router, then each expert on its share of the routed tokens (top-k of the
    experts each, evenly spread: smaller GEMMs than a dense MLP's), and the shared experts on every token."""
    h, up = shape.hidden, 2 if shape.gated else 1

    def dense(rows, width, count=1.0):
        return (cluster.gemm_seconds(rows, up * width / t, h, count)            # up (and gate)
                + cluster.gemm_seconds(rows, h, width / t, count))              # down
    if shape.experts == 1:
        return dense(tokens, shape.ffn)
    routed = tokens * shape.experts_per_token / shape.experts
    return (cluster.gemm_seconds(tokens, shape.experts, h) + dense(routed, shape.ffn, shape.experts)
            + (dense(tokens, shape.shared_ffn) if shape.shared_ffn else 0.0))


def _rank_params(shape: ModelShape, c: Candidate) -> float:
    """Parameters the most loaded rank holds: its layers' shards (what tp replicates, whole) and, on the
    first or last stage, the embedding's (and the head's) vocabulary shard."""
    kinds = [kind.layer_rank_params(c.tp) for kind, _ in shape.layer_kinds()]
    layers = max(sum(n * k for n, k in zip(mix, kinds)) for mix in shape.stage_mixes(c.pp))
    vocab = shape.vocab * shape.hidden / c.tp
    ends = vocab + shape.positions * shape.hidden if c.pp == 1 or shape.tied else vocab
    if c.pp == 1 and not shape.tied:
        ends += vocab
    return layers + ends


def _exposed(cluster: Cluster, comm: float, beside: float) -> float:
    """Seconds ``comm`` seconds of communication add to a rank's step when the runtime runs them beside
    ``beside`` seconds of compute: what does not fit beside it, and, for what does, the compute the
    collective's kernels take (``cluster.comm_compute_share`` of its time). On a host whose cores the
    ranks already share nothing hides: the collective's own thread (gloo's copies and sums) takes a core
    from the compute beside it instead."""
    hidden = min(comm, beside) if cluster.oversubscription <= 1 else 0.0
    return comm - hidden + cluster.comm_compute_share * hidden


def _data_parallel(shape: ModelShape, cluster: Cluster, c: Candidate, overlap: float,
                   runtime: Runtime = AUTOSHARD, first_forward: float = 0.0) -> tuple:
    """(exposed dp seconds, optimizer seconds); ``overlap``: seconds of backward the gradients' reduction
    runs beside; ``first_forward``: seconds of the next step's forward ZeRO-1's parameter all-gather runs
    beside (0: exposed); ``runtime``: how the gradients cross the dp links (their bytes, and whether
    ZeRO-1 reduce-scatters them: half a ring all-reduce's traffic)."""
    params = _rank_params(shape, c)
    opt_bytes = params * (FP32 * 6 + BF16)        # read/write master, m, v; read grad; write bf16 weights
    tensors = math.ceil(shape.layers / c.pp) * TENSORS_PER_LAYER + 4
    ops = tensors * OPS_PER_TENSOR
    if c.dp == 1:
        return 0.0, _with_host(cluster, _pointwise(cluster, opt_bytes), ops)
    link = cluster.link(c.dp, c.tp * c.pp, c.gpus)
    reduce = ring_all_reduce_seconds(runtime.grad_bytes * params, c.dp, link)
    if c.zero and runtime.sharded_grads:
        reduce /= 2                                  # a reduce-scatter: half a ring all-reduce
    exposed = _exposed(cluster, reduce, overlap)
    if c.zero:
        gather = ring_all_reduce_seconds(BF16 * params, c.dp, link) / 2     # an all-gather: half a ring all-reduce
        return exposed + _exposed(cluster, gather, first_forward), _with_host(cluster, _pointwise(cluster, opt_bytes / c.dp), ops)
    return exposed, _with_host(cluster, _pointwise(cluster, opt_bytes), ops)


def stage_memory(shape: ModelShape, c: Candidate, rank: int, flash: bool = True, schedule: str = "1f1b",
                 activation_bytes: int = BF16) -> Memory:
    """Bytes pipeline rank ``rank`` holds at its peak: the parameters, gradients and optimizer state of
    the most loaded rank (layers split evenly, the vocabulary on an end stage), and its own activations:
    ``in_flight(p, m, v, rank)`` chunk-microbatches of its layers (1F1B's first rank p, its last one;
    GPipe's every rank m; ZB-H1's every rank up to 1F1B's first rank's, ZB-H2's up to its first rank's
    ``min(m, 2p - 1)``: one cap in bytes for all, W's held back fill it), one layer's whole activations
    more while full recompute runs it again, and the fp32 logits and their gradient on the rank that
    holds the LM head (the last). ``activation_bytes``: of one activation element (2: bf16, Korthikanti's
    formulas; 4 for fp32 training)."""
    params = _rank_params(shape, c)
    optimizer = params * 3 * FP32 / (c.dp if c.zero else 1)
    scale = activation_bytes / BF16
    kinds = [kind for kind, _ in shape.layer_kinds()]
    per_kind = [activation_bytes_per_layer(k, c.b, c.tp, c.recompute, flash, c.sp) for k in kinds]
    # a layer's bytes, the mean over the stage that keeps the most (a hybrid's Mamba layers keep no
    # softmax; an MoE model's dense layers may keep more)
    per_layer = (max(sum(n * b for n, b in zip(mix, per_kind)) / sum(mix) for mix in shape.stage_mixes(c.pp))
                 if shape.layout else per_kind[0]) * scale
    # the most loaded rank's layers (an uneven split puts ceil(L / p) on some rank), in v chunks
    chunk_layers = math.ceil(shape.layers / c.pp) / c.v
    microbatches = {"gpipe": c.m * c.v, "zb-h1": in_flight(c.pp, c.m, c.v, 0),
                    "zb-h2": min(c.m, 2 * c.pp - 1)}.get(schedule, in_flight(c.pp, c.m, c.v, rank))
    held = microbatches * chunk_layers * per_layer
    if c.recompute == "full":     # one layer's whole activations while it is recomputed
        held += max([activation_bytes_per_layer(k, c.b, c.tp, "none", flash, c.sp) for k in kinds]) * scale
    if rank == c.pp - 1:
        held += 2 * FP32 * c.b * shape.seq * shape.vocab / c.tp     # the fp32 logits and their gradient
    return Memory(params * BF16, params * FP32, optimizer, held)


def _memory(shape: ModelShape, cluster: Cluster, c: Candidate, flash: bool) -> Memory:
    """The most loaded rank's peak: the first pipeline rank (the most microbatches in flight) or the
    last (the logits; under ZB-H1 it may hold the first rank's activations too, W's held back), its
    activations in the cluster's compute dtype (``Cluster.compute_dtype``: bf16 on the presets, fp32 on a
    CPU host's measured cluster)."""
    return max((stage_memory(shape, c, r, flash, schedule=c.schedule, activation_bytes=cluster.activation_bytes)
                for r in {0, c.pp - 1}), key=lambda mem: mem.activations)
