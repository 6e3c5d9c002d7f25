"""The suite is the package `tests`, laid out like `src/gated_qwen`: every folder of Python files is a package, so
each test module is imported by its full name (`tests.conversion.formats.gguf.test_gguf`) and no test folder can
stand in for a module of the same name (`gguf`); each format of `conversion/formats/` has its folder of tests."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_folder_is_a_package():
    folders = {p.parent for p in (ROOT / "tests").rglob("*.py") if "node_modules" not in p.parts}
    assert len(folders) > 10, folders
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()) == []


def test_each_format_has_its_folder_of_tests():
    formats = {p.stem for p in (ROOT / "src/gated_qwen/conversion/formats").glob("*.py")} - {"__init__"}
    tested = {p.parent.name for p in (ROOT / "tests/conversion/formats").glob("*/test_*.py")}
    assert formats == tested
