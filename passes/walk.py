"""The one upward walk over an fx graph: from some nodes to what they are computed from.

Several passes ask a question of everything a value is computed from (which inputs the targets come
from, what a pipeline chunk holds, which projections feed an attention, which collectives made a tensor
whole). Each asks it with ``upstream``: every node reached once, depth first, whatever the graph's
fan-in, so a question about a 100-layer model costs one visit per node.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch.fx as fx


def upstream(starts: Iterable[fx.Node], follow: Callable[[fx.Node], Iterable] | None = None,
             stop: Iterable[fx.Node] = ()) -> Iterator[fx.Node]:
    """Each node reachable from ``starts``, once, depth first. After a node is yielded the walk goes on to
    ``follow(node)`` (default: all its input nodes; return nothing to stop there). Nodes in ``stop`` are
    neither yielded nor passed (a chunk's starting boundary). A caller that has its answer just stops
    iterating."""
    todo, seen = list(starts), set(stop)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        yield n
        todo.extend(n.all_input_nodes if follow is None else follow(n))
