"""Each pipeline rank's dropout masks from a stream of its own, the same on its tp ranks.

Every rank is seeded alike (tp ranks must draw one mask for a replicated activation), so without this
a pipeline's ranks would start a step from one RNG state: stage 1's first dropout would draw stage 0's
first mask bit for bit (an embedding's and a later layer's masks the same), and the ranks' global streams
would drift apart by the draws each stage made. A pipeline cannot draw the single device's masks anyway
(that needs the RNG state stage 0 reaches after its draws, while it is already on the next microbatch),
so, as Megatron-LM offsets its seed by 100 x the pipeline rank, each pp rank runs its step's actions in a
forked RNG seeded from one number drawn from torch's generator (alike on every rank, so ``manual_seed``
reproduces a step) and its pp rank: independent masks per stage, one mask per tp group, new each step,
recompute and the split backward replaying them as before (checkpoint keeps each region's state). The
caller's stream advances by that one draw a step, and only where some stage draws random numbers.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

_MIX = (0x9E3779B97F4A7C15, 0x94D049BB133111EB)


def draws_random(gms) -> bool:
    """Whether any of the graphs (their submodules' graphs too) draws from torch's generator."""
    for gm in gms:
        for sub in gm.modules():
            if not isinstance(sub, fx.GraphModule):
                continue
            for n in sub.graph.nodes:
                if n.op != "call_function":
                    continue
                tags = getattr(n.target, "tags", ())
                if torch.Tag.nondeterministic_seeded in tags or getattr(n.target, "__name__", "") == "draw_seed":
                    return True
    return False


def stage_seed(drawn: int, pp_rank: int) -> int:
    """A 63-bit seed for ``pp_rank`` from the step's ``drawn`` number."""
    return (drawn * _MIX[0] + (pp_rank + 1) * _MIX[1]) % (1 << 63)


@contextlib.contextmanager
def stage_stream(pp_size: int, pp_rank: int, random: bool):
    """Run the block (a step's actions) on this pp rank's own RNG stream; nothing at pp = 1, or where no
    stage draws (``random``: ``draws_random`` over every stage, so every rank decides alike)."""
    if pp_size == 1 or not random:
        yield
        return
    drawn = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        seed = stage_seed(drawn, pp_rank)
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)
        yield
