"""README.md, docs/analysis.md and benchmarks/RESULTS.md quote the committed reports of `make demo` and `make confirm`
(`benchmarks/reproduce/demo.json` and `confirm.json`, each a run's `directions.json`) word for word: the table after a
`<!-- quotes: FILE[: NAMES] -->` marker is that report's table (of those rows) exactly as
`reproduce_report.directions_table` renders it (`benchmarks/reproduce/quote.py` writes it), and every
"`name` **verdict**" in the text says the verdict of the report whose marker came last (a verdict before any marker
fails). And each committed verdict follows from the committed per-seed numbers by the rule of `stats`."""

import json
import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "reproduce"))
from quote import MARKER, quoted_table  # noqa: E402

from gated_qwen.analysis import stats
from gated_qwen.analysis.directions import DIRECTIONS

ROOT = Path(__file__).resolve().parents[2]
REPORTS = tuple(sorted(str(path.relative_to(ROOT)) for path in (ROOT / "benchmarks" / "reproduce").glob("*.json")))
PAGES = ("README.md", "docs/analysis.md", "benchmarks/RESULTS.md")
INLINE = re.compile(r"`([a-z0-9/.\-]+)` \*\*(yes|no|inconclusive|not testable here)\*\*")


def report(name: str) -> dict:
    return json.loads((ROOT / name).read_text())


@pytest.mark.parametrize("name", REPORTS)
def test_each_committed_verdict_follows_from_its_per_seed_numbers(name):
    judged = report(name)["directions"]
    rows = {d.name: d for d in DIRECTIONS}
    verdicts = {}
    assert judged, name
    for entry in judged:
        row = rows[entry["name"]]
        values = [e["value"] for e in entry["per_seed"].values() if e["value"] is not None and not math.isnan(e["value"])]
        interval = stats.median_interval(values)
        assert (interval["low"], interval["high"]) == (entry["interval"]["low"], entry["interval"]["high"])
        assert [int(seed) for seed in entry["per_seed"]] == entry["seeds"]
        assert not set(entry["seeds"]) & set(entry["meta"]["tuning_seeds"])  # tuning seeds are never evidence
        blocked = any(verdicts.get(r) != "yes" for r in row.requires)
        expected = "not testable here" if blocked else stats.verdict(interval, row.threshold, row.side)
        assert entry["verdict"] == expected, entry["name"]
        assert (entry["claim"], entry["threshold"], entry["side"]) == (row.claim, row.threshold, row.side)
        verdicts[entry["name"]] = entry["verdict"]


@pytest.mark.parametrize("page", PAGES)
def test_the_pages_quote_the_committed_reports_word_for_word(page):
    verdicts = {name: {d["name"]: d["verdict"] for d in report(name)["directions"]} for name in REPORTS}
    lines = (ROOT / page).read_text().splitlines()
    source, quoted = None, 0
    for number, line in enumerate(lines, start=1):
        if marker := MARKER.search(line):
            source = marker[1]
            assert source in REPORTS, f"{page}:{number}: quotes {source}, not a committed report"
            wanted = quoted_table(source, marker[2])
            table = lines[number:number + len(wanted)]
            after = lines[number + len(wanted)] if number + len(wanted) < len(lines) else ""
            assert table == wanted and not after.startswith("|"), f"{page}:{number}: not the table of {source}"
            quoted += len(table) - 2
        for name, verdict in INLINE.findall(line):
            assert source is not None, f"{page}:{number}: `{name}` **{verdict}** quotes no report (no marker above it)"
            assert verdicts[source].get(name) == verdict, f"{page}:{number}: `{name}` is not {verdict} in {source}"
            quoted += 1
    assert quoted, f"{page} quotes no verdict"
