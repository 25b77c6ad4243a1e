# k3export: one command for the main job (`make demo`) and one for the tests (`make test`); each sets itself up.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
OUT     ?= out
STAMP   := $(VENV)/.installed

.PHONY: setup demo test test-fast test-gpu bench-gpu clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 is a local CPU wheel here; the GPU machine brings its own torch 2.11 (both satisfy the pin).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev,onnx,plot,triton]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/k3export demo --out $(OUT)/demo

# Two pytest workers (pytest-xdist), one per core of the CI machine: 8m58s instead of 12m49s for the suite on 2
# cores (2026-12-02); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow"

# On the GPU machine (device tool): runs the cuda-marked tests and the benchmarks with the image's python3.
test-gpu:
	bash scripts/gpu.sh test

bench-gpu:
	bash scripts/gpu.sh bench

clean:
	rm -rf $(OUT) .pytest_cache
