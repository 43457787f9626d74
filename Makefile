PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv demo test bench clean

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

demo: venv
	$(BIN)/torchrun --standalone --nproc_per_node=2 -m autoshard.demo

test: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

bench: venv $(VENV)/.bench-installed
	$(BIN)/python -m benchmarks.tp

clean:
	rm -rf build/ *.egg-info/ .pytest_cache/ dumps/ autoshard_dump/ benchmarks/out/
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
