"""The documentation's mlx-lm examples, run as written: each page with a block marked skipped because it needs mlx-lm
(its reason names `make test-mlx`) runs whole in this environment's interpreter, those blocks included
(`tests/test_docs.py` with `DOC_TEST_UNSKIP`; mlx-lm's commands on PATH)."""

import pytest

pytest.importorskip("mlx_lm", reason="needs mlx-lm: make test-mlx (.venv-mlx)")

from tests.docs_runner import pages_naming, run_page_with  # noqa: E402

TARGET = "make test-mlx"


def test_the_pages_mlx_examples_run(tmp_path):
    pages = pages_naming(TARGET)
    assert {page.name for page in pages} == {"local.md", "README.md"}
    for page in pages:
        run_page_with(page, TARGET, tmp_path / page.stem)
