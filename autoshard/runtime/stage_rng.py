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


_DROPOUTS = ("dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")
_ATTENTION = ("scaled_dot_product_attention",)


def _draws(n: fx.Node) -> bool:
    """Whether one node draws from torch's generator: a dropout only in training with p > 0 and an SDPA only
    with ``dropout_p > 0`` (both carry torch's nondeterministic tag whatever their p), any other op so
    tagged, and the fused dropout's seed (``kernels/rng.py:draw_seed``)."""
    if n.op != "call_function":
        return False
    if getattr(n.target, "__name__", "") == "draw_seed":
        return True
    name = getattr(getattr(n.target, "overloadpacket", None), "__name__", "")
    if name in _DROPOUTS:
        args = list(n.args) + [None, None]
        p, train = n.kwargs.get("p", args[1]), n.kwargs.get("train", args[2])
        return bool(train if train is not None else True) and not (isinstance(p, (int, float)) and p == 0)
    if name in _ATTENTION:
        p = n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    return torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())


def draws_random(gms) -> bool:
    """Whether any of the graphs (their submodules' graphs too) draws from torch's generator."""
    return any(_draws(n) for gm in gms for sub in gm.modules() if isinstance(sub, fx.GraphModule)
               for n in sub.graph.nodes)


def stage_seed(drawn: int, pp_rank: int) -> int:
    """A 63-bit seed for ``pp_rank`` from the step's ``drawn`` number."""
    return (drawn * _MIX[0] + (pp_rank + 1) * _MIX[1]) % (1 << 63)


@contextlib.contextmanager
def stage_stream(pp_size: int, pp_rank: int, random: bool, device: torch.device | None = None):
    """Run the block (a step's actions) on this pp rank's own RNG stream; nothing at pp = 1, or where no
    stage draws (``random``: ``draws_random`` over every stage, so every rank decides alike). ``device``:
    where the stage computes; a CUDA one's generator is forked and seeded too (from the CPU draw, so
    ``torch.manual_seed``, which seeds both, reproduces a step; ``torch.cuda.manual_seed_all`` alone
    does not change a pipeline's masks)."""
    if pp_size == 1 or not random:
        yield
        return
    drawn = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
    cuda = device is not None and device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    with torch.random.fork_rng(devices=[index] if cuda else []):
        seed = stage_seed(drawn, pp_rank)
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield
