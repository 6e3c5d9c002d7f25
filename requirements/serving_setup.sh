#!/usr/bin/env bash
# .venv-serving's torchvision operators (requirements/serving_torchvision_ops.py), imported at start-up by a .pth file.
set -euo pipefail
site=$(.venv-serving/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp requirements/serving_torchvision_ops.py "$site/"
echo "import serving_torchvision_ops" > "$site/serving_torchvision_ops.pth"
