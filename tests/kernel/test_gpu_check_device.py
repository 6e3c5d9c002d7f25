"""`benchmarks/gpu_check_device.sh`, the one command for the project's GPU machine, which runs its own python3 (torch,
Triton 3.6, transformers 5.17, huggingface_hub 1.33) and reaches no package registry.

The `compat` test is the first GPU run rehearsed on a CPU: the whole script under the Triton interpreter in
.venv-compat (requirements/compat.lock, the image's versions, nothing of the project installed) with only the wheels
of `make device-wheels` added, so that run cannot fail on an import. `make test-compat` runs it (it needs both
folders); `make test` deselects it. The other tests hold the wheel list to the lock the suite runs with, .venv-compat's
lock to the image's package list (requirements/gpu-image.txt), and check the script's refusals, anywhere."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check_device.sh"
WHEELS = ROOT / ".device-wheels"
DEVICE_CARRY_LIMIT = 64 * 2**20  # what one device run carries: the working tree and these wheels


def pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a requirements or lock file, names normalised as pip does."""
    found = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", path.read_text(), flags=re.M)
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in found}


def run_script(*args, cwd, timeout=60):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env | {"PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_the_device_wheels_are_the_versions_the_suite_runs_with():
    """The GPU machine runs gated_qwen on the transformers / huggingface_hub (and their HTTP stack) that
    requirements/cpu.lock pins, i.e. what `make test` passed with."""
    wanted = pins(ROOT / "requirements" / "device-wheels.txt")
    assert {"transformers", "huggingface-hub"} <= set(wanted)
    locked = pins(ROOT / "requirements" / "cpu.lock")
    assert {name: locked.get(name) for name in wanted} == wanted


def test_the_compat_environment_holds_only_what_the_gpu_image_has():
    """.venv-compat (requirements/compat.lock) stands in for the GPU machine's image (requirements/gpu-image.txt, read
    there): a distribution it has and the image lacks would let an import pass here that fails there."""
    image_lines = [line for line in (ROOT / "requirements" / "gpu-image.txt").read_text().splitlines()
                   if line and not line.startswith("#")]
    image_names = {re.sub(r"[-_.]+", "-", line.split("==")[0]).lower() for line in image_lines}
    image_versions = pins(ROOT / "requirements" / "gpu-image.txt")
    locked = pins(ROOT / "requirements" / "compat.lock")
    assert sorted(set(locked) - image_names) == []
    # The versions seen on the image, but for the two no CPU copy can have (requirements/compat.in): torch's CUDA
    # build and NumPy 2.5 (no wheel for the CPU torch's Python 3.11).
    copied = {name: version for name, version in image_versions.items()
              if name in locked and name not in ("torch", "numpy")}
    assert {name: locked[name] for name in copied} == copied


@pytest.mark.parametrize("args, message", [
    ((), "--out DIR is required"),
    (("--out",), "--out needs a folder"),
    (("--frobnicate", "--out", "x"), "unknown argument '--frobnicate'"),
    (("--budget", "soon", "--out", "x"), "--budget must be a whole number of seconds"),
    (("--wheels", "empty", "--out", "x"), "no wheels in empty: run 'make device-wheels'"),
    (("--wheels", "empty", "--out", "missing/x"), "the folder missing (where missing/x would go) does not exist"),
])
def test_bad_arguments_are_refused_in_one_line_with_status_2(tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    result = run_script(*args, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # nothing made, no partial folder


def test_an_existing_output_folder_is_refused_and_left_as_it_is(tmp_path):
    existing = tmp_path / "results"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    result = run_script("--interpret", "--out", str(existing), cwd=tmp_path)
    assert result.returncode == 2 and "exists; choose a new folder" in result.stderr
    assert [p.name for p in existing.iterdir()] == ["keep.txt"] and len(list(tmp_path.iterdir())) == 1


@pytest.mark.compat
@pytest.mark.slow  # a whole gpu_check.py --interpret run in a fresh interpreter: about two minutes on two cores
def test_the_device_command_passes_in_the_gpu_image_with_only_the_device_wheels(tmp_path):
    # This interpreter is .venv-compat: the image's versions, and neither gated_qwen nor the wheels' packages.
    bare_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util, torch, triton, transformers, huggingface_hub; "
         "print(triton.__version__, transformers.__version__, huggingface_hub.__version__, torch.__version__, "
         "importlib.util.find_spec('gated_qwen') is None, importlib.util.find_spec('httpx2') is None)"],
        cwd=tmp_path, env=bare_env, capture_output=True, text=True, timeout=120, check=True)
    image = pins(ROOT / "requirements" / "compat.lock")
    assert probe.stdout.split() == [image["triton"], image["transformers"], image["huggingface-hub"],
                                    image["torch"], "True", "True"], "run this test through `make test-compat`"
    assert (image["triton"], image["transformers"], image["huggingface-hub"]) == ("3.6.0", "5.17.0", "1.33.0")

    wheels = sorted(WHEELS.glob("*.whl"))
    wanted = pins(ROOT / "requirements" / "device-wheels.txt")
    assert sorted(re.sub(r"_", "-", w.name.split("-")[0]).lower() for w in wheels) == sorted([*wanted, "kernels"])
    # They install on the image's 3.12 and here: pure Python, or (kernels) its builds for CPython 3.12 and 3.11.
    builds = sorted(w.name.split("-")[2] for w in wheels if not w.name.endswith("-py3-none-any.whl"))
    assert builds == ["cp311", "cp312"], [w.name for w in wheels]
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split("\0")
    tree = sum((ROOT / p).stat().st_size for p in tracked if p and (ROOT / p).is_file())
    assert tree + sum(w.stat().st_size for w in wheels) < DEVICE_CARRY_LIMIT

    out = tmp_path / "gpu-check"
    result = run_script("--interpret", "--out", str(out), cwd=tmp_path, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-check"]  # no partial folder left
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "results.json", "results.md"]
    log = (out / "gpu_check.log").read_text()
    assert log == result.stdout.split("gpu_check_device.sh: results in")[0]
    # The versions it ran with, and where each came from: the wheels' folder shadows the image's older releases.
    assert f"transformers {wanted['transformers']} (wheels)" in log
    assert f"huggingface_hub {wanted['huggingface-hub']} (wheels)" in log
    assert f"httpx2 {wanted['httpx2']} (wheels)" in log
    assert f"kernels {wanted['kernels']} (wheels)" in log
    assert f"triton {image['triton']} ({Path(sys.executable).parents[1]}" in log
    assert f"gated_qwen 0.1.0 ({ROOT / 'src'})" in log
    results = json.loads((out / "results.json").read_text())
    assert results["passed"] and results["skipped"] == []
    assert results["environment"]["triton"] == image["triton"]
    assert results["environment"]["transformers"] == wanted["transformers"]
    assert len(results["correctness"]) == 5 and all(row["ok"] for row in results["correctness"])
    # The Hub kernel (make kernel-repo's layout, generated there) loaded through kernels.get_local_kernel, held to the
    # reference and to the package's kernel: what the first GPU run checks beside the package's path.
    assert len(results["hub_kernel"]) == 2 and all(row["ok"] for row in results["hub_kernel"])
    assert set(results["end_to_end"]["self_check"].values()) == {"passed"}
    assert (out / "results.md").read_text().strip() in log
