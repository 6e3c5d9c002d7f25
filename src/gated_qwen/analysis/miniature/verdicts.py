"""The verdict tables of a `reproduce` report, as markdown: every judged row with its numbers, its raw verdict and
the corrected ones (`directions_table`, which docs/analysis.md, README.md and benchmarks/RESULTS.md quote word for
word: benchmarks/reproduce/quote.py), low bits beside the controls, and every per-seed number."""

from __future__ import annotations

import math

from ..quantize import SCHEMES
from ..report import markdown_table
from . import directions


def seed_list(seeds: list[int]) -> str:
    """`[10, 11, 12, 15]` -> "10-12, 15"."""
    runs, text = [], []
    for seed in sorted(seeds):
        if runs and seed == runs[-1][1] + 1:
            runs[-1][1] = seed
        else:
            runs.append([seed, seed])
    for low, high in runs:
        text.append(str(low) if low == high else f"{low}-{high}")
    return ", ".join(text)


def number(value: float | None) -> str:
    """A per-seed number, median or bound as the report prints it: 3 significant digits or so."""
    if value is None:
        return "–"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    size = abs(value)
    if 0 < size < 0.001:
        return f"{value:.1e}"
    return f"{value:.0f}" if size >= 100 else f"{value:.1f}" if size >= 10 else f"{value:.2f}" if size >= 1 else (
        f"{value:.3f}")


def p_text(p: float | None) -> str:
    return "–" if p is None else f"{p:.2g}" if p >= 0.001 else f"{p:.1e}"


def interval_text(row: dict) -> str:
    """The test's outcome: the sign test's interval with its coverage, or the McNemar test's failures."""
    if row.get("mcnemar"):
        m = row["mcnemar"]
        return (f"failures {m['variant_failures']} vs {m['against_failures']} of {m['pairs']}; discordant "
                f"{m['variant_only']} vs {m['against_only']}")
    interval = row["interval"]
    if interval is None:
        return "–"
    if interval["low"] is None:
        return f"unbounded ({interval['n']} seeds; a 95% interval needs 6)"
    return f"[{number(interval['low'])}, {number(interval['high'])}] ({100 * interval['coverage']:.1f}%)"


def detectable_text(row: dict) -> str:
    """The smallest detectable effect (80% power) at 5% and at Holm's strictest level: "0.83 / 0.95"."""
    found = row.get("detectable") or {}
    shares = [found.get(key) and number(found[key]["share"]) for key in ("raw", "holm")]
    return "–" if not any(shares) else " / ".join(share or "none" for share in shares)


def directions_table(judged: list[dict]) -> str:
    """The verdict table: one row per judged direction (the pages quote these rows word for word)."""
    return markdown_table(
        ["direction", "claim", "paper", "seeds", "median", "95% interval or failures", "p", "verdict", "Holm", "FDR",
         "detectable (5% / Holm)"],
        [[f"`{d['name']}`", d["claim"], d["paper"] or "–", f"{len(d['seeds'])} ({seed_list(d['seeds'])})"
          if d["seeds"] else "–", number(d["median"]), interval_text(d), p_text(d["p"]), f"**{d['verdict']}**",
          d["adjusted"]["holm"], d["adjusted"]["fdr"], detectable_text(d)] for d in judged])


def quantization_verdicts(judged: list[dict]) -> str | None:
    """Low bits with the controls in one table: per variant of the main models, its F-Attn and M-Act over the
    baseline's (medians) beside each scheme's verdict and median increase difference (percentage points)."""
    rows = {d["name"]: d for d in judged}
    table = []
    for v in directions.QUANT_VARIANTS:
        if f"quant/w4a4/{v}" not in rows:
            continue
        sink = rows.get(f"sink-removal/{v}") or rows.get(f"sink-kept/{v}")
        act = rows.get(f"m-act/{v}")
        table.append([directions.NAMES[v], number(sink and sink["median"]), number(act and act["median"]),
                      *(f"**{rows[f'quant/{s}/{v}']['verdict']}**, {number(rows[f'quant/{s}/{v}']['median'])}"
                        for s in SCHEMES)])
    return markdown_table(["variant", "F-Attn / baseline's", "M-Act / baseline's",
                           *(f"{s}: loses less? (median difference, points)" for s in SCHEMES)], table) if table else None


HOW = ("Each direction is a row declared in `gated_qwen/analysis/miniature/directions.py` before the runs that judge "
       "it (`meta.directions_commit`: the commit that last changed it). Per seed, a variant is compared with the "
       "baseline (or another variant) trained on the same seed (a difference or a ratio), or a variant's number is "
       "taken alone. The 95% interval is the exact sign test's for the median of those numbers (order statistics; "
       "its exact coverage in brackets); no interval exists below 6 seeds. Verdict: **yes** when the interval lies "
       "wholly on the paper's side of the threshold, **no** when it lies wholly on the other side, **inconclusive** "
       "otherwise; **not testable here** when a set-up direction it rests on is not yes. A failure-rate row is the "
       "exact McNemar test of the failures paired by seed (yes / no at p <= 5%). p: the row's p-value (the sign "
       "test's that matches its interval, or McNemar's). Holm and FDR: the verdict after Holm's correction "
       "(family-wise error 5%) and Benjamini-Hochberg's (false discovery rate 5%) over the tested rows of this "
       "report; a yes or no the correction does not keep is inconclusive. detectable: the smallest effect the test "
       "finds with 80% power at its seeds, at 5% and at Holm's strictest level (for a median: the share of seeds "
       "that must fall on the paper's side; for failures: the failure rate the other model must have where this "
       "one never fails); none: no effect can be. Seeds on which a set-up was chosen are never evidence "
       "(report.json: `meta` of each direction).")


def directions_section(judged: list[dict], not_run: list[str]) -> list[str]:
    """The directions part of report.md: how they are judged, the verdict table, low bits with their controls and
    every per-seed number."""
    quant = quantization_verdicts(judged)
    return [
        "## The paper's directions: per-seed comparisons, 95% intervals, verdicts, corrected verdicts",
        HOW,
        directions_table(judged),
        *((f"Not run here (their models were not trained): {', '.join(f'`{n}`' for n in not_run)}.",) if not_run
          else ()),
        *(("### Low bits beside the controls (main models)", quant,
           "A gate that helps quantization through the sink should help where F-Attn falls; through M-Act, where "
           "M-Act falls.") if quant else ()),
        "### Per-seed numbers",
        markdown_table(["direction", "the number per seed", "seed: number"],
                       [[f"`{d['name']}`", d["comparison"].split(";")[0],
                         ", ".join(f"{seed}: {number(e['value'])}" for seed, e in d["per_seed"].items())]
                        for d in judged]),
    ]
