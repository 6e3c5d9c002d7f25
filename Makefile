# `make test` and `make demo` set everything up on a fresh machine (a .venv in this folder), then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check

# On a machine with an NVIDIA GPU take the default (CUDA) torch; everywhere else the CPU build that pip
# finds on local disk (asking for any other version would pull a multi-GB CUDA build).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH   := $(if $(HAS_GPU),torch,torch==2.13.0)

.PHONY: setup test test-fast demo lint clean gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH)" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
	$(PIP) -e ".[triton,peft,analysis,dev]" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
	$(PY) -c "import torch, transformers, gated_qwen, peft, triton, hypothesis, matplotlib"
	touch $(STAMP)

# Two worker processes (pytest-xdist), one file each at a time, one thread each (tests/conftest.py).
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile

test: $(STAMP)
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

# Each run writes a new folder, so a second `make demo` never meets (or overwrites) the first one's results.
demo: $(STAMP)
	$(VENV)/bin/gated-qwen reproduce --out runs/demo-$(shell date +%Y%m%d-%H%M%S)

# On a lent CUDA GPU: correctness over the kernel grid, TFLOP/s vs SDPA + gate, end-to-end gated_triton vs sdpa
# (at most 8 minutes on an H200); results.json and results.md in a new folder.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py --out runs/gpu-check-$(shell date +%Y%m%d-%H%M%S)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
