"""`benchmarks/gpu_check.py` without a GPU: `--interpret` runs the whole script (parallel-compile step excepted) on
tiny sizes under the Triton interpreter and must pass; a budget too short for the work skips it and lists what was
skipped; SIGTERM (the device script's watchdog) stops the run and still writes what it has; on a machine without
CUDA the plain command refuses with one line, and an existing output folder is never touched."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="needs the triton extra: pip install 'gated-qwen[triton]'")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_check  # noqa: E402  (the script's own grid: imports nothing heavy)


def script_env():
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it for --interpret


def run(*args, cwd):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=script_env(), capture_output=True,
                          text=True, timeout=900, check=False)


@pytest.mark.slow
def test_interpret_mode_checks_measures_and_writes_its_results(tmp_path):
    out = tmp_path / "check"
    result = run("--interpret", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]
    results = json.loads((out / "results.json").read_text())
    assert results["passed"] and results["environment"]["gpu"].startswith("none")
    assert results["skipped"] == [] and set(results["phase_seconds"]) == {"correctness", "hub kernel", "throughput",
                                                                           "end to end"}
    rows = results["correctness"]
    layouts = {row["case"].split()[-3] for row in rows}
    assert layouts == {"dense", "varlen", "decode", "varlen-decode"} and all(row["ok"] for row in rows)
    assert all(set(row["errors"]) >= {"out"} for row in rows)
    assert any(set(row["errors"]) == {"out", "dq", "dk", "dv", "dgate"} for row in rows)
    # The Hub kernel built from the same source, loaded by kernels: its own module, correct, equal to the package's.
    hub = results["hub_kernel"]
    assert len(hub) == len(gpu_check.hub_kernel_problems(True)) and all(row["ok"] for row in hub)
    assert all(row["module"].startswith("_gated_qwen_kernel_") and row["vs_package"] <= 1e-3 for row in hub)
    assert all(set(row["errors"]) == {"out", "dq", "dk", "dv", "dgate"} for row in hub)
    for row in results["throughput"]:
        assert len(row["kernel"]) == 3 and len(row["sdpa_gate"]) == 3 and all(x > 0 for x in row["kernel"])
        # The default attention's own choice for these inputs (measured by wall clock under the interpreter).
        chosen = row["dispatch"]
        assert chosen["ran"] == ("kernel" if chosen["kernel_ms"] < chosen["sdpa_ms"] * 0.97 else "SDPA + gate")
    e2e = results["end_to_end"]
    for name in ("train", "decode"):
        assert e2e[name]["ratio"] == pytest.approx(e2e[name]["gated_triton_tokens_per_s"] / e2e[name]["sdpa_tokens_per_s"])
    assert e2e["self_check"] and set(e2e["self_check"].values()) == {"passed"}
    assert e2e["choices"] and all(c["kernel_ms"] > 0 and c["sdpa_ms"] > 0 for c in e2e["choices"].values())
    report = (out / "results.md").read_text()
    assert report.strip() in result.stdout  # the markdown is also printed
    for heading in ("#### Correctness", "#### Hub kernel", "#### Kernel TFLOP/s", "#### End to end"):
        assert heading in report


def test_a_budget_too_short_for_any_work_skips_all_of_it_and_lists_it(tmp_path):
    """Each piece of work needs at least 3 s of budget (EXPECTED_SECONDS): with 1 s nothing starts, exit status 3."""
    out = tmp_path / "check"
    result = run("--interpret", "--budget", "1", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["correctness"] == results["hub_kernel"] == results["throughput"] == []
    assert "end_to_end" not in results
    labels = [p.label for p in gpu_check.correctness_grid(True)]
    labels += [f"hub kernel {p.label}" for p in gpu_check.hub_kernel_problems(True)]
    labels += [f"throughput S={p.seq}" for p in gpu_check.throughput_problems(True)] + ["end to end"]
    assert len(results["skipped"]) == len(labels)
    for skipped, label in zip(results["skipped"], labels):
        assert skipped.startswith(label + " (") and "s of the budget left" in skipped, (skipped, label)
    assert results["goals"] == {"forward": "not measured", "backward": "not measured", "fwd_bwd": "not measured"}
    assert "**Skipped** (time budget 1.0 s)" in (out / "results.md").read_text()


def test_sigterm_stops_the_run_and_writes_what_it_has(tmp_path):
    out = tmp_path / "check"
    process = subprocess.Popen([sys.executable, str(SCRIPT), "--interpret", "--out", str(out)], cwd=tmp_path,
                               env=script_env() | {"PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        for line in process.stdout:  # SIGTERM as soon as the first correctness case starts
            if line.startswith("correctness:"):
                process.send_signal(signal.SIGTERM)
                break
        rest = process.communicate(timeout=300)[0]
    finally:
        process.kill()
    assert process.returncode == 3, rest[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["skipped"][-1].startswith("stopped by signal 15 during correctness")
    assert len(results["correctness"]) < len(gpu_check.correctness_grid(True)) and "end_to_end" not in results
    assert all(row["ok"] for row in results["correctness"])  # the case under way was dropped, not failed


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_refuses_without_a_gpu_and_never_overwrites(tmp_path):
    result = run("--out", str(tmp_path / "new"), cwd=tmp_path)
    assert result.returncode == 2 and not (tmp_path / "new").exists()
    assert len(result.stderr.strip().splitlines()) == 1 and "--interpret" in result.stderr
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    result = run("--interpret", "--out", str(existing), cwd=tmp_path)
    assert result.returncode == 2 and "exists" in result.stderr
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]
