"""A command whose optional package is not installed is refused in one line that says so and names the extra, with
exit status 2 and nothing written: an export whether the package is absent or only a folder of its name lies on
`sys.path` (an implicit namespace package), and `analyze` without matplotlib."""

import importlib.machinery
import importlib.util
import sys

import pytest
import torch
from safetensors.torch import save_file

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from tests.helpers import SMALL, TINY, assert_refused, randomize_, sizes

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
    line = assert_refused(capsys, ["convert", str(src), str(tmp_path / "out"), "--to", to], "which is not installed",
                       tmp_path / "out")
    assert extra in line, line


def test_analyze_without_matplotlib_is_refused_naming_the_extra(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    src = tmp_path / "gated"
    randomize_(GatedQwenForCausalLM(GatedQwenConfig(**TINY))).save_pretrained(src)
    save_file({"input_ids": torch.randint(0, TINY["vocab_size"], (2, 11))}, tmp_path / "ids.safetensors")
    line = assert_refused(capsys, ["analyze", str(src), "--tokens", str(tmp_path / "ids.safetensors"), "--length", "11",
                                "--sequences", "2", "--out", str(tmp_path / "report")], "which is not installed",
                       tmp_path / "report", bars=True)
    assert "pip install 'gated-qwen[analysis]'" in line and "please report" not in line, line
