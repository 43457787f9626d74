"""The stage balancer's prices: each stretch of graph between two candidate cuts, for one microbatch.

Time (a matmul by its flops, anything else by the bytes it moves, whichever is slower, plus the op's
overhead), the bytes its parameters hold with their gradients and AdamW state, the activation bytes its
forward keeps (one rank's share), the layers it holds, and its weight gradients' seconds (a split
schedule's W). ``predict`` turns the chunks of a set of cuts into the simulator's costs and replays a
schedule on them (``simulation_costs``: the one place those costs are made, so ``pipeline.md``'s timeline
is the predicted step's). ``pipeline_split.py`` cuts with these prices; this module knows nothing of cuts
beyond their positions.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from autoshard.ir import meta as M
from autoshard.ir.options import boundary_transfer
from autoshard.ir.pipeline import StageCost
from autoshard.ir.schedule import W_MEMORY, add_communication
from autoshard.ir.simulator import Costs, simulate
from autoshard.passes.activation_share import ActivationShare
from autoshard.passes.cost import flops
from autoshard.passes.shapes import shape_of, val
from autoshard.passes.weight_grad import _matmul_operands, parameter_of

ADAM_BYTES_PER_PARAM_BYTE = 4      # the parameter, its gradient, and AdamW's two moments
MATMULS = {"linear", "mm", "addmm", "bmm", "matmul", "baddbmm", "scaled_dot_product_attention"}
_VIEWS = {"view", "reshape", "_unsafe_view", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze", "slice",
          "select", "split", "alias", "detach", "getitem", "contiguous", "clone"}
# exp/log/tanh-class ops: on a CPU core their element rate, not the bytes they move, sets their time
_TRANSCENDENTAL = {"exp", "log", "tanh", "gelu", "silu", "sigmoid", "erf", "softmax", "_softmax", "log_softmax",
                   "_log_softmax", "cross_entropy_loss", "nll_loss", "logsumexp", "rsqrt", "sqrt", "pow"}
# ops whose backward needs none of their inputs: a value only they read is not kept for backward
_KEEP_NOTHING = _VIEWS | {"add", "sub", "neg", "cat", "dropout", "to", "_to_copy", "sum", "mean", "div_scalar"}


def _op_name(n: fx.Node) -> str:
    if n.op != "call_function":
        return n.op
    return getattr(getattr(n.target, "overloadpacket", None), "__name__", getattr(n.target, "__name__", ""))


def saved_for_backward(n: fx.Node) -> bool:
    """Whether autograd keeps ``n``'s output until backward: some op that reads it needs it for its own
    gradient (a matmul, a norm, an activation function, attention), or it is attention's own output."""
    return _op_name(n) == "scaled_dot_product_attention" or any(
        _op_name(u) not in _KEEP_NOTHING for u in n.users if u.op == "call_function")


def _nbytes(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def node_seconds(n: fx.Node, cm) -> float:
    """One forward of ``n``: flops for a matmul, bytes moved for the rest (the slower of the two)."""
    if n.op != "call_function":
        return 0.0
    f = flops(n, shape_of)
    name = getattr(getattr(n.target, "overloadpacket", None), "__name__", "")
    moved = _nbytes(val(n)) + sum(_nbytes(val(a)) for a in n.all_input_nodes)
    if name in _VIEWS - {"contiguous", "clone"}:
        return cm.op_overhead / 4       # a view: no data moves, only the dispatch
    work = f / cm.flops if name in MATMULS else max(f / cm.flops, moved / cm.memory_bandwidth)
    if name in _TRANSCENDENTAL:
        first = val(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
        elements = max(val(n).numel() if isinstance(val(n), torch.Tensor) else 0,
                       first.numel() if isinstance(first, torch.Tensor) else 0)
        work = max(work, elements / cm.transcendental_rate)
    return cm.op_overhead + work


def layer_prefix(gm: fx.GraphModule) -> str | None:
    """The model's longest repeated ModuleList (``transformer.h``, ``model.layers``): the unit of
    ``pipeline_cuts``."""
    counts: dict = {}
    for n in gm.graph.nodes:
        for path, _ in (n.meta.get("nn_module_stack") or {}).values():
            parts = path.split(".")
            for i, part in enumerate(parts):
                if part.isdigit() and i:
                    counts.setdefault(".".join(parts[:i]), set()).add(int(part))
    return max(counts, key=lambda k: len(counts[k])) if counts else None


def layer_of(n: fx.Node, prefix: str | None):
    if prefix is None:
        return None
    pattern = re.compile(re.escape(prefix) + r"\.(\d+)(\.|$)")
    for path, _ in (n.meta.get("nn_module_stack") or {}).values():
        match = pattern.match(path)
        if match:
            return int(match[1])
    return None


@dataclass
class Segments:
    """Prices of the stretches between consecutive candidate cuts (one more than there are cuts)."""
    seconds: list
    flops: list
    params: list              # set of (name, bytes) per stretch
    activation_bytes: list
    layers: list              # set of layer indices per stretch
    recompute: list = None    # forward seconds each stretch's backward runs again (activation recompute)
    weight: list = None       # seconds of each stretch's weight gradients (a split schedule's W)

    def priced_as(self, chunk: int, rank_of=None) -> "Segments":
        """The prices chunk ``chunk`` pays (the same for every chunk; see ``PerRankRecompute``)."""
        return self

    def chunk(self, i: int, j: int, tp: int) -> StageCost:
        params = set().union(*self.params[i:j])
        pbytes = sum(b // (tp if nd >= 2 else 1) for _, b, nd in params) * ADAM_BYTES_PER_PARAM_BYTE
        layers = sorted(set().union(*self.layers[i:j]))
        return StageCost(sum(self.seconds[i:j]), sum(self.flops[i:j]), pbytes,
                         sum(self.activation_bytes[i:j]), tuple(layers), sum((self.recompute or [])[i:j]),
                         sum((self.weight or [])[i:j]))

    def with_recompute(self, cands: list, share: ActivationShare = ActivationShare()) -> "Segments":
        """As ``passes/recompute.py`` will run it: a stretch inside one layer keeps only the input of its
        layer's first stretch (a rank's ``share`` of it: a sequence shard under SP), and its backward runs
        its forward again."""
        seg = Segments(list(self.seconds), list(self.flops), self.params, list(self.activation_bytes),
                       self.layers, [0.0] * len(self.seconds), self.weight)
        for k, layers in enumerate(self.layers):
            if len(layers) != 1:
                continue
            starts = k == 0 or self.layers[k - 1] != layers
            seg.activation_bytes[k] = share.kept(cands[k - 1].boundary, cands[k - 1].nbytes) if starts and k > 0 else 0
            seg.recompute[k] = self.seconds[k]
        return seg


@dataclass(frozen=True)
class PerRankRecompute:
    """Stretch prices when only some pipeline ranks recompute (``CompileOptions.recompute_stages``, which
    ``memory_limit`` sets for the ranks that would not fit without it): a chunk on one of ``ranks`` is
    priced as the recompute pass will run it, any other as it is."""
    recomputed: Segments
    plain: Segments
    ranks: frozenset
    rank_of: object             # the planned schedule's placement (chunk -> pipeline rank), unless one is given

    @property
    def seconds(self) -> list:
        return self.plain.seconds

    def priced_as(self, chunk: int, rank_of=None) -> Segments:
        """``rank_of``: the placement of the schedule being priced (ZB-V's V against the interleaved
        baseline it is compared with)."""
        return self.recomputed if (rank_of or self.rank_of)(chunk) in self.ranks else self.plain

    def chunk(self, i: int, j: int, tp: int) -> StageCost:
        return self.recomputed.chunk(i, j, tp)


def price(gm: fx.GraphModule, act: set, cands: list, cm, prefix, share: ActivationShare = ActivationShare(),
          in_b: frozenset = frozenset()) -> Segments:
    """Each stretch's forward seconds, flops, parameters, layers, the activation bytes one rank keeps of
    what its forward saves (``share``: the tp shard of each saved value, and what selective recompute
    drops), and its weight gradients' seconds: a matmul by a parameter's forward again (dW = x^T dy has
    its flops), all the W of a split backward; the rest of the backward (about twice the forward) is B.
    W so is less than half the backward wherever the ops between the matmuls weigh: on the CI host a
    4-layer GPT stage measured B 6.14 and W 1.87 ms (``benchmarks/results/zero_bubble.md``). ``in_b``: the
    parameter matmuls whose weight gradient stays in B (an LM head the chunked loss takes)."""
    ends = [c.position for c in cands] + [len(gm.graph.nodes)]
    k = 0
    seg = Segments([0.0] * len(ends), [0.0] * len(ends), [set() for _ in ends], [0] * len(ends),
                   [set() for _ in ends], weight=[0.0] * len(ends))
    for i, n in enumerate(gm.graph.nodes):
        while i > ends[k]:
            k += 1
        if n not in act:
            continue
        seconds = node_seconds(n, cm)
        seg.seconds[k] += seconds
        seg.flops[k] += flops(n, shape_of) if n.op == "call_function" else 0
        if n not in in_b and (operands := _matmul_operands(n)) is not None and parameter_of(operands[1]) is not None:
            seg.weight[k] += seconds
        if saved_for_backward(n):
            seg.activation_bytes[k] += share.kept(n, _nbytes(val(n)))
        layer = layer_of(n, prefix)
        if layer is not None:
            seg.layers[k].add(layer)
        for a in n.all_input_nodes:
            if a.op == "placeholder" and M.KIND.get(a, None) == "parameter":
                seg.params[k].add((M.NAME.get(a), _nbytes(val(a)), val(a).dim()))
    return seg


def predict(seg: Segments, cuts: list, schedule, tp: int, cm, cands: list, whole: Segments | None = None):
    """Chunk costs for ``cuts`` and the simulated step (seconds) and per-rank peak (params + activations)."""
    edges = [0] + list(cuts) + [len(seg.seconds)]
    costs = [seg.priced_as(k, schedule.rank_of).chunk(a, b, tp) for k, (a, b) in enumerate(zip(edges, edges[1:]))]
    sim = simulate(add_communication(schedule), simulation_costs(seg, cuts, schedule, tp, cm, cands, costs, whole))
    peak = {r: sim.peak_activation_bytes[r] + sum(costs[s].param_bytes for s in schedule.stages_of(r))
            for r in range(schedule.pp)}
    return costs, sim.step_time, peak


def boundary_link(cm, tp: int, sequence_parallel, sliced: bool):
    """``cm`` with its p2p link as one tp rank meets a boundary transfer (``ir.options.boundary_transfer``),
    so a send is priced as the runtime makes it: the transfer is linear in the bytes, so it folds into one
    bandwidth and latency. Approximations: every boundary is priced so, where the runtime slices only the
    tp-replicated ones (``Chunk.in_replicated``), and the t slices are taken to cross t links (one NIC a
    GPU), not to share one."""
    if tp == 1 or not (sequence_parallel or sliced):
        return cm
    send = boundary_transfer(tp, sequence_parallel, sliced, cm.p2p_bandwidth, cm.p2p_latency, cm.bandwidth,
                             cm.latency)
    return dataclasses.replace(cm, p2p_bandwidth=1 / send.seconds_a_byte, p2p_latency=send.latency)


def simulation_costs(seg: Segments, cuts: list, schedule, tp: int, cm, cands: list, costs: list,
                     whole: Segments | None = None) -> Costs:
    """What the simulator prices the chunks ``costs`` of ``cuts`` with: one transfer time (the widest
    boundary these cuts send), what a split B keeps for W, the split's extra pass, and the runtime's own
    time per action and per blocking send. One place, so ``pipeline.md``'s timeline is the predicted step's."""
    boundary_bytes = max((cands[c - 1].nbytes for c in cuts), default=0)
    edges = [0] + list(cuts) + [len(seg.seconds)]
    split = 1 + (cm.weight_split_overhead if schedule.split else 0.0)    # B + W cost more than a whole backward
    return Costs.of_stages(costs, cm.p2p_latency + boundary_bytes / cm.p2p_bandwidth, kept_for_w(whole or seg, edges, tp),
                           split, cm.action_overhead, cm.send_blocking)


def kept_for_w(whole: Segments, edges: list, tp: int) -> tuple:
    """Per stage, the bytes a split backward's B keeps for W a microbatch: each matmul's input and output
    gradient, about the activations the stage saves without recompute (``W_MEMORY`` of them: measured on
    the built-in GPT). Under recompute the forward saves only layer inputs, but B still keeps these."""
    return tuple(W_MEMORY * whole.chunk(a, b, tp).activation_bytes for a, b in zip(edges, edges[1:]))
