"""`gated-qwen convert --to onnx` where ONNX Runtime is not installed (`make test-onnx` runs the conversion with it,
tests/engine_onnx): refused in one line, exit status 2, nothing written, as are the options of a safetensors
folder."""

from __future__ import annotations

import importlib.util

import pytest

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from tests.helpers import SMALL, assert_refused, randomize_, sizes

DENSE = sizes(SMALL, vocab_size=320)


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is not None,
                    reason="ONNX Runtime is installed here (`make test-onnx` runs --to onnx with it)")
def test_onnx_without_onnx_runtime_and_its_folder_options_are_refused(tmp_path, capsys):
    src = tmp_path / "gated"
    randomize_(GatedQwenForCausalLM(GatedQwenConfig(**DENSE))).save_pretrained(src)
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "onnx"), "--to", "onnx"],
            "pip install 'gated-qwen[onnx]'", tmp_path / "onnx")
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "onnx"), "--to", "onnx", "--max-shard-size", "1GB"],
            "--max-shard-size apply to safetensors folder outputs; --to onnx writes its own files", tmp_path / "onnx")
