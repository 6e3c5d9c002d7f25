#!/usr/bin/env bash
# make test-serving's tests, in .venv-serving: vLLM against Transformers (.venv's Python as the reference;
# COMPAT_PYTHON=PATH: also its), the plugin's test with vLLM's plugins on, and the Transformers version seam's tests
# in vLLM's Transformers.
set -euo pipefail
compat=${COMPAT_PYTHON:+$(realpath "$COMPAT_PYTHON")}
cd "$(dirname "$0")/.."
pytest=(.venv-serving/bin/python -m pytest -q -p no:cacheprovider)
export GATED_QWEN_PYTHON=$PWD/.venv/bin/python ${compat:+GATED_QWEN_COMPAT_PYTHON=$compat}
VLLM_PLUGINS=none "${pytest[@]}" tests/serving --ignore=tests/serving/test_plugin.py
"${pytest[@]}" tests/serving/test_plugin.py
env -u GATED_QWEN_PYTHON -u GATED_QWEN_COMPAT_PYTHON "${pytest[@]}" tests/model/test_transformers_compat.py \
  tests/model/test_remote_code.py
