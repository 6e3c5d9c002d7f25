"""Test-wide setup.

Hermetic caches: the suite judges only itself. The session runs in a folder of its own: HOME, XDG_CACHE_HOME and every
cache location of huggingface_hub and Transformers point into it before either library is imported (they read the
variables at import), for the test processes and every process they start, and the autouse fixture below gives each
test a fresh set of Hugging Face caches, so nothing an earlier test or run cached can leak into another. Code that
names the user's cache by its literal path is refused by `hermetic/cache_guard.py` in every Python process of the
session, and the session fails naming the test and what it wrote. Another program using the user's cache meanwhile
is none of the suite's business.

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
import json
import os
import shutil
import sys
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


HERMETIC = Path(__file__).resolve().parent / "hermetic"
sys.path.insert(0, str(HERMETIC))
import cache_guard  # noqa: E402  (the folder above holds it)

if cache_guard.VARIABLE not in os.environ:  # the session starts here (a pytest-xdist worker inherits it)
    # Not named `gated-qwen-*`: the command's scratch cleaner (files/scratch.py) removes such folders while they are
    # empty, and says so on stderr, under any test process's command.
    _SESSION = Path(tempfile.mkdtemp(prefix="hf-caches-of-tests-"))
    atexit.register(shutil.rmtree, _SESSION, ignore_errors=True)
    _guarded = cache_guard.guarded_folders(os.environ)
    (_SESSION / "home").mkdir()
    os.environ.update(_point_caches_at(_SESSION), HOME=str(_SESSION / "home"), HF_HUB_OFFLINE="1")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERMETIC), *filter(None, [os.environ.get("PYTHONPATH")])])
    cache_guard.install(str(_SESSION), _guarded)
else:
    cache_guard.install_from_environment()
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


ENVIRONMENT_FOLDERS = {"serving": "serving", "engine_llama": "llama", "engine_mlx": "mlx", "engine_onnx": "onnx",
                       "engine_megatron": "megatron", "engine_olmo": "olmo", "engine_torchtitan": "torchtitan"}


def pytest_collection_modifyitems(items):
    tests = Path(__file__).resolve().parent
    for item in items:
        parents = Path(item.fspath).parents
        for folder, marker in ENVIRONMENT_FOLDERS.items():
            if tests / folder in parents:
                item.add_marker(getattr(pytest.mark, marker))


def pytest_sessionfinish(session, exitstatus):
    """Fails the run if a process of the suite tried to write to the user's caches, naming the test and the path."""
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: its controller reads what every process recorded
    writes = cache_guard.recorded_writes(json.loads(os.environ[cache_guard.VARIABLE])["session"])
    if writes:
        lines = sorted({f"  {w['test']}: {w['event']} {w['path']}" for w in writes})
        session.config.get_terminal_writer().line(
            "\nthe test suite tried to write to the user's cache (refused):\n" + "\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
