"""Benchmarks of autoshard against hand-written parallelism and torch's own: tensor (``benchmarks.tp``,
Megatron-Core and DTensor), pipeline (``benchmarks.pp``, torch.distributed.pipelining), data parallel
(``benchmarks.dp``, DDP), a rank's whole step (``benchmarks.step``, eager and torch.compile), and the
kernels, the chunked loss and recompute. Speed and memory only: correctness is the tests'."""
