"""The seeds a row needs, from a committed report's per-seed numbers (docs/analysis.md quotes the output).

    .venv/bin/python benchmarks/reproduce/power.py [benchmarks/reproduce/confirm.json]
    .venv/bin/python benchmarks/reproduce/power.py --search runs/search47.jsonl   # table1-spread's tuning seeds

- Each inconclusive sign-test row with numbers: the fewest seeds at which the test says yes (or no) with 80%
  probability at Holm's strictest level (5% over the report's tested rows), when each seed falls on the row's side
  of its threshold with the chance seen in the report, k/n, and, less optimistically, (k+1)/(n+2); "none" when that
  chance is 1/2.
- With --search: the same count for each table-1 comparison from search.py's table1-spread runs (the tuning seeds
  of the candidate it ran), at Holm's level over the committed confirmatory report's tested rows.
- Each failure row (exact McNemar test): the chance that the test keeps a verdict under Holm's correction at 30, 40
  and 60 seeds, simulated (4,000 draws) with the against-variant failing at the report's rate and the variant never.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from scipy.stats import binom

from gated_qwen.analysis.miniature import stats

POWER = 0.8


def seeds_for(chance: float, alpha: float, most: int = 2000) -> int | None:
    """The fewest seeds at which the sign test decides with probability POWER when each seed decides its way with
    `chance` (None: not within `most`, or no number of seeds at a chance of one half)."""
    if abs(chance - 0.5) < 1e-12:
        return None
    n = np.arange(6, most)
    other = binom.ppf(alpha / 2, n, 0.5)  # the most seeds on the other side at which the test rejects: that or one less
    other = np.where(2 * binom.cdf(other, n, 0.5) <= alpha, other, other - 1)
    power = np.where(other >= 0, binom.sf(n - other - 1, n, max(chance, 1 - chance)), 0.0)
    found = np.flatnonzero(power >= POWER)
    return int(n[found[0]]) if found.size else None


def mcnemar_power(n: int, rate: float, alpha: float, draws: int = 4000, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    kept = 0
    for failures in rng.random((draws, n)) < rate:
        test = stats.mcnemar([(False, bool(f)) for f in failures], "below")
        kept += test["verdict"] == "yes" and test["p"] <= alpha
    return kept / draws


COMPARISONS = (("g1-elementwise", "baseline"), ("g1-elementwise", "g1-headwise"), ("g1-headwise", "g2-value"),
               ("g2-value", "baseline"), ("g1-elementwise", "g5-dense"))  # table 1's rows: the first's loss lower


def from_search(path: str, report: str = "benchmarks/reproduce/confirm.json") -> int:
    judged = json.loads(Path(report).read_text())["directions"]
    alpha = stats.ALPHA / sum(entry["verdict"] in stats.VERDICTS for entry in judged)
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    loss = {(r["variant"], r["seed"]): r["heldout_loss"] for r in rows if r["family"] == "table1-spread"
            or (r["family"] == "table1-learned" and r["variant"] == "baseline" and r["candidate"].startswith("U1"))}
    for mine, theirs in COMPARISONS:
        seeds = sorted(seed for variant, seed in loss if variant == mine and (theirs, seed) in loss)
        differences = [loss[mine, seed] - loss[theirs, seed] for seed in seeds]
        side, n = sum(d < 0 for d in differences), len(differences)
        print(f"{mine} below {theirs}: {side} of {n} tuning seeds ({', '.join(f'{d:+.4f}' for d in differences)}); "
              f"seeds needed {seeds_for(side / n, alpha)} (chance {side}/{n}) to "
              f"{seeds_for((side + 1) / (n + 2), alpha)} (chance {side + 1}/{n + 2})")
    return 0


def main(path: str = "benchmarks/reproduce/confirm.json") -> int:
    judged = json.loads(Path(path).read_text())["directions"]
    tested = sum(entry["verdict"] in stats.VERDICTS for entry in judged)
    alpha = stats.ALPHA / tested
    print(f"{path}: {tested} tested rows; Holm's strictest level {alpha:.2g}")
    for entry in judged:
        values = [e["value"] for e in entry["per_seed"].values() if e["value"] is not None]
        if entry["test"] == "sign" and entry["verdict"] == "inconclusive" and values:
            side = sum((v < entry["threshold"]) if entry["side"] == "below" else (v > entry["threshold"])
                       for v in values)
            n = len(values)
            print(f"{entry['name']}: {side} of {n} on the paper's side; seeds needed "
                  f"{seeds_for(side / n, alpha)} (chance {side}/{n}) to {seeds_for((side + 1) / (n + 2), alpha)} "
                  f"(chance {side + 1}/{n + 2})")
        if entry["test"] == "mcnemar" and entry["mcnemar"]["pairs"]:
            rate = entry["mcnemar"]["against_failures"] / entry["mcnemar"]["pairs"]
            print(f"{entry['name']}: against-variant failing at {rate:.3f}, the variant never; Holm over {tested} "
                  "rows: power " + ", ".join(f"{n} seeds {mcnemar_power(n, rate, alpha):.2f}" for n in (30, 40, 60)))
    return 0


if __name__ == "__main__":
    sys.exit(from_search(sys.argv[2]) if sys.argv[1:2] == ["--search"] else main(*sys.argv[1:]))
