"""The test suite's own layout. `tests` (and tests/conversion) are on `sys.path` (pyproject.toml's `pythonpath`, and
pytest's rootdir-relative imports), so a folder of the tests named like a module stands in for it, as an empty
namespace package, wherever that module is not installed: `import gguf` found tests/conversion/gguf where the gguf
extra was not, and the command then failed with an AttributeError instead of saying the extra is not installed. No
folder of the tests may carry the name of a module that the package, its tests or its benchmarks import, or of one
installed here."""

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# llama.cpp's converter package, `conversion`: tests/engine_llama/llama_cpp_converter.py imports it with llama.cpp's
# folder first on sys.path, and it is a regular package, which wins over a namespace folder (tests/conversion).
FOUND_BY_THEIR_OWN_PATH = {"conversion"}


def imported_top_level_names() -> set[str]:
    """The first component of every absolute import in src/, tests/ and benchmarks/."""
    names = set()
    for folder in ("src", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if "node_modules" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names


def installed_elsewhere(name: str) -> bool:
    """Whether `name` is a module found on sys.path outside the tests' own folders."""
    inside = {str(TESTS), *(str(p) for p in TESTS.rglob("*") if p.is_dir())}
    saved = sys.path[:]
    try:
        sys.path[:] = [p for p in saved if str(Path(p or ".").resolve()) not in inside]
        spec = importlib.util.find_spec(name) if name not in sys.modules else sys.modules[name].__spec__
    except (ImportError, ValueError):
        return False
    finally:
        sys.path[:] = saved
    return spec is not None and str(TESTS) not in str(spec.origin or spec.submodule_search_locations)


def test_no_test_folder_is_named_like_a_module_the_code_imports():
    folders = [p for p in TESTS.rglob("*") if p.is_dir() and not {"node_modules", "__pycache__"} & set(p.parts)
               and not p.name.startswith(".")]
    assert len(folders) > 10, folders  # the walk found the suite's folders
    imported = imported_top_level_names() - FOUND_BY_THEIR_OWN_PATH
    assert {"gguf", "onnxruntime", "torch", "transformers"} <= imported, sorted(imported)  # the scan sees imports
    clashes = sorted(str(p.relative_to(ROOT)) for p in folders if p.name in imported or installed_elsewhere(p.name))
    assert not clashes, f"test folders named like a module the code imports or that is installed: {clashes}"
