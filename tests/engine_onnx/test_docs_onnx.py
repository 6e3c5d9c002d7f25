"""The documentation's ONNX Runtime examples, run as written: each page with a block marked skipped because it needs
ONNX Runtime (its reason names `make test-onnx`) runs whole in this environment's interpreter, those blocks included
(`tests/test_docs.py` with `DOC_TEST_UNSKIP`)."""

import pytest

pytest.importorskip("onnxruntime", reason="needs onnx and onnxruntime: make test-onnx (.venv-onnx)")

from tests.docs_runner import pages_naming, run_page_with  # noqa: E402

TARGET = "make test-onnx"


def test_the_pages_onnx_examples_run(tmp_path):
    pages = pages_naming(TARGET)
    assert {page.name for page in pages} == {"local.md", "README.md"}
    for page in pages:
        run_page_with(page, TARGET, tmp_path / page.stem)
