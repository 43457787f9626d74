"""Shared pytest configuration.

Multi-process (gloo) tests use ``tests.harness.distributed.run_distributed``; the repo
root is put on ``sys.path`` so ``from tests.harness.distributed import ...`` works
whether or not the package is installed.
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Keep CPU tests from oversubscribing the (small) CI machine; spawned ranks
# inherit this too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tests compare against single-device models on the CPU: on a GPU machine too they run on gloo
# (GPU checks are the benchmarks' job, one command each).
os.environ.setdefault("AUTOSHARD_BACKEND", "gloo")
# The generated kernels run in Triton's interpreter on the CPU. Triton reads TRITON_INTERPRET when
# triton.language is first imported (its library functions are jit-wrapped then), so it is set here, before
# any test module of a pytest worker can import it; set in the kernel tests' modules it was order-dependent.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor compiles its C++ kernels in the rank itself, not in a pool of worker processes per rank (each
# importing torch): test_inductor.py's tp=2 cases took 147 s against 169 s with cold caches
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Ranks fork from a server that imported these once (autoshard/launcher.py): HF's model modules and the
# harness cost a spawned rank ~5 s of CPU each time a module's pool starts.
os.environ.setdefault("AUTOSHARD_PRELOAD", ",".join([
    "torch._dynamo", "torch.export", "transformers", "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama", "tests.harness.models", "tests.harness.families",
    "tests.harness.parity_checks", "tests.harness.pipeline_checks"]))


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _fresh_rank_pool_per_module():
    """A test module's multi-process calls share one pool of ranks (``run_distributed``); the next module
    starts new ones, so what a module's calls leave in the ranks' heaps never slows another module."""
    yield
    from autoshard.launcher import close_pools
    close_pools()
