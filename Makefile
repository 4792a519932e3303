# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned: the CPU wheel 2.13.0. A GPU user installs their CUDA
# build of torch 2.13 into .venv before running make (see README).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the reference implementation, used by parity tests and export checks
	$(BIN)/pip install -q --no-deps dflash==0.1.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dflash-train demo --config configs/cpu-demo.yaml

# one intra-op thread per process: the tests run tiny models in several threads
# and subprocesses at once, where oversubscribed cores cost far more than they give
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV)
