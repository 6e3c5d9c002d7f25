#!/usr/bin/env bash
# make test-latest's environment: .venv-latest with the newest releases pyproject.toml allows (torch held at
# requirements/torch-cpu.txt, or torch-cuda.txt where nvidia-smi answers), checked by importing IMPORTS, frozen into
# .venv-latest/freeze.txt. Environment: PYTHON, TORCH_INDEX, EXTRAS, IMPORTS (as the Makefile sets them).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3} TORCH_INDEX=${TORCH_INDEX:-} venv=.venv-latest
torch=requirements/torch-$(nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu).txt
pip_install() {  # pip warns about each missing folder of the machine's configured mirrors: those lines say nothing
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
}
rm -rf $venv && "$PYTHON" -m venv $venv
pip_install $TORCH_INDEX -r "$torch"
pip_install --upgrade --upgrade-strategy eager -c "$torch" -e ".[$EXTRAS]"
$venv/bin/python -c "$IMPORTS"
$venv/bin/python -m pip freeze --exclude-editable > $venv/freeze.txt
