# The environments beside the main one, each built from its locks in this folder (included by the Makefile).
# .venv-NAME: NAME_VENV, pip NAME_PIP -r NAME_LOCKS NAME_FLAGS, NAME_SETUP, the package (unless NAME_BARE), a check
# of NAME_IMPORTS. test-NAME: NAME_TESTS, or NAME_ENV pytest tests/engine_NAME.
define ENVIRONMENT
.venv-$(1)/.installed: $$($(1)_LOCKS) $$(if $$($(1)_BARE),,pyproject.toml Makefile requirements/environments.mk) $$($(1)_NEEDS)
	$$(or $$($(1)_VENV),test -x .venv-$(1)/bin/python || $$(PYTHON) -m venv .venv-$(1))
	$$(call PIP,.venv-$(1)) $$($(1)_PIP) $$(TORCH_INDEX) $$(foreach l,$$($(1)_LOCKS),-r $$(l)) $$($(1)_FLAGS) $$(QUIET)
	$$($(1)_SETUP)
	$$(if $$($(1)_BARE),,$$(call EDITABLE,.venv-$(1)))
	.venv-$(1)/bin/python -c "$$($(1)_IMPORTS)"
	touch $$@
endef
define TESTS
test-$(1): $$(or $$($(1)_TEST_NEEDS),.venv-$(1)/.installed)
	$$(or $$($(1)_TESTS),$$($(1)_ENV) $$(call RUN_PYTEST,.venv-$(1)) tests/engine_$(1))
endef

## test-compat       the kernel's tests in the GPU machine's image, on this CPU
compat_VENV = rm -rf .venv-compat && $(PYTHON) -m venv .venv-compat
compat_LOCKS = requirements/compat.lock
compat_BARE = 1
compat_IMPORTS = import torch, triton, transformers, huggingface_hub
compat_TEST_NEEDS = .venv-compat/.installed $(DW)/.complete requirements/compat_tests.sh
compat_TESTS = bash requirements/compat_tests.sh $(DW)

## test-serving      vLLM against Transformers (COMPAT_PYTHON=PATH: also its)
# --no-deps: the index's CUDA torchaudio/torchcodec stay out.
serving_LOCKS = requirements/serving-cpu.lock
serving_NEEDS = requirements/serving_torchvision_ops.py requirements/serving_setup.sh
serving_PIP = --no-deps
serving_SETUP = bash requirements/serving_setup.sh
serving_IMPORTS = import vllm.model_executor.models.qwen3_5, vllm.entrypoints.openai.api_server, pytest, openai, gated_qwen.integrations.vllm_plugin
serving_TEST_NEEDS = $(STAMP) .venv-serving/.installed
serving_TESTS = COMPAT_PYTHON=$(COMPAT_PYTHON) bash requirements/serving_tests.sh

## test-distributed  DDP, FSDP2, ZeRO-2/3 and tensor parallelism on 2 CPU processes
distributed_LOCKS = requirements/cpu.lock
distributed_NEEDS = requirements/distributed-cpu.lock
distributed_SETUP = DS_BUILD_OPS=0 $(call PIP,.venv-distributed) --no-deps --no-build-isolation -r $(distributed_NEEDS) $(QUIET)
distributed_IMPORTS = import deepspeed, accelerate, gated_qwen
distributed_TESTS = $(call PYTEST,.venv-distributed) tests/distributed tests/integrations/test_accelerate.py \
	tests/integrations/test_distributed.py

## test-llama        llama.cpp against Transformers (builds llama-cpp-python once)
LL := .venv-llama
LLAMA_VERSION = $(shell sed -n 's/^llama-cpp-python==//p' requirements/llama.lock)
llama_LOCKS = requirements/cpu.lock requirements/llama.lock
llama_NEEDS = | $(LL)/wheels/.built-$(LLAMA_VERSION)
llama_FLAGS = --find-links $(LL)/wheels --only-binary llama-cpp-python
llama_IMPORTS = import llama_cpp, gguf, gated_qwen; assert llama_cpp.__version__ == '$(LLAMA_VERSION)'
$(LL)/wheels/.built-%:
	$(SH) requirements/llama_wheel.sh $*

## test-mlx          mlx-lm against Transformers
mlx_LOCKS = requirements/cpu.lock requirements/mlx.lock
mlx_IMPORTS = import mlx.core, mlx_lm, gated_qwen

## test-onnx         ONNX Runtime, Optimum, Transformers.js against Transformers
onnx_LOCKS = requirements/cpu.lock requirements/onnx.lock
onnx_IMPORTS = import onnx, onnxruntime, onnxruntime.quantization, gated_qwen
onnx_ENV = GATED_QWEN_OPTIMUM_PYTHON=$(CURDIR)/.venv-optimum/bin/python
onnx_TEST_NEEDS = .venv-onnx/.installed .venv-optimum/.installed $(JS)
# Optimum needs Transformers < 4.58 (no gated-qwen); npm's install scripts would fetch GPU libraries.
optimum_LOCKS = requirements/optimum.lock
optimum_BARE = 1
optimum_IMPORTS = import optimum.onnxruntime, transformers; assert transformers.__version__ == '4.57.6'
JS := tests/engine_onnx/js/node_modules/.installed
$(JS): tests/engine_onnx/js/package-lock.json
	cd tests/engine_onnx/js && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
	touch $(JS)

## test-megatron     Megatron-core both ways, tensor parallel 1 and 2
## test-olmo         OLMo-core both ways
## test-torchtitan   torchtitan reads the Qwen3.5 export
## test-engines      the three above
test-engines: test-megatron test-olmo test-torchtitan
megatron_LOCKS = requirements/cpu.lock requirements/megatron.lock
megatron_IMPORTS = import megatron.core, psutil, gated_qwen
# Their pins conflict with cpu.lock's (huggingface-hub, fsspec): installed without deps
NODEPS = $(call PIP,.venv-$(1)) --no-deps -r requirements/$(1).lock $(QUIET)
olmo_LOCKS = requirements/cpu.lock
olmo_NEEDS = requirements/olmo.lock
olmo_SETUP = $(call NODEPS,olmo)
olmo_IMPORTS = import olmo_core.nn.transformer, gated_qwen
torchtitan_LOCKS = requirements/cpu.lock
torchtitan_NEEDS = requirements/torchtitan.lock
torchtitan_SETUP = $(call NODEPS,torchtitan)
torchtitan_IMPORTS = import torchtitan.models.qwen3_5, gated_qwen

$(foreach e,compat serving distributed llama mlx onnx optimum megatron olmo torchtitan,$(eval $(call ENVIRONMENT,$(e))))
$(foreach e,compat serving distributed llama mlx onnx megatron olmo torchtitan,$(eval $(call TESTS,$(e))))
