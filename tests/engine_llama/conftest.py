"""Setup of the llama.cpp tests (`make test-llama`, in `.venv-llama`: the project's lock, llama-cpp-python built from
the source release requirements/llama.lock names, and that release's own converter in .venv-llama/llama.cpp).

llama.cpp runs in a process of its own per GGUF (`run_gguf.py`): an abort inside it (`GGML_ASSERT`) ends that
process and is reported, not the session. `make test` never collects this folder (`norecursedirs` in
pyproject.toml); every test here carries the `llama` marker (tests/conftest.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# ggml prints a backtrace on an abort by attaching gdb to itself, which can wait forever without ptrace rights.
os.environ["GGML_NO_BACKTRACE"] = "1"
CONVERTER = Path(os.environ.get("LLAMA_CPP_CONVERTER", REPO / ".venv-llama" / "llama.cpp" / "convert_hf_to_gguf.py"))



def run_gguf(*args: str) -> subprocess.CompletedProcess:
    """`run_gguf.py ARGS` in a new interpreter (a generous safety-net timeout: the runs take seconds)."""
    return subprocess.run([sys.executable, str(HERE / "run_gguf.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=600)


def llama_cpp(*args: str) -> dict:
    """What `run_gguf.py ARGS` printed; fails with llama.cpp's last words when it did not end normally."""
    run = run_gguf(*args)
    assert run.returncode == 0, f"llama.cpp ended with status {run.returncode}: {run.stderr[-2000:]}"
    return json.loads(run.stdout)


def llama_cpp_convert(src: Path, out: Path) -> subprocess.CompletedProcess:
    """llama.cpp's convert_hf_to_gguf.py on the folder `src` (float32, no multi-token-prediction head, which the
    converter otherwise demands of a Qwen3.5 / Qwen3-Next folder)."""
    assert CONVERTER.is_file(), f"{CONVERTER} is missing: `make test-llama` unpacks llama.cpp's converter there"
    return subprocess.run([sys.executable, str(HERE / "llama_cpp_converter.py"), str(CONVERTER), str(src),
                           "--outfile", str(out), "--outtype", "f32", "--no-mtp"],
                          capture_output=True, text=True, timeout=600, check=True)
