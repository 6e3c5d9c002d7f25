"""Rewrites the verdict tables that README.md, docs/analysis.md and benchmarks/RESULTS.md quote from the committed
reports (`demo.json`, `confirm.json`: a `make demo` / `make confirm` run's `directions.json`), so that they say what
the report says, word for word. A table is quoted after a marker line

    <!-- quotes: benchmarks/reproduce/confirm.json -->                 every row of that report
    <!-- quotes: benchmarks/reproduce/confirm.json: sink m-act/... -->  these rows, in this order

and is replaced by those rows as `gated_qwen.analysis.miniature.verdicts.directions_table` renders them (its header
line and separator included). tests/analysis/test_report_quotes.py checks the pages against the reports.

    .venv/bin/python benchmarks/reproduce/quote.py          # after committing a new demo.json or confirm.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from gated_qwen.analysis.miniature.verdicts import directions_table

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/analysis.md", "benchmarks/RESULTS.md")
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
    for page in sys.argv[1:] or PAGES:
        path = ROOT / page
        path.write_text(requote(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
