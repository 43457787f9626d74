"""Functionalize writes into views at capture, with torch's own functionalization.

Linear-attention and recurrent scans fill a buffer one position at a time (``out[:, t] = ...`` in
Qwen3.5's and Qwen3-Next's gated delta rule, RecurrentGemma's RG-LRU), and Qwen3.5's rotary writes
every third slice of its frequencies. ``torch.export``'s training IR keeps those writes as ``copy_`` into
a ``select``/``slice`` view. No later pass can treat them as data: the write has no users, so a stage
cut walking back along data edges drops it, and sharding moves a view and its base through different
collectives. ``canonicalize`` makes a write pure only when nothing aliases the written tensor.

So when the captured graph writes into a view (or into a tensor that has views), capture runs export's
functionalization (``ExportedProgram.run_decompositions({})``) once: every write becomes a value,
``slice_scatter`` / ``select_scatter`` of the new part into the old buffer, and later reads take the
new buffer. The rules shard a scatter on any dimension other than the one it writes along.

Torch's pass is used rather than our own because the aliasing of ``reshape`` (a view or a copy,
depending on strides) and of chains of views is exactly what it tracks. The price: it also decomposes
composite ops (``matmul``, ``reshape``, ``chunk``, ``to``) into their parts, which the rules know too, so
it runs only on graphs that need it. A buffer filled by disjoint slices before anyone reads it (DeepSeek's
MLA keys) is left to ``fill_slices``, which makes it one ``cat``, better for sharding.
"""
from __future__ import annotations

import warnings

import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from autoshard.passes.canonicalize import _may_alias, _out_of_place
from autoshard.passes.fill_slices import ALLOCATIONS, _assembly
from autoshard.passes.shapes import module_path, writes_in_place


def _root(x: fx.Node) -> fx.Node:
    """The tensor whose storage view ``x`` shares (``x`` itself when it is no view)."""
    while x.op == "call_function" and _may_alias(x) and x.args and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    return x


def _made_pure_later(n: fx.Node, nodes: list, order: dict) -> bool:
    """Whether write ``n`` is no concern here: a later pass makes it a value (``canonicalize``: a write
    into an op result nothing aliases; ``fill_slices``: a fresh buffer filled by disjoint slices), or it
    writes a module buffer or an input (a running counter), which the program keeps doing in place."""
    x = n.args[0] if n.args else None
    if not isinstance(x, fx.Node) or x.op != "call_function" or _root(x).op == "placeholder":
        return True
    if _out_of_place(n) is not None and not _may_alias(x) and not any(_may_alias(u) for u in x.users if u is not n):
        return True
    base = x.args[0] if x.args and isinstance(x.args[0], fx.Node) else None
    return base is not None and base.target in ALLOCATIONS and _assembly(base, nodes, order) is not None


def writes_into_views(gm: fx.GraphModule) -> list[fx.Node]:
    """The in-place writes of ``gm`` that no later pass can make pure (into a view, or into a tensor a
    view aliases), in graph order."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    return [n for n in nodes if writes_in_place(n) and not _made_pure_later(n, nodes, order)]


def functionalize(ep: ExportedProgram) -> tuple[ExportedProgram, list[str]]:
    """``ep`` with every write into a view made a scatter, and the modules that wrote (for ``plan.md``);
    ``ep`` itself when it has none."""
    writes = writes_into_views(ep.graph_module)
    if not writes:
        return ep, []
    modules = list(dict.fromkeys(module_path(n) for n in writes))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)  # torch's own
        pure = ep.run_decompositions({})
    written = [spec.target for spec in pure.graph_signature.output_specs if spec.kind is OutputKind.PARAMETER_MUTATION]
    if written:
        raise WritesParameters(written)
    if any(spec.kind is not OutputKind.USER_OUTPUT for spec in pure.graph_signature.output_specs):
        return ep, []      # a write reached module state after all: leave it to canonicalize's checks
    return pure, modules


class WritesParameters(ValueError):
    """The forward writes these parameters in place (what functionalization reveals of a write made under
    ``no_grad`` in a region export keeps apart); ``capture`` turns it into a ``CaptureError``."""

    def __init__(self, targets: list):
        super().__init__(", ".join(targets))
        self.targets = targets
