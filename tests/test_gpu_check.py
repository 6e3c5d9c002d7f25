"""`benchmarks/gpu_check.py` without a GPU: `--interpret` runs the whole script (parallel-compile step excepted) on
tiny sizes under the Triton interpreter and must pass; on a machine without CUDA the plain command refuses with one
line, and an existing output folder is never touched."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def run(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it for --interpret
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900, check=False)


@pytest.mark.slow
def test_interpret_mode_checks_measures_and_writes_its_results(tmp_path):
    out = tmp_path / "check"
    result = run("--interpret", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]
    results = json.loads((out / "results.json").read_text())
    assert results["passed"] and results["environment"]["gpu"].startswith("none")
    rows = results["correctness"]
    layouts = {row["case"].split()[-3] for row in rows}
    assert layouts == {"dense", "varlen", "decode", "varlen-decode"} and all(row["ok"] for row in rows)
    assert all(set(row["errors"]) >= {"out"} for row in rows)
    assert any(set(row["errors"]) == {"out", "dq", "dk", "dv", "dgate"} for row in rows)
    for row in results["throughput"]:
        assert len(row["kernel"]) == 3 and len(row["sdpa_gate"]) == 3 and all(x > 0 for x in row["kernel"])
    e2e = results["end_to_end"]
    for name in ("train", "decode"):
        assert e2e[name]["ratio"] == pytest.approx(e2e[name]["gated_triton_tokens_per_s"] / e2e[name]["sdpa_tokens_per_s"])
    assert e2e["self_check"] and set(e2e["self_check"].values()) == {"passed"}
    report = (out / "results.md").read_text()
    assert report.strip() in result.stdout  # the markdown is also printed
    for heading in ("#### Correctness", "#### Kernel TFLOP/s", "#### End to end"):
        assert heading in report


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
