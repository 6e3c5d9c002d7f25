"""Runs a documentation page's examples, the skipped ones that name a make target included, in the interpreter of
that target's environment: how `make test-mlx` and `make test-onnx` run the examples the main suite cannot (they
need mlx-lm or ONNX Runtime). The page runs whole, as `tests/test_docs.py` runs it, so the blocks before an example
(the tiny folders, the conversion) are the ones the reader runs."""

import os
import subprocess
import sys
from pathlib import Path

from tests.test_docs import PAGE_TIMEOUT_S, PAGES, ROOT, parse, relative


def pages_naming(target: str) -> list[Path]:
    """The pages with a skipped block whose reason names `target`."""
    return [page for page in PAGES if any(block.skip and target in block.skip for block in parse(page))]


def run_page_with(page: Path, target: str, folder: Path) -> None:
    """Runs `page` in `folder` with this interpreter, the blocks skipped for `target` included; fails with the
    output unless every block ran and each of those was among them."""
    folder.mkdir(parents=True)
    wanted = [block.line for block in parse(page) if block.skip and target in block.skip]
    result = subprocess.run([sys.executable, "-m", "tests.test_docs", str(page), str(folder)], cwd=ROOT,
                            capture_output=True, text=True,
                            env=dict(os.environ, DOC_TEST_UNSKIP=target, OMP_NUM_THREADS="1"),
                            timeout=PAGE_TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{output[-8000:]}\n{relative(page)}: an example failed"
    ran = [line for line in wanted if f"--- {relative(page)}:{line} " in output]
    assert ran == wanted, f"{relative(page)}: the blocks at lines {sorted(set(wanted) - set(ran))} did not run"
