#!/usr/bin/env bash
# `make test-llama`, once per version: builds llama-cpp-python VERSION from its source release on the package index
# (CPU backend, no multimodal library, niced) into .venv-llama/wheels, where it is reused while requirements/llama.lock
# names that version, and unpacks the release's own converter (convert_hf_to_gguf.py, conversion/, gguf-py) into
# .venv-llama/llama.cpp. Environment: PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$1 venv=.venv-llama
src=llama_cpp_python-$version/vendor/llama.cpp
quiet() { "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true; }
test -x $venv/bin/python || "${PYTHON:-python3}" -m venv $venv
rm -rf $venv/source $venv/wheels.partial $venv/llama.cpp && mkdir -p $venv/source $venv/llama.cpp
quiet $venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
  "llama-cpp-python==$version" -d $venv/source
tar -xzf "$venv/source/llama_cpp_python-$version.tar.gz" -C $venv/llama.cpp --strip-components 3 \
  "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$src/LICENSE"
CMAKE_ARGS="-DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 quiet nice -n 19 $venv/bin/python -m pip wheel --quiet \
  --disable-pip-version-check --no-deps --no-cache-dir -w $venv/wheels.partial \
  "$venv/source/llama_cpp_python-$version.tar.gz"
test -f "$venv/wheels.partial/llama_cpp_python-$version-py3-none-linux_x86_64.whl"
rm -rf $venv/wheels && mv $venv/wheels.partial $venv/wheels && touch "$venv/wheels/.built-$version"
