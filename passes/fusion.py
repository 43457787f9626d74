"""``fuse``: partition each rank's graph into fusion groups and run each as generated Triton kernels.

A node is a candidate when it is a ``call_function`` whose trace lands on rows of ``kernels/optable.py``
(pointwise ops and last-dim reductions: LayerNorm, RMSNorm, softmax, GeLU, SiLU, adds, scales, casts).
Matmuls, attention, collectives and the vocab-parallel ops are ``call_module`` records or ops the table
lacks, so they stay outside every group, as do views (a group boundary is cheaper at a view than a
kernel that moves the last dim). Neighbouring candidates that iterate over the same ``[rows, cols]``
space merge, as long as the group stays convex (no path leaves it and comes back, torch's
``validate_partition``). A group is fused only when it moves fewer bytes than its eager ops, which
leaves a lone GeLU (one read, one write either way) to eager.

Each group becomes a ``kernels.launch.FusedGroup`` module in place of its nodes (torch's
``fuse_as_graphmodule`` cuts the group out; ``_splice`` puts the kernel's call in its place). Its
backward is generated from the group's own vector-Jacobian product (``kernels/trace.py``). A group the generator cannot express is
left as it was, and ``plan.md`` says which op stopped it.
"""
from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.passes.tools_common import stable_topological_sort
from torch.fx.passes.utils.fuser_utils import erase_nodes, fuse_as_graphmodule, validate_partition

from autoshard.ir import meta as M
from autoshard.ir.pipeline import STAGE_PLAN
from autoshard.ir.fusion import FusionGroup, FusionReport, KernelRecord, Unfused
from autoshard.ir.options import resolved_codegen, uses_nccl
from autoshard.passes.dropout_rng import rewrite_dropout

class FusionUnavailable(RuntimeError):
    """``fuse=True`` where no Triton kernel can run."""


def _runs_on_cuda() -> bool:
    """Whether the program will run on CUDA: CUDA is there and the processes talk NCCL (a gloo run on a GPU
    machine, the test suite's, computes on the CPU)."""
    return torch.cuda.is_available() and uses_nccl()


def _decide(mode) -> tuple:
    """(enabled, why) for ``fuse=True | False | "auto"``."""
    if mode is False or mode is None:
        return False, "fuse=False"
    if mode == "auto" and not _runs_on_cuda():   # decided before importing triton (a second)
        return False, ("fuse='auto' without CUDA (or on gloo) (set fuse=True with TRITON_INTERPRET=1 to run the "
                       "kernels on CPU)")
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    try:
        import triton  # noqa: F401
        have_triton = True
    except ImportError:
        have_triton = False
    runs = have_triton and (torch.cuda.is_available() or interpreting)
    if mode == "auto":
        if runs:
            return True, "fuse='auto' on CUDA"
        return False, "fuse='auto': triton is not installed"
    if mode is True:
        if not have_triton:
            raise FusionUnavailable("fuse=True needs triton: pip install triton (or pass fuse=False)")
        if not runs:
            raise FusionUnavailable("fuse=True needs a CUDA device, or TRITON_INTERPRET=1 set before the first "
                                    "import of triton to run the kernels in Triton's interpreter on CPU; "
                                    "fuse='auto' fuses on CUDA only")
        return True, "fuse=True" + (" under TRITON_INTERPRET=1" if interpreting else " on CUDA")
    raise ValueError(f"fuse must be True, False or 'auto', not {mode!r}")


def _val(n):
    v = M.LOCAL_VAL.get(n, None) if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _space(n) -> tuple | None:
    v = _val(n)
    if v is None or v.dim() == 0 or not v.dtype.is_floating_point:
        return None
    return (math.prod(v.shape[:-1]), v.shape[-1])


_VIEW_PACKETS = {"view", "reshape", "_unsafe_view", "expand", "permute", "transpose", "t", "unsqueeze",
                 "squeeze", "slice", "select", "split", "split_with_sizes", "contiguous", "getitem"}


class _Eligibility:
    """Whether a node alone lowers to a kernel; cached by op and operand signature (layers repeat)."""

    def __init__(self):
        self.cache: dict = {}

    def __call__(self, n: fx.Node) -> bool:
        from autoshard.kernels.lower import Unfusable, lower
        from autoshard.kernels.trace import trace_group
        if n.op != "call_function" or _space(n) is None:
            return False
        name = getattr(getattr(n.target, "overloadpacket", None), "__name__", getattr(n.target, "__name__", ""))
        if name in _VIEW_PACKETS or not isinstance(n.target, torch._ops.OpOverload):
            return False
        tensors = [a for a in n.all_input_nodes]
        if any(_val(a) is None for a in tensors):
            return False
        key = (n.target, tuple(_sig(a) for a in n.args), tuple((k, _sig(v)) for k, v in n.kwargs.items()))
        if key not in self.cache:
            try:
                fn = _node_fn(n, tensors)
                metas = [_val(a) for a in tensors]
                tr = trace_group(fn, metas, backward=False)
                widest = max([_val(n)] + metas, key=lambda v: v.numel())   # a reduction's input
                lower(tr.forward, metas, tuple(widest.shape))
                self.cache[key] = True
            except (Unfusable, Exception):   # any op the tracer or the table cannot take stays eager
                self.cache[key] = False
        return self.cache[key]


def _sig(a):
    if isinstance(a, fx.Node):
        v = _val(a)
        return ("T", tuple(v.shape), tuple(v.stride()), v.dtype) if v is not None else ("?",)
    if isinstance(a, (list, tuple)):
        return tuple(_sig(x) for x in a)
    return a


def _node_fn(n: fx.Node, tensors: list):
    def fn(*xs):
        env = dict(zip(tensors, xs))
        args = fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
        return (n.target(*args, **kwargs),)
    return fn


def _joins(a: tuple, b: tuple) -> tuple | None:
    """The space of two groups' union, or None: the same rows, and the same columns or one a per-row
    value (a row reduction's ``[..., 1]`` result joins the rows it reduced)."""
    if a[0] != b[0] or (a[1] != b[1] and min(a[1], b[1]) != 1):
        return None
    return (a[0], max(a[1], b[1]))


def partition(gm: fx.GraphModule, eligible, cuts=frozenset()) -> list:
    """Groups of candidate nodes: a node joins its producer's group when their spaces join and the union
    stays convex. A node in ``cuts`` (a pipeline boundary) ends its group: what reads it is on the next
    stage. Nodes of different recompute regions (``RECOMPUTE``, one per layer) never share a group, so a
    layer is still recomputed whole. Returns lists of nodes in graph order."""
    group: dict = {}
    members: dict = {}
    space: dict = {}
    for n in gm.graph.nodes:
        if not eligible(n):
            continue
        group[n], members[n], space[n] = n, [n], _space(n)
        for p in n.all_input_nodes:
            if p not in group or p.name in cuts or M.RECOMPUTE.get(p, None) != M.RECOMPUTE.get(n, None):
                continue
            a, b = group[p], group[n]
            joined = _joins(space[a], space[b])
            if a is b or joined is None:
                continue
            merged = members[a] + members[b]
            if not validate_partition(merged):
                continue
            for m in members[b]:
                group[m] = a
            members[a], space[a] = merged, joined
            del members[b], space[b]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [sorted(ms, key=order.__getitem__) for ms in members.values()]


def _bytes(vals) -> int:
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def graph_bytes(gm: fx.GraphModule) -> int:
    """What a graph's ops read and write when each runs as its own kernel (views move nothing)."""
    total = 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = getattr(getattr(n.target, "overloadpacket", None), "__name__", "")
        if name in _VIEW_PACKETS or name in ("detach", "alias", "zeros_like"):
            continue
        ins = [a.meta.get("val") for a in n.all_input_nodes]
        out = n.meta.get("val")
        total += _bytes(ins) + _bytes(out if isinstance(out, (tuple, list)) else [out])
    return total


def kernel_bytes(kernel, inputs) -> int:
    """What a generated kernel reads (the operands it uses) and writes (its outputs)."""
    plan = kernel.plan
    return _bytes(inputs[i] for i in plan.used) + sum(
        math.prod(o.shape) * o.dtype.itemsize for o in plan.outputs if o.kind != "alias")


@dataclass
class _Built:
    """A group that lowered: what the graph surgery and the report need."""
    nodes: list
    sub: fx.GraphModule
    ins: tuple
    outs: tuple
    metas: list
    module: object
    eager: int


def _build(gm: fx.GraphModule, nodes: list, name: str) -> _Built:
    """Trace and generate one group; ``Unfusable`` says why it cannot be one (or is not worth it)."""
    from autoshard.kernels.launch import FusedGroup
    from autoshard.kernels.lower import Unfusable
    from autoshard.kernels.trace import trace_group
    sub, ins, outs = fuse_as_graphmodule(gm, nodes, name, always_return_tuple=True)
    metas = [_val(a) for a in ins]
    eager = sum(_bytes([_val(a) for a in n.all_input_nodes] + [_val(n)]) for n in nodes)
    fused = _bytes(metas) + _bytes([_val(o) for o in outs])
    if fused >= eager:
        raise Unfusable(f"moves {fused} bytes fused, {eager} as eager ops: nothing to gain")
    grad_inputs = tuple(i for i, (a, v) in enumerate(zip(ins, metas))
                        if v.is_floating_point() and M.REQUIRES_GRAD.get(a, True))
    trace = trace_group(sub, metas, bool(grad_inputs), grad_inputs)
    anchor = tuple(max([_val(n) for n in nodes] + metas, key=lambda v: v.numel()).shape)
    return _Built(nodes, sub, ins, outs, metas, FusedGroup(name, trace, anchor, metas), eager)


def _build_largest(gm: fx.GraphModule, nodes: list, name: str) -> tuple:
    """The group, or failing that its longest run without a few nodes at either end (an embedding's
    broadcast add whose gradient would need a reduction over the batch, say): (built or None, reasons)."""
    from autoshard.kernels.lower import Unfusable
    tries = [nodes] + [nodes[i:] for i in range(1, min(4, len(nodes)))] + \
        [nodes[:-i] for i in range(1, min(4, len(nodes)))]
    reasons = []
    for part in tries:
        if len(part) < 1 or (part is not nodes and not validate_partition(part)):
            continue
        try:
            return _build(gm, part, name), reasons
        except Unfusable as e:
            reasons.append(Unfused(tuple(n.name for n in part), str(e)))
        except Exception as e:  # noqa: BLE001 - a tracer or codegen failure leaves the group eager, said why
            reasons.append(Unfused(tuple(n.name for n in part), f"{type(e).__name__}: {e}"[:300]))
    return None, reasons


def _record(built: _Built, name: str):
    from autoshard.kernels.trace import eager_backward_graph
    module, metas = built.module, built.metas
    fwd = module.forward_kernels.get(metas)
    kernels = [KernelRecord(k.name, k.plan.template, f"{k.module_name}.py", k.source) for k in module.kernels()]
    bwd_eager = bwd_fused = 0
    if module.backward_kernels is not None:
        outs = [torch.empty(o.shape, dtype=o.dtype, device="meta") for o in fwd.plan.outputs]
        operands = [*metas, *[o for o in outs if o.dtype.is_floating_point], *outs]
        bwd_eager = graph_bytes(eager_backward_graph(built.sub, metas))
        bwd_fused = kernel_bytes(module.backward_kernels.get(operands), operands)
    return FusionGroup(
        name, tuple(n.name for n in built.nodes), tuple(str(n.target) for n in built.nodes), module.anchor,
        tuple(a.name for a in built.ins), tuple(o.name for o in built.outs),
        tuple(built.ins[i].name for i in module.saved) + tuple(built.outs[j].name for j in module.saved_outputs),
        built.eager, kernel_bytes(fwd, metas), bwd_eager,
        bwd_fused, tuple(kernels))


def _splice(gm: fx.GraphModule, built: _Built, name: str) -> fx.Node:
    """Call the kernel module right after the group's last node and route each group output through a
    ``getitem`` of that call. This is torch's ``insert_subgm`` with an insertion point, written here
    because that helper is marked not backward compatible and its signature moved: torch 2.11 has no
    insertion point and appends the call after the graph's output (the first real GPU run failed on it)."""
    gm.add_submodule(name, built.module)
    g = gm.graph
    with g.inserting_after(built.nodes[-1]):
        call = g.call_module(name, tuple(built.ins))
    call.meta["val"] = tuple(_val(o) for o in built.outs)
    with g.inserting_before(call.next):
        for i, out in enumerate(built.outs):
            out.replace_all_uses_with(g.call_function(operator.getitem, (call, i)), propagate_meta=True)
    return call


def fusion_enabled(options) -> tuple:
    """``(enabled, why)``: whether this program's kernels are autoshard's generated ones (``fuse`` on, and
    not ``codegen="inductor"``, where Inductor writes them)."""
    if resolved_codegen(options.codegen) == "inductor":
        return False, "codegen='inductor': Inductor generates this program's kernels"
    return _decide(options.fuse)


def fuse_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    enabled, why = fusion_enabled(ctx.options)
    report = FusionReport(enabled, why)
    gm.meta[M.FUSION_REPORT] = report
    if not enabled:
        return gm
    report.unfused += [Unfused((name,), why) for name, why in rewrite_dropout(gm, ctx.mesh.axis_size("tp"))]
    stages = gm.meta.get(STAGE_PLAN)
    cuts = frozenset(n for k in range(len(stages.boundaries)) for n in stages.sent(k)) if stages is not None \
        else frozenset()
    renamed: dict = {}
    for k, nodes in enumerate(partition(gm, _Eligibility(), cuts)):
        name = f"fused_{k}"
        built, reasons = _build_largest(gm, nodes, name)
        report.unfused += reasons
        if built is None:
            continue
        report.groups.append(_record(built, name))
        call = _splice(gm, built, name)
        region = M.RECOMPUTE.get(built.nodes[0], None)
        for item in call.users:           # the getitem that now carries each output
            renamed[built.outs[item.args[1]].name] = item.name
            if region is not None:
                M.RECOMPUTE.set(item, region)
        if region is not None:            # the kernel runs in (and again with) its layer's region
            M.RECOMPUTE.set(call, region)
        erase_nodes(gm, built.nodes)
    if stages is not None:                # a cut at a fused output: the value now has the getitem's name
        stages.boundaries = [renamed.get(b, b) for b in stages.boundaries]
        stages.carried = [tuple(renamed.get(b, b) for b in names) for names in stages.carried]
    stable_topological_sort(gm)
    gm.graph.lint()
    gm.recompile()
    return gm
