#!/usr/bin/env bash
# The GPU check on the project's GPU machine as it is: that machine's own python3 (torch, Triton, an older
# transformers preinstalled), no virtual environment, no package registry, no make.
#
#     make device-wheels                                  # here, once: .device-wheels/ (what the image lacks)
#     bash benchmarks/gpu_check_device.sh --out DIR       # there, with .device-wheels/ brought along
#     bash benchmarks/gpu_check_device.sh --interpret --out DIR   # any CPU: the same run under the Triton interpreter
#
# It installs .device-wheels/*.whl into a temporary folder (pip --no-index --no-deps --target), puts that folder and
# src/ first on PYTHONPATH, prints the versions it runs with and where they come from, and runs
# benchmarks/gpu_check.py within a time budget (--budget, default 400 s: the whole run, compilation and autotuning
# included, stays under 8 minutes; what did not fit is listed as skipped). Besides the package's kernel, that checks
# the Hub kernel: the repository `make kernel-repo` builds, generated there from src/ into a temporary folder and
# loaded with kernels.get_local_kernel (kernels is one of the wheels). DIR (new) then holds results.json,
# results.md and gpu_check.log. If the check cannot finish, DIR is not made and the log stays in DIR.partial.XXXXXX.
#
# Options: --wheels FOLDER (default: .device-wheels beside benchmarks/), --budget SECONDS, --jobs N (compiler
# processes, default one per core). PYTHON names the interpreter (default python3).
# Exit status: that of gpu_check.py (0 passed, 1 a correctness check failed, 3 passed with parts skipped for the
# budget), 2 on bad arguments or when the environment cannot run the check (one line on stderr).
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
wheels=$root/.device-wheels
out=""
budget=400
check_args=()

refuse() {
    echo "gpu_check_device.sh: error: $1" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case $1 in
        --out) [ $# -ge 2 ] || refuse "--out needs a folder"; out=$2; shift 2 ;;
        --wheels) [ $# -ge 2 ] || refuse "--wheels needs a folder"; wheels=$2; shift 2 ;;
        --budget) [ $# -ge 2 ] || refuse "--budget needs a number of seconds"; budget=$2; shift 2 ;;
        --jobs) [ $# -ge 2 ] || refuse "--jobs needs a number"; check_args+=(--jobs "$2"); shift 2 ;;
        --interpret) check_args+=(--interpret); shift ;;
        -h|--help) sed -n '2,/^set /p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) refuse "unknown argument '$1' (expected --out DIR [--interpret] [--wheels FOLDER] [--budget SECONDS] [--jobs N])" ;;
    esac
done
[ -n "$out" ] || refuse "--out DIR is required (a new folder for results.json, results.md and gpu_check.log)"
[ "$out" = / ] || out=${out%/}
[ ! -e "$out" ] && [ ! -L "$out" ] || refuse "$out exists; choose a new folder"
parent=$(dirname "$out")
[ -d "$parent" ] || refuse "the folder $parent (where $out would go) does not exist"
[[ $budget =~ ^[0-9]+$ ]] && [ "$budget" -gt 0 ] || refuse "--budget must be a whole number of seconds > 0, got '$budget'"
command -v "$python" >/dev/null || refuse "no '$python' on PATH (set PYTHON to the interpreter that has torch)"
shopt -s nullglob
wheel_files=("$wheels"/*.whl)
[ ${#wheel_files[@]} -gt 0 ] || refuse "no wheels in $wheels: run 'make device-wheels' where a package registry is reachable and bring .device-wheels/ along"

site=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX") || refuse "cannot make a temporary folder"
staging=$(mktemp -d "$out.partial.XXXXXX") || refuse "cannot make a folder beside $out"
trap 'rm -rf "$site"' EXIT
log=$staging/gpu_check.log

run() {
    echo "gpu_check_device.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n): ${#wheel_files[@]} wheels from $wheels"
    "$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site" --find-links "$wheels" -r "$root/requirements/device-wheels.txt" \
        || { echo "pip could not install the wheels of $wheels"; return 2; }
    export PYTHONPATH="$site:$root/src${PYTHONPATH:+:$PYTHONPATH}"
    # Every distribution gated_qwen uses, with the folder it is imported from: the wheels' folder must win.
    "$python" - "$site" "$root/src" <<'EOF' || return 2
import importlib, importlib.metadata, os, sys
site = os.path.realpath(sys.argv[1])
wheel_dists = {d.metadata["Name"].lower().replace("-", "_") for d in importlib.metadata.distributions(path=[site])}
print(f"python {sys.version.split()[0]} ({sys.executable})")
for module, dist in (("torch", "torch"), ("triton", "triton"), ("transformers", "transformers"),
                     ("huggingface_hub", "huggingface_hub"), ("httpx2", "httpx2"), ("kernels", "kernels"),
                     ("accelerate", "accelerate"),
                     ("safetensors", "safetensors"), ("tokenizers", "tokenizers"), ("numpy", "numpy"),
                     ("gated_qwen", None)):
    try:
        mod = importlib.import_module(module)
    except Exception as err:
        print(f"cannot import {module}: {type(err).__name__}: {err}")
        sys.exit(1)
    version = getattr(mod, "__version__", None) or importlib.metadata.version(dist)
    where = os.path.dirname(os.path.dirname(os.path.realpath(mod.__file__)))
    origin = "wheels" if where == site else where
    print(f"{module} {version} ({origin})")
    if module == "gated_qwen" and where != os.path.realpath(sys.argv[2]):
        print(f"gated_qwen was imported from {where}, not from {sys.argv[2]}")
        sys.exit(1)
    if dist in wheel_dists and origin != "wheels":
        print(f"{module} was imported from {where}, not from the wheels' folder {site}")
        sys.exit(1)
import torch
print(f"cuda available: {torch.cuda.is_available()}" + (f", {torch.cuda.get_device_name(0)}, torch CUDA "
      f"{torch.version.cuda}" if torch.cuda.is_available() else ""))
EOF
    # A watchdog past the budget: a hung step cannot outlive the run; SIGTERM makes gpu_check.py write what it has.
    timeout --signal=TERM --kill-after=15 $((budget + 40)) \
        "$python" "$root/benchmarks/gpu_check.py" "${check_args[@]}" --budget "$budget" --out "$staging/check"
}

export PYTHONUNBUFFERED=1
run 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [ -f "$staging/check/results.json" ]; then
    mv "$staging/check/results.json" "$staging/check/results.md" "$staging/"
    rmdir "$staging/check"
    mv -T "$staging" "$out"
    echo "gpu_check_device.sh: results in $out (status $status)"
else
    echo "gpu_check_device.sh: the check did not finish (status $status); its log is $log" >&2
    [ "$status" -ne 0 ] || status=1
fi
exit "$status"
