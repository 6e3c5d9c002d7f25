"""The model files a saved gated_qwen folder ships run on every Transformers met: loaded with
`trust_remote_code=True` (the folder's own files, not this package) under the serving environment's Transformers
(5.19, what vLLM pins), the lock's (5.24, `GATED_QWEN_PYTHON`) and, where `GATED_QWEN_COMPAT_PYTHON` names one, an
older one (`make test-serving COMPAT_PYTHON=.venv-compat/bin/python`: 5.17, the GPU machine's image), every native
variant generates Transformers' 5.24 greedy tokens (build_models.py) with log-probabilities within LOGPROB_TOLERANCE.
Each Transformers runs in its own process (vLLM's backend changes the model class in the process that serves it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serving.cases import MOE
from tests.serving.variants import NATIVE
from tests.serving.vllm_helpers import LOGPROB_TOLERANCE, max_logprob_difference

HERE = Path(__file__).resolve().parent
PYTHONS = {"serving": sys.executable, "lock": os.environ.get("GATED_QWEN_PYTHON", str(HERE.parents[1] / ".venv/bin/python"))}
if os.environ.get("GATED_QWEN_COMPAT_PYTHON"):
    PYTHONS["compat"] = os.environ["GATED_QWEN_COMPAT_PYTHON"]


@pytest.mark.parametrize("environment", PYTHONS)
def test_shipped_files_generate_the_reference(models, environment, tmp_path):
    cases = [*NATIVE, *MOE]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")} | {"HF_MODULES_CACHE": str(tmp_path)}
    out = subprocess.run([PYTHONS[environment], "-m", "tests.serving.transformers_answers", str(models["root"]), *cases],
                         cwd=HERE.parents[1], check=True, capture_output=True, text=True, env=env, timeout=900)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for name in cases:
        shipped = result["cases"][name]
        assert shipped["class_module"].startswith("transformers_modules."), shipped["class_module"]
        difference = max_logprob_difference(shipped["answers"], models["cases"][name]["reference"])
        assert difference <= LOGPROB_TOLERANCE, (result["transformers"], name, difference)
