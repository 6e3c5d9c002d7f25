"""Setup of the serving tests (`make test-serving`, in `.venv-serving`: vLLM's CPU build and the Transformers it pins).

The models are built, and Transformers' answers for them recorded, by `build_models.py` in the project's own
environment (`GATED_QWEN_PYTHON`, default `.venv/bin/python`: the lock's Transformers), once per test session, into a
temporary folder; the tests here serve them with vLLM and compare. vLLM runs in the test process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) with a 1 GB KV cache, in float32, eager, without a tokenizer (token-id prompts).

`make test` never collects this folder (`norecursedirs` in pyproject.toml); every test here carries the `serving`
marker (tests/conftest.py).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]



@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict:
    """`{"root": Path, "prompts": [[token, ...]], "cases": {name: {...}}}`, see build_models.py."""
    root = tmp_path_factory.mktemp("serving-models")
    python = os.environ.get("GATED_QWEN_PYTHON", str(REPO / ".venv" / "bin" / "python"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    subprocess.run([python, "-m", "tests.serving.build_models", str(root)], check=True, env=env, timeout=900,
                   stdout=subprocess.DEVNULL, cwd=REPO)
    manifest = json.loads((root / "manifest.json").read_text())
    return {"root": root, **manifest}
