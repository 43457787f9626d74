"""The data-parallel axis: each dp rank steps on its own slice of the global batch; gradients are summed
over dp in buckets while the last microbatch's backward is still running.

The loss each rank computes is already its share of the global mean (its summed cross-entropy over
the count of the *global* batch, all-reduced over dp during the first forward), so the gradients are
*summed* over dp, not averaged, and uneven ``ignore_index`` counts between dp ranks give
the single-device gradients exactly.

Reduction happens once per step: only during the last backward of each stage on this rank (the
schedule says which action that is), as DDP's ``no_sync`` does for gradient accumulation. Buckets are
fixed per stage (parameters in reverse graph order, up to ``bucket_bytes`` each, the first 1 MiB on
CUDA as DDP's) and launched strictly
in order, so every dp rank issues the same all-reduces in the same order whatever order autograd
finishes the gradients in. A hook on each parameter leaf counts a bucket down; when it is full, its
gradients are flattened into one buffer and all-reduced asynchronously, and the rest of the backward
runs meanwhile. ``finish`` waits and writes the sums back.

Written here rather than with DDP's own reducer because the executor's parameters are per-step leaves
feeding several stages' graphs (not one module's ``forward``), and DDP's communication hooks assume the
latter. As in DDP with ``gradient_as_bucket_view``, each gradient is a view of its bucket, so the
all-reduce needs no packing copies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autoshard.runtime.clock import StepClock

# DDP's sizes: 25 MiB buckets, few enough that each all-reduce's fixed cost is paid rarely; on a GPU the
# first bucket (the last layers' gradients, ready first) is 1 MiB so that communication starts early.
# On CPU (gloo) communication and backward share the cores, so overlapping them only slows backward:
# measured with benchmarks/dp.py (7 MiB of gradients, 2 cores, 30 steps), a 1 MiB first bucket stepped
# at 1.004-1.014x DDP's time and one 25 MiB bucket at 0.971-0.993x; 2 MiB buckets hid 43% of the
# all-reduce behind backward and stepped at 1.021x (dp=2) and 1.038x (dp=4).
# ``pm.bucket_bytes`` (DDP's ``bucket_cap_mb``) and ``pm.first_bucket_bytes`` change them.
DEFAULT_BUCKET_BYTES = 25 * 2**20
DEFAULT_FIRST_BUCKET_BYTES = 2**20          # on CUDA; on CPU the first bucket is as large as the others


@dataclass
class Bucket:
    names: list
    pending: int = 0
    stage: int = 0
    flat: torch.Tensor | None = None
    work: object = None


@dataclass
class GradReducer:
    """Sums the step's parameter gradients over the dp group, overlapped with the last backward. Built
    once per set of parameter leaves (its buckets, hooks and buffers serve every step)."""
    comm: object                          # the dp AxisComm
    leaves: dict                          # name -> the parameter's local leaf
    stage_params: dict                    # stage -> parameter names its graph reads (this rank's stages)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    first_bucket_bytes: int | None = None  # None: DEFAULT_FIRST_BUCKET_BYTES on CUDA, bucket_bytes on CPU
    buckets: list = field(default_factory=list)
    armed: set = field(default_factory=set)   # (stage, phase): phase None (all), "B" or "W" (split backward)
    waited: tuple | None = None           # (clock, start, end) of the last step's wait for the all-reduces
    late: frozenset = frozenset()         # names whose gradients a split schedule's W computes (the rest: B)

    def __post_init__(self):
        self._next, self._of = 0, {}
        first = self.first_bucket_bytes
        if first is None:
            on_cpu = all(t.device.type == "cpu" for t in self.leaves.values())
            first = self.bucket_bytes if on_cpu else DEFAULT_FIRST_BUCKET_BYTES
        owner = {}      # a parameter two of this rank's stages read is final after the lower stage's backward
        for stage in sorted(self.stage_params):
            for name in self.stage_params[stage]:
                owner.setdefault(name, stage)
        for stage in sorted(self.stage_params, reverse=True):      # last stage's backward comes first
            current, size, dtype = [], 0, None
            for name in reversed(self.stage_params[stage]):          # reverse graph order: ready first
                leaf = self.leaves[name]
                if owner[name] != stage or not leaf.requires_grad:
                    continue
                cap = min(first, self.bucket_bytes) if not self.buckets else self.bucket_bytes
                if current and (size >= cap or leaf.dtype != dtype):
                    self._add(stage, current)
                    current, size = [], 0
                current.append(name)
                size, dtype = size + leaf.numel() * leaf.element_size(), leaf.dtype
            if current:
                self._add(stage, current)
        self._views = {}
        self._hooks = [self.leaves[n].register_post_accumulate_grad_hook(self._ready(n)) for n in self._of]

    def begin_step(self, grads_still_held: bool) -> None:
        """Point every leaf's gradient at its zeroed slice of its bucket's flat buffer (DDP's
        ``gradient_as_bucket_view``): autograd accumulates into it in place, and the all-reduce runs on the
        buffer with no copies. The buffers are reused step after step, unless the parameters' ``.grad``
        from the last step (which alias them) are still held: then the step gets fresh ones."""
        self.armed.clear()
        self._next = 0
        for b in self.buckets:
            b.pending, b.work = len(b.names), None
            leaves = [self.leaves[n] for n in b.names]
            numel = sum(t.numel() for t in leaves)
            if b.flat is None or grads_still_held:
                b.flat = torch.zeros(numel, dtype=leaves[0].dtype, device=leaves[0].device)
            else:
                b.flat.zero_()
            offset = 0
            for n, t in zip(b.names, leaves):
                self._views[n] = t.grad = b.flat[offset:offset + t.numel()].view_as(t)
                offset += t.numel()

    def _add(self, stage, names):
        b = Bucket(list(names), len(names), stage)
        for n in names:
            self._of[n] = len(self.buckets)
        self.buckets.append(b)

    def arm(self, stage: int, phase: str | None = None) -> None:
        """The next backward of ``stage`` is its last in this step: its gradients are final after it. In a
        split (zero-bubble) schedule, ``phase`` "B" arms the gradients B computes (before the stage's last
        B) and "W" those its W computes (``late``, before the last W): each gradient counts once, at the
        accumulation that finishes it."""
        self.armed.add((stage, phase))

    def _ready(self, name):
        phase = "W" if name in self.late else "B"

        def hook(leaf):
            b = self.buckets[self._of[name]]
            if (b.stage, None) not in self.armed and (b.stage, phase) not in self.armed:
                return
            b.pending -= 1
            self._launch_ready()
        return hook

    def _launch_ready(self):
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            b = self.buckets[self._next]
            for n in b.names:   # a gradient autograd replaced instead of accumulating in place: copy it in
                if self.leaves[n].grad is not self._views[n]:
                    self._views[n].copy_(self.leaves[n].grad)
                    self.leaves[n].grad = self._views[n]
            b.work = self.comm.all_reduce_async(b.flat, "bwd")
            self._next += 1

    def finish(self) -> None:
        """Wait for every bucket (launching any whose gradients never all arrived: unused parameters keep
        their zeros, as on every other dp rank); the leaves' gradients are views of the summed buffers."""
        for b in self.buckets[self._next:]:
            b.pending = 0
        self._launch_ready()
        clock = StepClock(next(iter(self.leaves.values())).device)
        start = clock.mark()
        for b in self.buckets:
            if b.work is None:
                continue
            try:
                b.work.wait()
            except Exception as e:  # noqa: BLE001 - name the group, whatever the backend raised
                raise RuntimeError(f"the data-parallel gradient all-reduce (dp group of {self.comm.size} ranks, "
                                   f"this rank {self.comm.rank} in it) failed: {type(e).__name__}: "
                                   f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}. A dp peer probably "
                                   "raised or died: see its error") from e
        self.waited = (clock, start, clock.mark())

    def waited_seconds(self) -> float:
        """How long the last step's end waited for its all-reduces (the communication backward did not
        hide): host time on the CPU; on a GPU the compute stream's wait, read from CUDA events (NCCL's
        ``wait`` returns at once on the host, so a host clock would always say 0)."""
        if self.waited is None:
            return 0.0
        clock, start, end = self.waited
        return clock.seconds(end) - clock.seconds(start)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def local_batch(batch, mesh):
    """This dp rank's rows (dim 0) of a global batch: tensors are cut into ``dp`` equal contiguous slices,
    in dp-rank order; other values pass through. Every tp and pp rank of one replica gets the same rows.
    (With a ``DataLoader``, build its ``DistributedSampler`` from ``autoshard.data_parallel_rank``.)"""
    import torch.distributed as dist

    from autoshard.mesh import mesh_spec
    spec = mesh_spec(mesh)
    rank = spec.coords(dist.get_rank() if dist.is_initialized() else 0)["dp"]

    def cut(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        if x.shape[0] % spec.dp:
            raise ValueError(f"a global batch of {x.shape[0]} rows cannot be split over dp={spec.dp} ranks: use a "
                             f"multiple of {spec.dp}")
        n = x.shape[0] // spec.dp
        return x[rank * n:(rank + 1) * n]
    return torch.utils._pytree.tree_map(cut, batch)


def data_parallel_rank(mesh) -> tuple[int, int]:
    """``(rank, size)`` of this process among the data-parallel replicas: what ``DistributedSampler``'s
    ``rank`` and ``num_replicas`` must be (not the global rank and world size, which would give the tp and
    pp ranks of one replica different batches)."""
    from autoshard.mesh import mesh_spec
    spec = mesh_spec(mesh)
    return spec.coords(dist.get_rank() if dist.is_initialized() else 0)["dp"], spec.dp
