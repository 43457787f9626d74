"""Clusters as data: what a GPU computes, holds and sends, and over which link.

A ``Cluster`` is the planner's whole view of the hardware. Every number is per GPU:

- ``peak_flops``: dense bf16 tensor-core flop/s; ``gemm_efficiency(m, n, k)`` the fraction a GEMM of that
  shape reaches (large GEMMs run near ``gemm_max_efficiency``; a dimension near ``gemm_half_dim`` halves
  it, the way small tiles leave SMs idle);
- ``hbm_bytes`` and ``hbm_bandwidth``: memory and the rate memory-bound ops (norms, pointwise, the
  optimizer) run at;
- ``intra`` and ``inter``: the link a collective uses when its group stays inside a node (NVLink
  through NVSwitch) or crosses nodes (InfiniBand, one NIC per GPU on DGX machines), each as a per-GPU,
  per-direction bandwidth and a latency per ring step.

``Cluster.measure()`` fills the numbers in on the machine at hand, with GEMM, copy and collective
micro-benchmarks over the current process group (gloo or NCCL).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


# NCCL's channels over the SMs, and the HBM traffic a collective adds (see ``Cluster.comm_compute_share``):
# set from those counts, then checked on the only published rows it moves (benchmarks/planner.py), not
# tuned on them: 0.1, 0.2 and 0.3 keep Megatron Core's 11 H100 rows within 16.1, 13.6 and 11.2% (0:
# 18.9%; 0.3 would fit them best), the Llama 3 rows within 4.1% at each
NCCL_COMPUTE_SHARE = 0.2


@dataclass(frozen=True)
class Link:
    """One GPU's share of a link, per direction."""
    bandwidth: float          # bytes/s
    latency: float            # s per ring step (a message's fixed cost)


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    peak_flops: float               # dense bf16 flop/s of one GPU
    hbm_bytes: float                # memory of one GPU
    hbm_bandwidth: float            # bytes/s of one GPU's memory
    intra: Link                     # inside a node
    inter: Link                     # between nodes
    gemm_max_efficiency: float = 0.8
    gemm_half_dim: float = 64.0
    usable_memory: float = 0.9      # of hbm_bytes: the rest is the allocator's, NCCL's and cuBLAS's workspace
    # seconds each op costs beyond its work: Python, dispatch and autograd on a CPU host. A GPU runs its
    # queue while the host launches ahead, so the presets leave it at 0
    op_overhead: float = 0.0
    # ranks sharing one compute unit: a CPU host running more ranks (x threads) than it has cores. The
    # measured rates are each rank's share under that contention; a rank that waits (a pipeline bubble)
    # lends its core to the others, so its neighbours run ``oversubscription`` times faster meanwhile.
    # 1 on a GPU cluster (one rank a GPU)
    oversubscription: float = 1.0
    # elements/s of a transcendental function (the erf of GeLU, the exp of softmax). A GPU computes them
    # under the memory traffic (inf); a CPU core is slower at them than at streaming the bytes
    transcendental_rate: float = math.inf
    # the host launches ahead of the device (a GPU's stream): an op's overhead hides under the device's
    # work, and a layer costs the longer of the two instead of their sum (a CPU host does both in turn)
    launch_ahead: bool = False
    # the process groups' backend: the runtime sends a tp-replicated pipeline boundary as tp slices where
    # ``scatter_gather_pays(backend)`` (NCCL), and the planner prices its transfers the same way
    backend: str = "nccl"
    # the share of a GPU's compute a collective running beside it takes: compute that hides T seconds of
    # communication runs this share of T longer. NCCL runs a collective as a thread block per channel
    # (16-32 channels on an A100's 108 or an H100's 132 SMs) and its bytes share HBM with the GEMMs:
    # about a fifth. None: ``NCCL_COMPUTE_SHARE`` on NCCL, 0 on gloo (a CPU host's ranks that share
    # cores hide nothing at all: ``oversubscription``)
    comm_compute_share: float | None = None
    source: str = ""
    # the dtype the GEMMs' rate is of and the activations are held in: "bf16" on the presets (their peak is
    # the tensor cores' bf16; ``Plan.parallelize_options`` then asks for ``mixed_precision="bf16"``), the
    # measured dtype for ``measure()`` ("fp32" on a CPU host, whose ranks train in fp32)
    compute_dtype: str = "bf16"
    # False when ``measure()`` ran in one process: no collective was timed, the links are placeholders
    links_measured: bool = True

    def __post_init__(self):
        _check_cluster(self)
        if self.comm_compute_share is None:
            object.__setattr__(self, "comm_compute_share", NCCL_COMPUTE_SHARE if self.backend == "nccl" else 0.0)

    def gemm_efficiency(self, m: float, n: float, k: float) -> float:
        """The fraction of ``peak_flops`` a GEMM of (m x k) @ (k x n) reaches: ``gemm_max_efficiency``
        for large dims, less as any dim nears ``gemm_half_dim`` (each dim a factor x / (x + half))."""
        e = self.gemm_max_efficiency
        for x in (m, n, k):
            e *= x / (x + self.gemm_half_dim)
        return e

    def gemm_seconds(self, m: float, n: float, k: float, count: float = 1.0) -> float:
        """Seconds of ``count`` GEMMs of (m x k) @ (k x n)."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        return count * 2.0 * m * n * k / (self.peak_flops * self.gemm_efficiency(m, n, k))

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element in ``compute_dtype``."""
        return 2 if self.compute_dtype in ("bf16", "fp16") else 4

    def link(self, group_size: int, stride: int, world: int | None = None) -> Link:
        """The link a group of ``group_size`` ranks, ``stride`` ranks apart, runs its collectives on: inside
        a node when every member of every such group shares one, else between nodes. The groups tile the
        ``world`` ranks in blocks of ``group_size x stride`` (``init_mesh``'s layout: tp fastest, then pp,
        then dp); where a node's GPUs are not a multiple of the block and the world spans more than one
        node, some block straddles two nodes (tp=3 on 8-GPU nodes: ranks 6, 7 and 8), and that group, the
        slowest, paces the step. ``world`` None: as many ranks as to span nodes."""
        block = group_size * stride
        if block > self.gpus_per_node:
            return self.inter
        one_node = world is not None and world <= self.gpus_per_node
        return self.intra if one_node or self.gpus_per_node % block == 0 else self.inter

    def with_(self, **changes) -> "Cluster":
        """A copy with some numbers changed (a faster network, a smaller node): what-if planning."""
        return dataclasses.replace(self, **changes)

    @staticmethod
    def measure(name: str = "measured", sizes=None, dtype: torch.dtype | None = None,
                collective_bytes=(2**12, 2**16, 2**20, 2**22, 2**24), repeats: int = 7) -> "Cluster":
        """This machine's numbers: GEMM throughput over ``sizes`` (fitting the efficiency curve), a large
        copy (memory bandwidth), and, in a process group of several ranks, all-reduces over
        ``collective_bytes`` (fitting latency and bandwidth with the ring formula). Every rank of the
        group must call it. One host: the intra-node and inter-node links are the same link."""
        cuda = torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() == "nccl")
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
        # a GPU's GEMMs under about 1024 are mostly a kernel's fixed cost (timed on the device, an H100's
        # 1024 cube ran at 347 TFLOP/s, its 4096 one at 783): its curve is measured up to 8192
        sizes = sizes or ((256, 512, 1024, 2048, 4096, 8192) if cuda else (64, 128, 256, 512, 1024))
        # cubes, thin GEMMs (a small inner dim), and an attention core's (s, s, head_dim). Nothing under
        # ``sizes[0]``/2: a tiny GEMM's time is the op overhead, which the planner prices on its own
        shapes = ([(n, n, n) for n in sizes] + [(sizes[-1], sizes[-1], k) for k in sizes[:2]]
                  + [(sizes[0], sizes[0], sizes[0] // 2)])
        rates = [(shape, _gemm_rate(shape, dtype, device, repeats)) for shape in shapes]
        overhead = _launch_overhead(device, repeats) if cuda else _op_overhead(repeats)
        peak, half, top = _fit_gemm(rates, min_seconds=KERNEL_FIXED_SECONDS if cuda else 0.0)
        hbm_bw = _copy_rate(device, repeats)
        transcendental = math.inf if cuda else _transcendental_rate(repeats)
        if cuda:
            hbm = torch.cuda.get_device_properties(device).total_memory
        else:
            hbm = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            link = _fit_link([(n, _all_reduce_seconds(n, device, repeats)) for n in collective_bytes], world)
        else:
            link = Link(bandwidth=hbm_bw, latency=1e-6)
        oversub = 1.0
        if not cuda:
            hbm = hbm / world            # the ranks of one host share its memory
            oversub = max(1.0, world * torch.get_num_threads() / _cores())
        draft = Cluster(name, gpus_per_node=world, peak_flops=peak, hbm_bytes=float(hbm), hbm_bandwidth=hbm_bw,
                        intra=link, inter=link, gemm_max_efficiency=top, gemm_half_dim=half, op_overhead=overhead,
                        oversubscription=oversub, transcendental_rate=transcendental, launch_ahead=cuda,
                        backend="nccl" if cuda else "gloo", links_measured=world > 1, compute_dtype=_DTYPE_NAMES.get(dtype, str(dtype)),
                        source=f"measured on {device.type} ({dtype}), {world} rank(s), {time.strftime('%Y-%m-%d')}")
        measured = [draft if cuda else _calibrated_on_a_layer(draft, repeats)]
        if world > 1:      # one cluster for every rank (rank 0's numbers), so every rank plans the same mesh
            dist.broadcast_object_list(measured, src=0)
        return measured[0]


def _calibrated_on_a_layer(cluster: Cluster, repeats: int, hidden: int = 256, seq: int = 128,
                           batch: int = 4) -> Cluster:
    """``cluster`` with its GEMM efficiency set from one real transformer layer (the built-in GPT's block,
    forward and backward, eager) instead of cubes alone: a layer's GEMMs are thin and transposed, and its
    norms, softmax and adds run between them, so on a CPU it reached 12-13% less than the cube fit said
    (in one process, hidden 128-256). The layer's predicted time without op overhead, over its measured
    time less the overhead the planner adds, scales ``gemm_max_efficiency`` (a layer of this size is
    mostly GEMMs). Timed on every rank at once, as the GEMMs were: a shared host's contention counts."""
    from autoshard.models.gpt import Block, GPTConfig
    from autoshard.planner.cost import OPS_PER_LAYER, Candidate, _layer_seconds
    from autoshard.planner.config_reading import model_shape
    cfg = GPTConfig(n_embd=hidden, n_head=4, block_size=seq, dropout=0.0, n_layer=1, vocab_size=256)
    with torch.random.fork_rng(devices=[]):     # the caller's RNG stays where it was
        torch.manual_seed(0)
        block = Block(cfg)
        x = torch.randn(batch, seq, hidden, requires_grad=True)
    measured = _timed(lambda: block(x).sum().backward(), torch.device("cpu"), repeats)
    shape, c = model_shape(cfg), Candidate(1, 1, 1, batch, 1)
    compute = 3 * _layer_seconds(shape, cluster.with_(op_overhead=0.0), c, batch * seq, cfg.flash).forward
    work = measured - 3 * OPS_PER_LAYER * cluster.op_overhead
    scale = min(1.0, max(0.2, compute / work)) if work > 0 else 1.0
    return cluster.with_(gemm_max_efficiency=cluster.gemm_max_efficiency * scale)


def _cores() -> int:
    """The cores this process may run on (its affinity mask, which a container's CPU set limits)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats: int, at_least: float = 0.05) -> float:
    """Seconds of one ``fn()``: the median of ``repeats`` loops, each long enough (``at_least`` seconds)
    to be timed. In a process group every loop starts and ends together on every rank (a barrier on
    each side, the slowest rank's time), so ranks sharing a host's cores or memory measure under the
    contention a step runs under."""
    together = dist.is_initialized() and dist.get_world_size() > 1
    fn()
    # ``calls`` doubles until a loop lasts a quarter of ``at_least`` on the slowest rank. Every rank runs
    # the same loops: ``fn`` may be a collective, and a rank that stopped early would lend its core
    calls = 1
    while True:
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        if together:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if float(elapsed) >= at_least / 4:
            break
        calls *= 2
    calls = max(1, round(calls * at_least / max(float(elapsed), 1e-9)))
    seconds = []
    for _ in range(repeats):
        if together:
            dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        if together:
            dist.barrier()
        seconds.append((time.perf_counter() - start) / calls)
    return sorted(seconds)[len(seconds) // 2]


# A GPU kernel shorter than this measures its fixed start-up and tail, not its throughput, which the
# x / (x + half) curve cannot follow: such GEMMs stay out of the fit (the planner prices a small op by
# the host's launch, ``op_overhead``, where that is longer than its device time)
KERNEL_FIXED_SECONDS = 10e-6


def _gemm_rate(shape, dtype, device, repeats) -> float:
    m, n, k = shape
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    timer = _device_seconds if device.type == "cuda" else _timed
    return 2.0 * m * n * k / max(timer(lambda: a @ b, device, repeats), 1e-12)


def _device_seconds(fn, device, repeats: int, calls: int = 16) -> float:
    """Seconds of one ``fn()`` on the GPU alone: ``calls`` of it captured in a CUDA graph, replayed and
    timed with events (the median of ``repeats``). Timed from the host back to back, a GEMM up to about
    1024 cubed measures the host's launch, not the device (an H100's 1024-cube GEMM ran at 110-140
    TFLOP/s that way), and how much of it depended on the host's speed that day: one session's fit
    read 733 TFLOP/s peak, the next one's 2956 from the same GEMMs, whose 1024 cube crossed the
    launch-bound threshold by 1 us."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):          # warm up (cuBLAS picks its kernel) outside the capture
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(seconds)[len(seconds) // 2]


def _fit_gemm(rates, min_seconds: float = 0.0) -> tuple:
    """(peak, half_dim, max_efficiency) of ``rate = peak * prod(x / (x + half))``, fitted in log space
    (each half dim's best peak is the geometric mean of rate / curve; the half dim with the least
    squared log error wins). A measured cluster's peak is the rate its GEMMs tend to: efficiency 1.

    ``min_seconds``: a GEMM faster than this measures fixed costs, not throughput
    (``KERNEL_FIXED_SECONDS`` on a GPU), so it is left out of the fit (the largest three always stay in)."""
    timed = sorted(rates, key=lambda sr: 2.0 * math.prod(sr[0]) / sr[1])
    kept = [sr for sr in timed if 2.0 * math.prod(sr[0]) / sr[1] >= min_seconds]
    rates = kept if len(kept) >= 3 else timed[-3:]
    best = None
    for half in (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):   # a GPU's half dim is in the hundreds
        curve = [math.prod(x / (x + half) for x in shape) for shape, _ in rates]
        logs = [math.log(r / c) for (_, r), c in zip(rates, curve)]
        peak = math.exp(sum(logs) / len(logs))
        err = sum((v - math.log(peak)) ** 2 for v in logs)
        if best is None or err < best[0]:
            best = (err, half, peak)
    return best[2], float(best[1]), 1.0


def _copy_rate(device, repeats, numel: int = 2**24) -> float:
    x = torch.ones(numel, dtype=torch.float32, device=device)      # touched: no zero pages
    y = torch.zeros_like(x)
    return 2.0 * x.numel() * x.element_size() / max(_timed(lambda: y.copy_(x), device, repeats), 1e-12)


def _transcendental_rate(repeats, numel: int = 2**18) -> float:
    """Elements/s of an exact (erf) GeLU forward on a CPU core: the planner's rate for the activation's
    and the attention softmax's elements."""
    import torch.nn.functional as F
    x = torch.ones(numel)
    return numel / max(_timed(lambda: F.gelu(x), torch.device("cpu"), repeats), 1e-12)


def _op_overhead(repeats, blocks: int = 50) -> float:
    """Seconds per op of a chain of tiny layer-like ops (a linear, a norm, a GeLU, a residual add) with
    autograd, forward and backward: what each op of a step costs the host whatever its size."""
    import torch.nn.functional as F
    x = torch.ones(2, 8, requires_grad=True)
    w = torch.ones(8, 8, requires_grad=True)

    def chain():
        y = x
        for _ in range(blocks):
            y = y + F.gelu(F.layer_norm(F.linear(y, w), (8,)))
        y.sum().backward()
    return _timed(chain, torch.device("cpu"), repeats) / (3 * 4 * blocks)   # a backward op costs about two forward ones


def _launch_overhead(device, repeats) -> float:
    """Seconds the host spends to launch one tiny op on ``device`` (Python, dispatch, the launch), timed
    back to back: a device runs such an op faster than the host can hand it the next."""
    x = torch.zeros(1, device=device)
    return _timed(lambda: x.add_(1), device, repeats)


def _all_reduce_seconds(nbytes: int, device, repeats) -> float:
    """Seconds of one all-reduce of ``nbytes``: back-to-back calls timed together (``_timed``: the median
    of ``repeats`` loops, each between barriers), so a step's usual scheduling delays are in it and one
    lucky or unlucky call is not; the slowest rank's, so every rank fits the same link."""
    x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    seconds = _timed(lambda: dist.all_reduce(x), device, repeats)
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def _fit_link(samples, world: int) -> Link:
    """Latency and bandwidth from all-reduce times, by least squares on the ring model
    ``t = 2(n-1) * latency + 2(n-1)/n * bytes / bandwidth``."""
    steps, share = 2 * (world - 1), 2 * (world - 1) / world
    xs = [share * nbytes for nbytes, _ in samples]
    ys = [seconds for _, seconds in samples]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-30)
    largest = max(range(n), key=lambda i: xs[i])
    floor = ys[largest] / xs[largest]           # seconds per byte if the largest message paid no latency
    slope = slope if slope > 0 else floor       # timing noise can tilt the fit flat or negative
    intercept = max(my - slope * mx, 0.0)
    return Link(bandwidth=1.0 / slope, latency=intercept / steps)


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _check_cluster(c: Cluster) -> None:
    """A ``Cluster``'s numbers must be physical: a zero or negative rate would price a step at nothing, or
    below nothing, and rank it first."""
    def positive(name, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
            raise ValueError(f"Cluster {c.name!r}: {name}={value!r}; give a positive number")
    positive("gpus_per_node", c.gpus_per_node)
    if int(c.gpus_per_node) != c.gpus_per_node:
        raise ValueError(f"Cluster {c.name!r}: gpus_per_node={c.gpus_per_node!r}; give a whole number")
    # gemm_max_efficiency may pass 1: measure() calibrates it on a whole layer's time; gemm_half_dim may
    # be 0 (a flat curve)
    for name in ("peak_flops", "hbm_bytes", "hbm_bandwidth", "gemm_max_efficiency", "usable_memory",
                 "oversubscription", "transcendental_rate"):
        positive(name, getattr(c, name))
    if not isinstance(c.gemm_half_dim, numbers.Real) or c.gemm_half_dim < 0:
        raise ValueError(f"Cluster {c.name!r}: gemm_half_dim={c.gemm_half_dim!r}; give a size, 0 or more")
    if c.usable_memory > 1:
        raise ValueError(f"Cluster {c.name!r}: usable_memory={c.usable_memory!r} is a fraction; give one in (0, 1]")
    for name in ("intra", "inter"):
        link = getattr(c, name)
        if not isinstance(link, Link):
            raise ValueError(f"Cluster {c.name!r}: {name}={link!r}; give a planner.Link(bandwidth, latency)")
        positive(f"{name}.bandwidth", link.bandwidth)
        if not isinstance(link.latency, numbers.Real) or link.latency < 0:
            raise ValueError(f"Cluster {c.name!r}: {name}.latency={link.latency!r}; give seconds, 0 or more")
    if not isinstance(c.op_overhead, numbers.Real) or c.op_overhead < 0:
        raise ValueError(f"Cluster {c.name!r}: op_overhead={c.op_overhead!r}; give seconds, 0 or more")
    if c.compute_dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"Cluster {c.name!r}: compute_dtype={c.compute_dtype!r}; give 'bf16', 'fp16' or 'fp32'")


# --- presets -------------------------------------------------------------------------------------------
DGX_A100 = Cluster(
    "dgx-a100", gpus_per_node=8, peak_flops=312e12, hbm_bytes=80e9, hbm_bandwidth=2.039e12,
    # NVLink 3 through NVSwitch: 600 GB/s per GPU, both directions together; 8 x 200 Gb/s HDR
    # InfiniBand per node, one NIC per GPU: 25 GB/s per GPU per direction
    intra=Link(230e9, 5e-6), inter=Link(23e9, 10e-6),
    gemm_max_efficiency=0.75, gemm_half_dim=64.0,
    source="NVIDIA A100 datasheet (312 TFLOP/s dense BF16, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s); "
           "DGX A100 user guide (8 x ConnectX-6 HDR 200 Gb/s); large bf16 GEMMs reach about 80% of peak "
           "(cuBLAS, as Megatron-LM's SC'21 paper measures for its GEMMs)")

DGX_H100 = Cluster(
    "dgx-h100", gpus_per_node=8, peak_flops=989e12, hbm_bytes=80e9, hbm_bandwidth=3.35e12,
    # NVLink 4 through NVSwitch: 900 GB/s per GPU, both directions together; 8 x 400 Gb/s NDR
    # InfiniBand per node, one NIC per GPU: 50 GB/s per GPU per direction
    intra=Link(450e9, 5e-6), inter=Link(50e9, 10e-6),
    gemm_max_efficiency=0.75, gemm_half_dim=96.0,
    source="NVIDIA H100 SXM datasheet (989 TFLOP/s dense BF16, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s); "
           "DGX H100 user guide (8 x ConnectX-7 NDR 400 Gb/s); large bf16 GEMMs reach about 75% of peak "
           "on H100 (cuBLAS; the Llama 3 paper reports 38-43% MFU for whole steps)")

PRESETS = {c.name: c for c in (DGX_A100, DGX_H100)}


def cluster_named(name) -> Cluster:
    """A preset by name (``dgx-a100``, ``dgx-h100``), or the ``Cluster`` given."""
    if isinstance(name, Cluster):
        return name
    try:
        return PRESETS[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown cluster {name!r}: presets are {sorted(PRESETS)}, or pass a Cluster "
                         "(autoshard.planner.Cluster(...) or Cluster.measure())") from None
