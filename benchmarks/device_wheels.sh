#!/usr/bin/env bash
# `make device-wheels`: downloads the wheels of requirements/device-wheels.txt that the GPU machine's image lacks (for
# its Python 3.12; no registry is reachable there) into FOLDER (default .device-wheels), whole or not at all, and
# checks that they and the working tree stay under the 64 MiB a device run carries. benchmarks/GPU.md.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.device-wheels} limit=67108864 list=requirements/device-wheels.txt
rm -rf "$out.partial"
"${PYTHON:-python3}" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$out.partial" -r $list 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
# kernels' build for .venv-compat's Python 3.11 too (make test-compat's Hub-kernel tests)
"${PYTHON:-python3}" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.11 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$out.partial" "$(grep "^kernels==" $list)"
test "$(ls "$out.partial"/*.whl | wc -l)" -eq "$(($(grep -c "^[A-Za-z]" $list) + 1))" \
  || { echo "device-wheels: pip did not download every wheel of $list"; exit 1; }
wheels=$(cat "$out.partial"/*.whl | wc -c)
tree=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 cat 2>/dev/null || true) | wc -c)  # a file cat cannot read counts 0
echo "device-wheels: $(ls "$out.partial" | wc -l) wheels, $wheels B; working tree $tree B;" \
  "together $((wheels + tree)) B of $limit"
test $((wheels + tree)) -lt $limit || { echo "device-wheels: over the 64 MiB a device run carries"; exit 1; }
touch "$out.partial/.complete"
rm -rf "$out" && mv "$out.partial" "$out"
