"""Each committed report of `make demo` and `make confirm` (`benchmarks/reproduce/*.json`, each a run's
`directions.json`) has its page beside it (`demo.md`, `confirm.md`, ...), which `benchmarks/reproduce/quote.py` writes
from it. README.md, docs/analysis.md and benchmarks/RESULTS.md quote the reports word for word: the table after a
`<!-- quotes: FILE[: NAMES] -->` marker is that report's table (of those rows) exactly as
`miniature.verdicts.directions_table` renders it (`benchmarks/reproduce/quote.py` writes it), every
"`name` **verdict**" in the text says the raw verdict of the report whose marker came last and every
"`name` Holm **verdict**" its verdict under Holm's correction (a verdict before any marker fails), and "`name`
**pending**" a row declared after that report's run (`pending`); a `<!-- verdicts: FILE -->` marker names the report
of the verdicts after it without quoting its table (README.md's paragraph). And each committed
verdict, raw and corrected, follows from the committed per-seed numbers by the rules of `stats`, with the rows as
`directions.py` declares them; each report names the commit of the rows it ran (and they were committed in a clean
tree), and the confirmatory run's evidence seeds are seeds the demo never reports."""

import json
import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "reproduce"))
from quote import MARKER, quoted_table, report_page  # noqa: E402

from gated_qwen.analysis.miniature import stats
from gated_qwen.analysis.miniature.directions import DIRECTIONS

ROOT = Path(__file__).resolve().parents[2]
REPORTS = tuple(sorted(str(path.relative_to(ROOT)) for path in (ROOT / "benchmarks" / "reproduce").glob("*.json")
                       if path.name != "seeds.json"))  # the seed ledger, not a report
PAGES = ("README.md", "docs/analysis.md", "benchmarks/RESULTS.md")
VERDICT = r"(yes|no|inconclusive|not testable here)"
INLINE = re.compile(rf"`([a-z0-9/.\-]+)` \*\*{VERDICT}\*\*")
INLINE_HOLM = re.compile(rf"`([a-z0-9/.\-]+)` Holm \*\*{VERDICT}\*\*")
VERDICTS_OF = re.compile(r"<!-- verdicts: (\S+) -->")
INLINE_PENDING = re.compile(r"`([a-z0-9/.\-]+)` \*\*pending\*\*")


def report(name: str) -> dict:
    return json.loads((ROOT / name).read_text())


def _values(entry: dict) -> list[float]:
    return [e["value"] for e in entry["per_seed"].values() if e["value"] is not None and not math.isnan(e["value"])]


def _raw_verdict(entry: dict, row, verdicts: dict) -> str:
    """The raw verdict from the committed per-seed numbers: the sign test's interval, or McNemar's test on the
    committed measurements (a failure: above the row's threshold)."""
    if any(verdicts.get(r) != "yes" for r in row.requires):
        return "not testable here"
    if row.test == "mcnemar":
        pairs = [(e["measured"][row.variant] > row.threshold, e["measured"][row.against] > row.threshold)
                 for e in entry["per_seed"].values() if e["value"] is not None]
        test = stats.mcnemar(pairs, row.side)
        assert test == entry["mcnemar"] and test["p"] == entry["p"], entry["name"]
        return test["verdict"]
    values = _values(entry)
    interval = stats.median_interval(values)
    assert (interval["low"], interval["high"]) == (entry["interval"]["low"], entry["interval"]["high"])
    assert entry["p"] == stats.interval_p(values, row.threshold)
    return stats.verdict(interval, row.threshold, row.side)


@pytest.mark.parametrize("name", REPORTS)
def test_each_committed_verdict_follows_from_its_per_seed_numbers(name):
    judged = report(name)["directions"]
    rows = {d.name: d for d in DIRECTIONS}
    verdicts = {}
    assert judged, name
    for entry in judged:
        row = rows[entry["name"]]
        assert (entry["claim"], entry["threshold"], entry["side"], entry["test"]) == (
            row.claim, row.threshold, row.side, row.test)
        if not entry["per_seed"]:  # a family the run declared untestable
            assert entry["verdict"] == "not testable here" and entry["not_testable_because"], entry["name"]
        else:
            assert [int(seed) for seed in entry["per_seed"]] == entry["seeds"]
            assert not set(entry["seeds"]) & set(entry["meta"]["tuning_seeds"])  # tuning seeds are never evidence
            assert entry["verdict"] == _raw_verdict(entry, row, verdicts), entry["name"]
        verdicts[entry["name"]] = entry["verdict"]
    # the corrections over the rows of the report, recomputed from the committed verdicts and p-values
    recomputed = [{"name": e["name"], "verdict": e["verdict"], "p": e["p"], "requires": e["requires"]} for e in judged]
    stats.adjust(recomputed)
    assert [r["adjusted"] for r in recomputed] == [e["adjusted"] for e in judged]
    tested = sum(e["verdict"] in stats.VERDICTS for e in judged)
    for entry in judged:
        n = len(_values(entry)) if entry["test"] == "sign" else entry["mcnemar"]["pairs"] if entry["per_seed"] else 0
        assert entry["detectable"]["raw"] == (stats.detectable(entry["test"], n) if n else None), entry["name"]
        assert entry["detectable"]["holm"] == (stats.detectable(entry["test"], n, stats.ALPHA / tested) if n
                                               else None), entry["name"]


def pending(name: str) -> set[str]:
    """The rows the checkout declares that the report neither judged nor listed as not run: rows declared after the
    report's run, waiting for the next run of its preset."""
    held = {entry["name"] for entry in report(name)["directions"]} | set(report(name)["not_run"])
    return {row.name for row in DIRECTIONS} - held


@pytest.mark.parametrize("name", REPORTS)
def test_each_report_names_the_committed_rows_it_ran(name):
    """The rows were committed, in a clean tree, before the run (`meta.directions_commit`, the last commit of
    directions.py as run). Either the file as run is this checkout's, byte for byte, or the checkout has only added
    rows since (pending: declared before the run that will judge them) and declares every row the report judged
    exactly as it was run: a row changed after the run fails here until a new run (on new evidence seeds) replaces
    the report."""
    import datetime
    import hashlib

    from gated_qwen.analysis.miniature import directions
    from gated_qwen.analysis.miniature.judge import declared

    meta = report(name)["meta"]
    assert len(meta["directions_commit"]) == 40 and meta["directions_file_clean"] is True
    assert datetime.datetime.fromisoformat(meta["directions_commit_date"]) < datetime.datetime.fromisoformat(
        meta["started_at"]), "the rows were committed after the run started"
    assert meta["tree_clean"] is True, f"{name} was run from a working tree with uncommitted changes"
    rows = {row.name: row for row in DIRECTIONS}
    for entry in report(name)["directions"]:
        as_declared = declared(rows[entry["name"]])
        assert {key: entry[key] for key in as_declared} == as_declared, f"{entry['name']} changed since {name} was run"
    if hashlib.sha256(Path(directions.__file__).read_bytes()).hexdigest() == meta["directions_sha256"]:
        assert not pending(name), name
    else:
        assert pending(name), f"directions.py changed since {name} was run, and not by adding rows"


@pytest.mark.parametrize("name", [name for name in REPORTS if report(name)["meta"]["preset"] == "confirm"])
def test_the_confirmatory_evidence_is_fresh(name):
    """No seed of a confirmatory run's evidence is a seed the demo reports."""
    demo = report("benchmarks/reproduce/demo.json")
    demo_seeds = {seed for entry in demo["directions"] for seed in entry["seeds"]}
    confirm_seeds = {seed for entry in report(name)["directions"] for seed in entry["seeds"]}
    assert confirm_seeds and not demo_seeds & confirm_seeds


@pytest.mark.parametrize("name", REPORTS)
def test_each_report_has_its_page_beside_it(name):
    """`demo.md` beside `demo.json` (and so on) is what quote.py writes from the report now, and names every row."""
    path = ROOT / name
    page = path.with_suffix(".md").read_text()
    assert page == report_page(path), f"{path.with_suffix('.md').name}: run benchmarks/reproduce/quote.py"
    assert all(f"`{entry['name']}`" in page for entry in report(name)["directions"])


@pytest.mark.parametrize("page", PAGES)
def test_the_pages_quote_the_committed_reports_word_for_word(page):
    judged = {name: {d["name"]: d for d in report(name)["directions"]} for name in REPORTS}
    text = (ROOT / page).read_text()
    split = re.findall(rf"`[a-z0-9/.\-]+`(?: Holm)?\s*\n\s*(?:Holm\s+)?\*\*{VERDICT}\*\*", text)
    assert not split, f"{page}: a quoted verdict split over two lines is checked by nothing: {split}"
    lines = text.splitlines()
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
        elif marker := VERDICTS_OF.search(line):
            source = marker[1]
            assert source in REPORTS, f"{page}:{number}: names {source}, not a committed report"
        for pattern, verdict_of in ((INLINE, lambda d: d["verdict"]), (INLINE_HOLM, lambda d: d["adjusted"]["holm"])):
            for name, verdict in pattern.findall(line):
                assert source is not None, f"{page}:{number}: `{name}` **{verdict}** quotes no report (no marker above)"
                row = judged[source].get(name)
                assert row is not None and verdict_of(row) == verdict, f"{page}:{number}: `{name}` is not {verdict} " \
                                                                       f"in {source}"
                quoted += 1
        for name in INLINE_PENDING.findall(line):
            assert source is not None and name in pending(source), f"{page}:{number}: `{name}` is not pending in " \
                                                                    f"{source}"
    assert quoted, f"{page} quotes no verdict"
