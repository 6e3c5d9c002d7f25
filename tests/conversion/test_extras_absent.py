"""An export whose optional package is not installed is refused in one line that says so and names the extra, with
exit status 2 and nothing written, whether the package is absent or only a folder of its name lies on `sys.path` (an
implicit namespace package: what a test folder named `gguf` was, where the gguf extra was not installed)."""

import importlib.machinery
import importlib.util
import sys

import pytest
from conversion_helpers import cli_refuses
from helpers import SMALL, randomize_, sizes

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM

EXPORTS = {"gguf": ("gguf", "pip install 'gated-qwen[gguf]'"),
           "onnx": ("onnxruntime", "pip install 'gated-qwen[onnx]'")}


def a_folder_named(name: str, tmp_path):
    """What `import NAME` gives where NAME is not installed and a folder of that name is on sys.path."""
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path / name)]
    return importlib.util.module_from_spec(spec)


@pytest.mark.parametrize("stand_in", ["absent", "a folder of its name"])
@pytest.mark.parametrize("to", EXPORTS)
def test_an_export_whose_package_is_not_installed_is_refused_naming_the_extra(tmp_path, capsys, monkeypatch, to,
                                                                               stand_in):
    module, extra = EXPORTS[to]
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None if stand_in == "absent" else a_folder_named(module, tmp_path))
    src = tmp_path / "gated"
    randomize_(GatedQwenForCausalLM(GatedQwenConfig(**sizes(SMALL, vocab_size=320)))).save_pretrained(src)
    line = cli_refuses(capsys, ["convert", str(src), str(tmp_path / "out"), "--to", to], "which is not installed",
                       tmp_path / "out")
    assert extra in line, line
