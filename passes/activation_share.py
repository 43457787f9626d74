"""What one rank keeps of a saved activation, for the stage balancer's memory (``stage_prices.price``).

The balancer cuts the *global* graph before the planner has chosen any placement, yet a memory limit is
per rank, and a rank of a tp group keeps far less than the whole graph saves. Megatron's accounting
(Korthikanti et al., 2022, per layer and token: ``10 + 24/t + 5as/(ht)`` bytes over h) says which part is
which, and it is read off the tensors' shapes here:

- a tensor shaped like the residual stream (as many elements as the stream a cut sends, the model's
  width last): the norms' inputs and outputs, the residual adds, the dropouts on the stream. Tensor
  parallelism replicates them (the ``10``); sequence parallelism shards them along the sequence (``/t``),
  except the input of a matmul by a parameter (a column-parallel input: autoshard keeps it gathered
  for the weight gradient, ``4 sbh (1 - 1/t)`` a layer over the paper's count);
- everything else a layer saves (q, k, v by head, the attention scores, the MLP's wide intermediates, the
  logits over a vocabulary shard): sharded over tp (the ``24/t`` and ``5as/(ht)``);
- under selective recompute, what an attention core saves inside itself (scores, softmax, its dropout) is
  not kept: it runs again in backward (``passes/selective_recompute.py``, the same cores).

One stream-shaped tensor is sharded all the same: the input of the attention's output projection (the
heads, concatenated). It is counted as replicated, so the estimate errs high by ``2 sbh (1 - 1/t)`` of
the formula's ``34 sbh``-class total, on the safe side of a limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch.fx as fx

from autoshard.passes.shapes import val
from autoshard.passes.weight_grad import _matmul_operands, parameter_of


def _feeds_a_weight(n: fx.Node) -> bool:
    """Whether ``n`` is multiplied by a parameter (its gathered copy is what the matmul keeps under SP)."""
    return any((ops := _matmul_operands(u)) is not None and ops[0] is n and parameter_of(ops[1]) is not None
               for u in n.users)


@dataclass(frozen=True)
class ActivationShare:
    """How a rank's saved bytes relate to the global graph's: ``tp``, sequence parallelism, the residual
    stream's size (elements, and its width) and the nodes selective recompute does not keep."""
    tp: int = 1
    sequence_parallel: bool | str = False      # "regather": the column-parallel inputs kept as shards too
    stream_numel: int = 0
    hidden: int = 0
    recomputed: frozenset = frozenset()

    def kept(self, n: fx.Node, nbytes: float) -> float:
        """Bytes of ``n``'s saved value one rank keeps."""
        if n in self.recomputed:
            return 0.0
        if self.tp == 1:
            return nbytes
        v = val(n)
        shape = tuple(getattr(v, "shape", ()))
        stream = bool(shape) and shape[-1] == self.hidden and math.prod(shape) == self.stream_numel
        if not stream:
            return nbytes / self.tp
        if not self.sequence_parallel:
            return nbytes
        return nbytes if self.sequence_parallel != "regather" and _feeds_a_weight(n) else nbytes / self.tp


def activation_share(gm: fx.GraphModule, cands: list, tp: int, sequence_parallel: bool | str,
                     selective: bool) -> ActivationShare:
    """The share for ``gm`` cut at candidates ``cands`` (``pipeline_split.candidates``): the residual
    stream is the value most cuts send."""
    shapes = [tuple(val(c.boundary).shape) for c in cands]      # the boundary is the stream, carried values or not
    stream = max(set(shapes), key=shapes.count) if shapes else ()
    recomputed = frozenset()
    if selective:     # the cores selective recompute will run again (not one holding a collective or a write)
        from autoshard.passes.selective_recompute import attention_core_regions     # it imports pipeline_split
        nodes = list(gm.graph.nodes)
        # the core's own saved values; its output (the next matmul keeps it) and its inputs stay
        recomputed = frozenset(n for r in attention_core_regions(gm)[0] for n in nodes[r.first_index:r.last_index])
    return ActivationShare(tp, sequence_parallel, math.prod(stream) if stream else 0,
                           stream[-1] if stream else 0, recomputed)
