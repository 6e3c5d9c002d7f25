#!/usr/bin/env bash
# make test-compat's tests, in .venv-compat (the GPU machine's image, on this CPU):
#   requirements/compat_tests.sh DEVICE_WHEELS   (the folder `make device-wheels` fills)
# the kernel's tests with the device wheels' packages first on PYTHONPATH, the Transformers version seam's, and the
# Hub kernel's with the image's `kernels`.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${1:?usage: requirements/compat_tests.sh DEVICE_WHEELS_FOLDER}
py=.venv-compat/bin/python site=$PWD/.venv-compat/device-site ksite=$PWD/.venv-compat/kernels-site src=$PWD/src
install_into() {  # pip warns about each missing folder of the machine's configured mirrors: those lines say nothing
  "$py" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --find-links "$wheels" --target "$@" \
    2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
}
rm -rf "$site" "$ksite"
install_into "$site" -r requirements/device-wheels.txt
install_into "$ksite" kernels
PYTHONPATH=$site:$src "$py" -m pytest -q -n 2 --dist loadfile tests/kernel/test_triton_kernel.py \
  tests/integrations/test_gated_triton.py tests/kernel/test_kernel_selfcheck.py tests/kernel/test_kernel_choice.py \
  tests/kernel/test_kernel_aot.py tests/kernel/test_gpu_check.py tests/kernel/test_gpu_check_device.py \
  tests/integrations/test_kernel_hub.py
PYTHONPATH=$src "$py" -m pytest -q -p no:cacheprovider tests/model/test_transformers_compat.py \
  tests/model/test_remote_code.py
PYTHONPATH=$src:$ksite "$py" -m pytest -q -p no:cacheprovider tests/integrations/test_kernel_hub.py
