"""The documentation's ONNX Runtime examples, run as written: each page with a block marked skipped because it needs
ONNX Runtime (its reason names `make test-onnx`) runs whole in this environment's interpreter, those blocks included
(`tests/test_docs.py` with `DOC_TEST_UNSKIP`)."""

from docs_runner import pages_naming, run_page_with

TARGET = "make test-onnx"


def test_the_pages_onnx_examples_run(tmp_path):
    pages = pages_naming(TARGET)
    assert {page.name for page in pages} == {"local.md", "README.md"}
    for page in pages:
        run_page_with(page, TARGET, tmp_path / page.stem)
