PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv demo demo-tp demo-pp test test-fast bench bench-pp bench-fusion gpu-check gpu-session clean

venv: $(VENV)/.installed

# torch==2.13.0 goes in first: the CPU wheel on disk satisfies it, so the
# editable install below finds torch already present and never pulls a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]'
	touch $@

$(VENV)/.bench-installed: $(VENV)/.installed
	$(BIN)/pip install -e '.[bench]'
	touch $@

# the whole mesh: dp=2 x pp=2 (x tp=1) over 4 CPU processes, ZeRO-1, a checkpoint halfway
demo: venv
	$(BIN)/torchrun --standalone --nproc_per_node=4 -m autoshard.demo --dp 2 --pp 2 --zero 1 --save autoshard_checkpoint

# tensor parallelism alone: tp=2 over 2 CPU processes
demo-tp: venv
	$(BIN)/torchrun --standalone --nproc_per_node=2 -m autoshard.demo

# the pipeline on a 2 x 2 mesh: 2 stages, each tensor-parallel over 2 ranks (4 CPU processes)
demo-pp: venv
	$(BIN)/torchrun --standalone --nproc_per_node=4 -m autoshard.demo --pp 2 --tp 2 --steps 20

# two pytest workers (pytest-xdist), each given whole test files so a file's tests share their ranks
# (tests/conftest.py); TEST_JOBS=0 runs them in pytest's own process
TEST_JOBS ?= 2
test: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=15

# the inner loop: the single-process tests only (unit and thread-simulated ranks)
test-fast: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile tests/unit tests/simulated

bench: venv $(VENV)/.bench-installed
	$(BIN)/python -m benchmarks.tp

bench-pp: venv
	$(BIN)/python -m benchmarks.pp

clean:
	rm -rf build/ *.egg-info/ .pytest_cache/ dumps/ autoshard_dump/ autoshard_checkpoint/ autoshard_plan/ benchmarks/out/
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

# on a GPU machine: parity with the single-device model on CUDA and NCCL, 1 to 8 GPUs (tests/gpu_check.py)
gpu-check: venv
	$(BIN)/python -m tests.gpu_check

# on a lent GPU machine with its own torch and no internet: every GPU check and benchmark, in one short run
gpu-session:
	bash benchmarks/gpu_session.sh

# fusion: bytes per pattern everywhere; kernel timings against eager and torch.compile on a GPU
bench-fusion: venv
	$(BIN)/python -m benchmarks.fusion
