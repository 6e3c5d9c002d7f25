"""Test-wide setup.

Hermetic caches: no test may read or write the user's Hugging Face caches (`~/.cache/huggingface`). Every cache
location of huggingface_hub and Transformers points into a temporary folder made for this test process before
either library is imported (they read the variables at import), and the autouse fixture below gives each test a
fresh one of its own, so nothing an earlier test or run downloaded or cached can leak into another.

The tests' models are tiny: they gain nothing from several intra-op threads, and on a loaded 2-core machine every
parallel region waits for descheduled threads (a 40-step Trainer run took 0.8 s on one thread, 64 s on two), so the
suite runs on one thread per process (`make test` runs two processes).

The folders of the other environments (`ENVIRONMENT_FOLDERS`: tests/serving and the tests/engine_* folders, each with
its make target and virtual environment, never collected by `make test`) mark their tests with the environment's
marker (in pyproject.toml).

Without a GPU the Triton kernel runs under the Triton interpreter; that switch must be set before any
`@triton.jit` function is defined, i.e. before `gated_qwen` is imported anywhere in the test process.
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

HF_CACHE_VARIABLES = ("HF_HOME", "HF_HUB_CACHE", "HF_XET_CACHE", "HF_ASSETS_CACHE", "HF_MODULES_CACHE",
                      "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "XDG_CACHE_HOME")


def _point_caches_at(root: Path) -> dict[str, str]:
    values = {"HF_HOME": root / "hf", "HF_HUB_CACHE": root / "hf" / "hub", "HF_XET_CACHE": root / "hf" / "xet",
              "HF_ASSETS_CACHE": root / "hf" / "assets", "HF_MODULES_CACHE": root / "hf" / "modules",
              "HF_DATASETS_CACHE": root / "hf" / "datasets", "TRANSFORMERS_CACHE": root / "hf" / "hub",
              "XDG_CACHE_HOME": root / "cache"}
    return {name: str(values[name]) for name in HF_CACHE_VARIABLES}


# The user's real cache, as huggingface_hub would find it without the variables below.
USER_HF_CACHE = Path(os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                     / "huggingface")
# Not named `gated-qwen-*`: the command's scratch cleaner (files/scratch.py) removes such folders while they are empty,
# and says so on stderr, under any test process's command.
_PROCESS_CACHES = Path(tempfile.mkdtemp(prefix="hf-caches-of-tests-"))
atexit.register(shutil.rmtree, _PROCESS_CACHES, ignore_errors=True)
os.environ.update(_point_caches_at(_PROCESS_CACHES))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(autouse=True)
def hermetic_hf_caches(tmp_path_factory, monkeypatch):
    """A fresh, empty set of Hugging Face caches for each test: the environment (for subprocesses) and the
    libraries' module-level constants (read at import, so changing only the environment would not reach them)."""
    values = _point_caches_at(tmp_path_factory.mktemp("caches"))
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    # The fused kernel's measured choices (kernel/choice.py; written on a CUDA GPU only), never the user's.
    monkeypatch.setenv("GATED_QWEN_KERNEL_CACHE", str(Path(values["XDG_CACHE_HOME"]) / "gated-qwen-kernel"))
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HOME", values["HF_HOME"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", values["HF_HUB_CACHE"])
    monkeypatch.setattr(constants, "HUGGINGFACE_HUB_CACHE", values["HF_HUB_CACHE"], raising=False)
    monkeypatch.setattr(constants, "HF_XET_CACHE", values["HF_XET_CACHE"], raising=False)
    monkeypatch.setattr(constants, "HF_ASSETS_CACHE", values["HF_ASSETS_CACHE"], raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(Path(values["HF_HOME"]) / "token"), raising=False)
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(Path(values["HF_HOME"]) / "stored_tokens"),
                        raising=False)
    yield values


def _snapshot(folder: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*")} if folder.is_dir() else {}


ENVIRONMENT_FOLDERS = {"serving": "serving", "engine_llama": "llama", "engine_mlx": "mlx", "engine_onnx": "onnx",
                       "engine_megatron": "megatron", "engine_olmo": "olmo", "engine_torchtitan": "torchtitan"}


def pytest_collection_modifyitems(items):
    tests = Path(__file__).resolve().parent
    for item in items:
        parents = Path(item.fspath).parents
        for folder, marker in ENVIRONMENT_FOLDERS.items():
            if tests / folder in parents:
                item.add_marker(getattr(pytest.mark, marker))


def pytest_sessionstart(session):
    session.config._user_hf_cache = _snapshot(USER_HF_CACHE)


def pytest_sessionfinish(session, exitstatus):
    """Fails the run if anything in the user's real Hugging Face cache appeared, changed or vanished."""
    before, after = session.config._user_hf_cache, _snapshot(USER_HF_CACHE)
    if before != after:
        changed = sorted(set(before) ^ set(after) | {p for p in before.keys() & after.keys() if before[p] != after[p]})
        session.config.get_terminal_writer().line(
            f"the tests touched the user's Hugging Face cache {USER_HF_CACHE}: {changed[:5]}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
