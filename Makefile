# Each target sets up what it needs from requirements/*.lock. `make help` lists them.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PIP     = $(1)/bin/python -m pip install --quiet --disable-pip-version-check
EXTRAS := triton,peft,analysis,quant,gguf,kernels,dev
IMPORTS := import torch, transformers, gated_qwen, peft, triton, hypothesis, matplotlib, scipy, optimum.quanto, torchao, gguf, kernels
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
NOW = $(shell date +%Y%m%d-%H%M%S)
LOCK    := requirements/$(if $(HAS_GPU),cuda,cpu).lock
# Off this machine: TORCH_INDEX=--extra-index-url=https://download.pytorch.org/whl/cpu (torch's +cpu build)
TORCH_INDEX ?=
QUIET := 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
PYTEST = $(1)/bin/python -m pytest -q -n 2 --dist loadfile
RUN_PYTEST = $(1)/bin/python -m pytest -q -p no:cacheprovider
EDITABLE = $(call PIP,$(1)) --no-deps --no-build-isolation -e . $(QUIET)
SH = PYTHON=$(PYTHON) TORCH_INDEX="$(TORCH_INDEX)" EXTRAS=$(EXTRAS) bash

.PHONY: $(shell sed -n 's/^## \([a-z-]*\).*/\1/p' Makefile requirements/environments.mk)

## help              this list
help:
	@sed -n 's/^## /make /p' $(MAKEFILE_LIST)

## setup             .venv from cpu.lock (cuda.lock where nvidia-smi answers)
setup: $(STAMP)
$(STAMP): $(LOCK) pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call PIP,$(VENV)) $(TORCH_INDEX) -r $(LOCK) $(QUIET)
	$(call EDITABLE,$(VENV))
	$(PY) -c "$(IMPORTS)"
	touch $(STAMP)

## test              the suite but the tests marked slow or compat
test: $(STAMP)
	$(call PYTEST,$(VENV)) -m "not slow and not compat"

## test-order        each test file alone, then all in reverse order (FILES=PATH: its)
test-order: $(STAMP)
	bash tests/order.sh $(PY) $(FILES)

## test-slow         the tests marked slow
test-slow: $(STAMP)
	$(call PYTEST,$(VENV)) -m "slow and not compat"

## test-latest       the suite with the newest releases pyproject.toml allows
test-latest:
	IMPORTS="$(IMPORTS)" $(SH) requirements/latest.sh
	$(call PYTEST,.venv-latest) -m "not compat"

## lint              ruff
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

## lock              rewrites cpu.lock, cuda.lock and compat.lock; then make test
## demo              the paper's claims in miniature into runs/demo-DATE (JOBS=N)
demo: $(STAMP)
	$(VENV)/bin/gated-qwen reproduce $(if $(JOBS),--jobs $(JOBS)) --out runs/demo-$(NOW)

## confirm           the confirmatory run on seeds outside benchmarks/reproduce/seeds.json into runs/confirm-DATE
confirm: $(STAMP)
	@$(VENV)/bin/python benchmarks/reproduce/seeds.py --check confirm
	$(VENV)/bin/gated-qwen reproduce --preset confirm $(if $(JOBS),--jobs $(JOBS)) --out runs/confirm-$(NOW)

## gpu-check         the kernel's correctness and speed on a CUDA GPU
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py --out runs/gpu-check-$(NOW)

## kernel-repo       build/kernel-repo: the Hub kernel
kernel-repo: $(STAMP)
	$(PY) -m gated_qwen.integrations.kernel_hub build/kernel-repo --overwrite

## device-wheels     the wheels the GPU machine lacks
DW := .device-wheels
device-wheels: $(DW)/.complete
$(DW)/.complete: requirements/device-wheels.txt benchmarks/device_wheels.sh
	$(SH) benchmarks/device_wheels.sh $(DW)

# test-NAME and .venv-NAME for the other environments: their recipes beside their locks
include requirements/environments.mk

## bench-serving     tokens/s: vLLM (native folder, Qwen3.5 export) vs generate
bench-serving: $(STAMP) .venv-serving/.installed
	rm -rf runs/bench-serving && $(PY) benchmarks/serving_speed.py build runs/bench-serving
	.venv-serving/bin/python benchmarks/serving_speed.py run runs/bench-serving --generate-python $(PY) --repeats 2

## bench-local       tokens/s: generate vs llama.cpp, MLX and ONNX Runtime
bench-local: $(STAMP) .venv-llama/.installed .venv-mlx/.installed .venv-onnx/.installed
	rm -rf runs/bench-local && .venv-onnx/bin/python benchmarks/local_speed.py build runs/bench-local
	$(PY) benchmarks/local_speed.py run runs/bench-local --repeats 7 --threads 1

## bench-real-size   every command on the paper's 1B and 1.7B shapes (RESULTS.md)
bench-real-size: $(STAMP) .venv-onnx/.installed
	nice -n 19 .venv-onnx/bin/python benchmarks/real_size.py 1b 1.7b

## lock-serving      rewrites serving-cpu.lock; then make test-serving
## lock-distributed  rewrites distributed-cpu.lock; then make test-distributed
lock lock-serving lock-distributed:
	$(SH) requirements/lock.sh $@

## clean             removes environments and builds
clean:
	rm -rf .venv* $(dir $(JS)) $(DW) build src/*.egg-info .pytest_cache .hypothesis
