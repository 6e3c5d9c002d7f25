"""benchmarks/reproduce/power.py runs on every committed report: each inconclusive sign-test row with numbers gets
the seeds it needs, and that count holds against scipy's binomial (80% power at Holm's strictest level, the
exact two-sided sign test at that level computed by scipy.stats.binomtest)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from scipy.stats import binom, binomtest

ROOT = Path(__file__).resolve().parents[2]
REPORTS = sorted(p for p in (ROOT / "benchmarks" / "reproduce").glob("*.json") if p.name != "seeds.json")
LINE = re.compile(r"^(\S+): (\d+) of (\d+) on the paper's side; seeds needed (\d+|None) \(chance")


def _power(n: int, chance: float, alpha: float) -> float:
    """P(the exact sign test rejects at `alpha`) with `n` seeds each on the paper's side with `chance`."""
    k = next((k for k in range(n // 2, n + 1) if binomtest(k, n, 0.5).pvalue <= alpha), None)
    return 0.0 if k is None else binom.sf(k - 1, n, max(chance, 1 - chance))


@pytest.mark.parametrize("report", REPORTS, ids=lambda p: p.name)
def test_power_runs_on_the_committed_report(report):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reproduce" / "power.py"), str(report)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and not done.stderr, done.stderr
    judged = json.loads(report.read_text())["directions"]
    alpha = 0.05 / sum(e["verdict"] in ("yes", "no", "inconclusive") for e in judged)
    wanted = {e["name"] for e in judged if e["test"] == "sign" and e["verdict"] == "inconclusive"
              and any(v["value"] is not None for v in e["per_seed"].values())}
    found = {m[1]: m for m in map(LINE.match, done.stdout.splitlines()) if m}
    assert set(found) == wanted
    for name, m in found.items():
        if m[4] != "None" and int(m[4]) <= 300:  # binomtest is slow beyond
            side, n, needed = int(m[2]), int(m[3]), int(m[4])
            assert _power(needed, side / n, alpha) >= 0.8 > _power(needed - 1, side / n, alpha), name
