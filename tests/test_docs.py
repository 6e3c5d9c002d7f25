"""Every example in the documentation runs (README.md, CONTRIBUTING.md, docs/*.md), so the docs cannot rot.

The convention, per page (CONTRIBUTING.md, "Documentation"):
- Every fenced block has an info string. ```python blocks run in order, in one fresh interpreter for the page (the
  page's blocks share their variables), from a temporary working folder; ```bash blocks run there with
  `bash -e -o pipefail`, this environment's `bin/` first on PATH (the `gated-qwen` command), Hugging Face caches
  fresh and empty (tests/conftest.py) and `HF_HUB_OFFLINE=1`. Other info strings (`text`, `yaml`, `bibtex`, ...)
  are not run; `py`, `sh`, `shell`, `console` are refused, so no example escapes by its spelling.
- Hidden blocks run where they stand, in the page's interpreter: `<!-- doc-test: setup` NEWLINE python NEWLINE
  `-->` prepares what the reader need not see (tiny folders under the names the text uses; the folder builders
  of tests/helpers.py, `from tests.helpers import tiny_release_folder`), `<!-- doc-test: check` ... `-->` asserts
  what the text says the example does.
- `<!-- doc-test: skip (reason) -->` on the line before a python or bash block: not run here. Kept for what cannot
  run in this environment: a GPU, the network, hours, installing, another environment's engine; the make targets
  and test files the reason names must exist (`test_blocks_not_run_name_what_runs_them`).

A failure names the page and the block's line; a traceback's lines are the page's own. One page by hand (in a new
temporary folder, or in FOLDER): `.venv/bin/python -m tests.test_docs docs/conversion.md [FOLDER]`. With
`DOC_TEST_UNSKIP=TEXT` in the environment, the skipped blocks whose reason contains TEXT run too: a make target with
its own environment (`make test-mlx`, `make test-onnx`) runs the page so, with that environment's interpreter, for
the examples its reason names it as running.
"""

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "GPU.md"]
# Pages whose examples take more than ~20 s of CPU (marked slow: `make test-slow` runs them, `make test` does not).
SLOW_PAGES = {"docs/analysis.md", "docs/kernel.md", "docs/conversion.md", "docs/moe.md", "docs/local.md",
              "docs/loading.md"}
# A net for a page whose examples hang, never the verdict on a slow machine: the slowest page (docs/analysis.md) takes
# about 90 CPU-seconds (3 min of wall time at a load of 10 on 2 cores), and a machine shared with other jobs can be
# 10x slower than that; 600 s once failed `make test` at a load of 15-22.
PAGE_TIMEOUT_S = 3600
# Pages that are linked before they exist, while another issue writes them (remove an entry once its page lands).
PAGES_BEING_WRITTEN: dict[str, str] = {}

RUN = ("python", "bash")
REFUSED = {"py", "python3", "pycon", "sh", "shell", "console", "zsh", "ipython"}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARKER = re.compile(r"^ *<!-- doc-test:(?P<rest>.*)$")
SKIP = re.compile(r"^ *<!-- doc-test: skip \((?P<reason>[^()]*(?:\([^()]*\)[^()]*)*)\) -->\s*$")


class DocFormatError(ValueError):
    """A page breaks the convention; the message names the page and the line."""


@dataclasses.dataclass(frozen=True)
class Block:
    kind: str        # "python", "bash", "setup", "check" (hidden python) or the info string of a block not run
    code: str
    line: int        # 1-based line of the block's first line of code in the page
    skip: str | None = None

    @property
    def runs(self) -> bool:
        return self.skip is None and self.kind in (*RUN, "setup", "check")


def relative(page: Path) -> str:
    page = page.resolve()
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def parse(page: Path) -> list[Block]:
    """The page's fenced and hidden blocks in order; raises DocFormatError on a block or marker that breaks the
    convention."""
    name, lines = relative(page), page.read_text().splitlines()
    blocks, skip, i = [], None, 0

    def error(line: int, message: str) -> DocFormatError:
        return DocFormatError(f"{name}:{line}: {message}")

    while i < len(lines):
        text, number = lines[i], i + 1
        if fence := FENCE.match(text):
            info = fence["info"].strip()
            if not info:
                raise error(number, "a fenced block without an info string: say what it is (python, bash, text, "
                                    "...)")
            kind = info.split()[0].lower()
            if kind in REFUSED:
                raise error(number, f"info string {kind!r}: write `python` or `bash` (those run) or `text`")
            indent, close = len(fence["indent"]), fence["fence"]
            body, i = [], i + 1
            while i < len(lines) and not (lines[i].strip().startswith(close[0] * len(close))
                                          and not lines[i].strip().strip(close[0])):
                body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i].lstrip())
                i += 1
            if i == len(lines):
                raise error(number, "a fenced block that is never closed")
            if skip is not None and kind not in RUN:
                raise error(skip[0], f"a skip marker before a {kind!r} block, which is not run anyway")
            blocks.append(Block(kind, "\n".join(body) + "\n", number + 1, skip[1] if skip else None))
            skip, i = None, i + 1
            continue
        if MARKER.match(text):
            if skip is not None:
                raise error(skip[0], "a skip marker that is not followed by a fenced block")
            if marked := SKIP.match(text):
                if not marked["reason"].strip():
                    raise error(number, "a skip marker without a reason")
                skip = (number, marked["reason"].strip())
            elif (kind := text.split("doc-test:", 1)[1].strip()) in ("setup", "check"):
                end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->"), None)
                if end is None:
                    raise error(number, f"a hidden {kind} block without its closing `-->` line")
                blocks.append(Block(kind, "\n".join(lines[i + 1:end]) + "\n", number + 1))
                i = end
            else:
                raise error(number, "a doc-test marker must be `<!-- doc-test: skip (reason) -->`, or "
                                    "`<!-- doc-test: setup` / `<!-- doc-test: check` + code lines + `-->`")
        elif skip is not None and text.strip():
            raise error(skip[0], "a skip marker that is not directly followed by a fenced block")
        i += 1
    if skip is not None:
        raise error(skip[0], "a skip marker at the end of the page")
    return blocks


def run_page(page: Path) -> None:
    """Runs the page's blocks in the current folder (the subprocess the test starts); exit status 1 and the page
    and line of the block on the first failure."""
    name, namespace = relative(page), {"__name__": "__main__"}
    unskip = os.environ.get("DOC_TEST_UNSKIP")  # e.g. "make test-mlx": that target runs the blocks it names
    for block in parse(page):
        if not (block.runs or unskip and block.skip and unskip in block.skip and block.kind in RUN):
            continue
        print(f"--- {name}:{block.line} ({block.kind})", flush=True)
        if block.kind == "bash":
            # Padded so that bash's own messages ($0: line N) give the page's line numbers.
            script = ("trap 'echo \"$0: line $LINENO: exit status $?\" >&2' ERR" + "\n" * (block.line - 1)
                      + block.code)
            status = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script, name], check=False).returncode
            if status:
                sys.exit(f"{name}:{block.line}: the bash block failed (exit status {status})")
        else:
            try:
                exec(compile("\n" * (block.line - 1) + block.code, str(page.resolve()), "exec"), namespace)
            except BaseException:
                traceback.print_exc()
                sys.exit(f"{name}:{block.line}: the {block.kind} block failed")
            finally:
                sys.stdout.flush()
                sys.stderr.flush()


# ------------------------------------------------------------------------------------------------------ the tests
if __name__ != "__main__":
    import pytest

    from tests.test_pages import makefile_targets, makefiles_text

    def _skipped_blocks() -> list:
        found = []
        for page in PAGES:
            try:
                found += [(page, block) for block in parse(page) if block.skip is not None]
            except DocFormatError:
                pass  # test_page_examples_run reports it
        return found

    @pytest.mark.parametrize("page", [pytest.param(p, id=relative(p), marks=[pytest.mark.slow] * (
        relative(p) in SLOW_PAGES)) for p in PAGES])
    def test_page_examples_run(page, tmp_path):
        blocks = parse(page)
        if not any(block.runs for block in blocks):
            return
        env = dict(os.environ, OMP_NUM_THREADS="1")  # the caches of tests/conftest.py, one thread as the suite
        try:
            result = subprocess.run([sys.executable, "-m", "tests.test_docs", str(page), str(tmp_path)], env=env,
                                    cwd=ROOT, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    timeout=PAGE_TIMEOUT_S)
        except subprocess.TimeoutExpired as timeout:
            output = timeout.stdout.decode(errors="replace") if isinstance(timeout.stdout, bytes) else timeout.stdout
            pytest.fail(f"{(output or '')[-6000:]}\n{relative(page)}: its examples ran past {PAGE_TIMEOUT_S} s",
                        pytrace=False)
        if result.returncode:
            pytest.fail(f"{result.stdout[-8000:]}\n{relative(page)}: an example failed (see the last lines above)",
                        pytrace=False)

    def test_blocks_not_run_name_what_runs_them():
        """A block not run says why, and what its reason names exists: each `make TARGET` is a target of the
        Makefiles, each tests/ file is there, and one said to run "this block" runs the page (DOC_TEST_UNSKIP)."""
        targets = makefile_targets(makefiles_text())
        wrong = []
        for page, block in _skipped_blocks():
            where = f"{relative(page)}:{block.line}"
            named = {a or b for a, b in re.findall(r"`make ([\w-]+)|\bmake ([a-z]+-[\w-]+)", block.skip)}
            wrong += [f"{where}: make {target}" for target in sorted(named - targets)]
            files = re.findall(r"tests/[\w/]+\.py", block.skip)
            wrong += [f"{where}: {f}" for f in files if not (ROOT / f).is_file()]
            if "runs this block" in block.skip and not any(
                    "DOC_TEST_UNSKIP" in (ROOT / f).read_text() for f in files if (ROOT / f).is_file()):
                wrong.append(f"{where}: no test file named that runs it")
        assert not wrong, wrong

    @pytest.mark.parametrize("page", PAGES, ids=relative)
    def test_page_links_resolve(page):
        """Every relative link points at a file of the repository, and a `#fragment` at a heading of its page."""
        broken = []
        for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                if relative(file) not in PAGES_BEING_WRITTEN:
                    broken.append(target)
            elif fragment and file.suffix == ".md" and fragment not in _anchors(file):
                broken.append(target)
        assert not broken, f"{relative(page)}: links to nothing: {broken}"

    def _without_fences(text: str) -> str:
        return re.sub(r"^ *(```|~~~).*?^ *\1", "", text, flags=re.S | re.M)

    def _without_code(text: str) -> str:
        """`text` without its fenced blocks and code spans."""
        return re.sub(r"(`+).*?\1", "", _without_fences(text), flags=re.S)

    def _anchors(page: Path) -> set[str]:
        """GitHub's heading anchors: lower case, punctuation but hyphens and underscores dropped, spaces as
        hyphens."""
        headings = re.findall(r"^#+ (.+)$", _without_fences(page.read_text()), flags=re.M)
        return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def main(argv: list[str]) -> None:
    if len(argv) not in (1, 2):
        sys.exit("usage: python -m tests.test_docs PAGE.md [FOLDER]   (runs the page's examples in FOLDER, by "
                 "default a new temporary folder)")
    page = Path(argv[0]).resolve()
    os.environ.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                      PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if "TRITON_INTERPRET" not in os.environ:  # as tests/conftest.py: without a GPU, Triton's interpreter
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory(prefix="doc-test-") as scratch:
        os.chdir(argv[1] if len(argv) == 2 else scratch)
        run_page(page)


if __name__ == "__main__":
    main(sys.argv[1:])
