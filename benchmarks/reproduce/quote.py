"""Writes each committed report's page beside it (`demo.md` from `demo.json`, `confirm.md` from `confirm.json`, ...:
a `make demo` / `make confirm` run's `directions.json`): what the run trained and every row's verdict, as
`gated_qwen.analysis.miniature.verdicts` renders them. And rewrites the verdict tables that README.md,
docs/analysis.md and benchmarks/RESULTS.md quote from those reports, so that they say what the report says, word for
word. A table is quoted after a marker line

    <!-- quotes: benchmarks/reproduce/confirm.json -->                 every row of that report
    <!-- quotes: benchmarks/reproduce/confirm.json: sink m-act/... -->  these rows, in this order

and is replaced by those rows as `gated_qwen.analysis.miniature.verdicts.directions_table` renders them (its header
line and separator included). tests/analysis/test_report_quotes.py checks the pages against the reports.

    .venv/bin/python benchmarks/reproduce/quote.py          # after committing a new report
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from gated_qwen.analysis.miniature.verdicts import directions_table, quantization_verdicts, seed_list

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/analysis.md", "benchmarks/RESULTS.md")
REPORTS = tuple(sorted(p for p in Path(__file__).resolve().parent.glob("*.json") if p.name != "seeds.json"))


def report_page(path: Path) -> str:
    """The page beside the report at `path`: its run (preset, seeds per family, CPU, the rows' commit and the
    checkout's), every row's verdicts, low bits beside the controls, and the rows the plan did not run."""
    report = json.loads(path.read_text())
    meta, judged = report["meta"], report["directions"]
    seeds = "; ".join(f"`{family}` {seed_list(seeds)}" for family, seeds in meta["seeds"].items())
    tested = sum(d["verdict"] in ("yes", "no", "inconclusive") for d in judged)
    lines = [f"# `{path.name}`: `gated-qwen reproduce --preset {meta['preset']}`", "",
             f"Written by `benchmarks/reproduce/quote.py` from `{path.name}`, the run's `directions.json`. Seeds: "
             f"{seeds}. {meta['device']}; rows of commit {meta['directions_commit'][:7]}, run from a clean checkout "
             f"of {meta['head'][:7]}. {len(judged)} rows judged, {tested} tested (Holm and FDR over those).", "",
             directions_table(judged)]
    if quant := quantization_verdicts(judged):
        lines += ["", "Low bits beside each variant's sink and M-Act (medians over the baseline's):", "", quant]
    if report["not_run"]:
        lines += ["", "Declared rows this plan did not train: " + ", ".join(f"`{n}`" for n in report["not_run"]) + "."]
    return "\n".join(lines) + "\n"
MARKER = re.compile(r"<!-- quotes: (\S+?)(?:: ([^>]*?))? -->")


def quoted_table(source: str, names: str | None) -> list[str]:
    """The table a marker asks for: the header, the separator and the rows of `names` (None: every row)."""
    judged = json.loads((ROOT / source).read_text())["directions"]
    if names:
        by_name = {d["name"]: d for d in judged}
        missing = [n for n in names.split() if n not in by_name]
        if missing:
            raise SystemExit(f"{source} has no direction {missing}")
        judged = [by_name[n] for n in names.split()]
    return directions_table(judged).splitlines()


def requote(text: str) -> str:
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        out.append(lines[i])
        marker = MARKER.search(lines[i])
        i += 1
        if marker:
            while i < len(lines) and lines[i].startswith("|"):  # the old table
                i += 1
            out.extend(quoted_table(marker[1], marker[2]))
    return "\n".join(out) + "\n"


def main() -> int:
    for report in REPORTS:
        report.with_suffix(".md").write_text(report_page(report))
    for page in sys.argv[1:] or PAGES:
        path = ROOT / page
        path.write_text(requote(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
