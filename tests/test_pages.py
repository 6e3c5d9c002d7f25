"""The front page and the developer's pages stay short and say what is (CONTRIBUTING.md, "Documentation"): README.md
at most 200 lines, CONTRIBUTING.md at most 9,000 characters, docs/analysis.md at most 25,000 (the reports' tables
live beside them, benchmarks/reproduce/*.md), the Makefile at most 9,000 and the other environments' recipes
(requirements/environments.mk) at most 6,000; `make help` has a line for every target the two define; no page
speaks of sessions or names an issue in a heading (history lives in git, timings in benchmarks/RESULTS.md)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKEFILES = [ROOT / "Makefile", ROOT / "requirements" / "environments.mk"]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "benchmarks").glob("*.md"))]


def test_the_front_page_and_the_manuals_stay_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    assert len((ROOT / "CONTRIBUTING.md").read_text()) <= 9_000
    assert len((ROOT / "docs" / "analysis.md").read_text()) <= 25_000
    assert len((ROOT / "Makefile").read_text()) <= 9_000
    assert len(MAKEFILES[1].read_text()) <= 6_000


def makefile_targets(text: str) -> set[str]:
    """The targets a user can name: the rules' literal targets (not files, variables or patterns) and the test-NAME
    rules the TESTS pattern makes for each NAME of its `foreach` line."""
    targets = set()
    for line in text.splitlines():
        rule = re.match(r"^([a-z][\w-]*(?: [a-z][\w-]*)*)\s*:(?!=)", line)
        if rule:
            targets.update(rule[1].split())
    for names in re.findall(r"\$\(foreach e,([\w ]+),\$\(eval \$\(call TESTS,", text):
        targets.update(f"test-{name}" for name in names.split())
    return targets


def makefiles_text() -> str:
    """The Makefile and the file it includes, as one text."""
    return "\n".join(path.read_text() for path in MAKEFILES)


def test_make_help_lists_every_target_once():
    text = makefiles_text()
    listed = re.findall(r"^## ([\w-]+)\s+\S", text, flags=re.M)
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == makefile_targets(text)


def test_makefile_targets_reads_the_pattern_rules():
    """The parser above, on a made-up Makefile: a variable, a file rule and a pattern's instances."""
    text = ("A := 1\nsetup: $(STAMP)\n$(STAMP): x\nlock lock-a: y\n.venv/.x: z\n"
            "$(foreach e,mlx onnx,$(eval $(call TESTS,$(e))))\n")
    assert makefile_targets(text) == {"setup", "lock", "lock-a", "test-mlx", "test-onnx"}


def _prose(text: str) -> str:
    """`text` without its fenced blocks and code spans (an `InferenceSession` in an example is code)."""
    text = re.sub(r"^ *(```|~~~).*?^ *\1", "", text, flags=re.S | re.M)
    return re.sub(r"(`+).*?\1", "", text, flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_say_what_is(page):
    prose = _prose(page.read_text())
    assert not re.findall(r"(?i)\bsessions?\b", prose), f"{page.name} speaks of sessions"
    history = [h for h in re.findall(r"^#+ .*$", prose, flags=re.M) if re.search(r"(?i)\bissues? \d", h)]
    assert not history, f"{page.name}: headings that tell history: {history}"


def test_the_license_file_is_the_one_pyproject_declares():
    declared = re.findall(r'^license = "(.*)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert declared == ["MIT"] and (ROOT / "LICENSE").read_text().startswith("MIT License\n")
