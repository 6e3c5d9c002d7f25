"""Reading and writing at size: `Checkpoint.get` when `os.preadv` returns fewer bytes than asked (an injected
reader) and for a tensor over 2 GiB (which Linux reads in at most 0x7ffff000 bytes a call), `--verify`'s memory
check, which counts the source's and the result's float32 models, and `write_weights`, which writes one tensor at
a time the bytes `safetensors.torch.save_file` writes."""

from __future__ import annotations

import json
import os
import struct
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

import gated_qwen.conversion as conversion
from gated_qwen import GatedQwenForCausalLM
from gated_qwen.conversion import ConversionError, convert
from gated_qwen.conversion.io import SAFETENSORS_DTYPES, Checkpoint, TensorPlan, write_weights
from tests.conversion.conversion_helpers import load
from tests.helpers import tiny_gated_folder


def test_short_reads_continue_where_they_stopped(tmp_path, monkeypatch):
    """Every read returns at most 7 bytes: each tensor is still every byte the file holds, in order."""
    src = tiny_gated_folder(tmp_path / "src")
    expected = load_file(src / "model.safetensors")
    real, calls = os.preadv, []

    def short(fd, buffers, offset):
        calls.append(offset)
        return real(fd, [memoryview(buffers[0])[:7]], offset)

    ckpt = Checkpoint(src)
    monkeypatch.setattr(os, "preadv", short)
    for name, tensor in expected.items():
        assert torch.equal(ckpt.get(name), tensor), name
    assert len(calls) >= sum(t.nbytes for t in expected.values()) // 7  # the reader under test was the one called


@pytest.mark.slow
def test_a_tensor_over_2_gib_is_read_exactly(tmp_path):
    """A sparse file (holes, nothing written but marks) with one 2 GiB + 24 byte tensor: marks at its first byte,
    either side of Linux's largest single read and at its last byte come back where they were written."""
    count = 2**31 + 24
    header = json.dumps({"big": {"dtype": "U8", "shape": [count], "data_offsets": [0, count]}}).encode()
    header += b" " * (-len(header) % 8)
    data = 8 + len(header)
    marks = {0: 11, 0x7ffff000 - 1: 22, 0x7ffff000: 33, 2**31: 44, count - 1: 55}
    (tmp_path / "config.json").write_text("{}")
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(data + count)
        for at, value in marks.items():
            f.seek(data + at)
            f.write(bytes([value]))
    big = Checkpoint(tmp_path).get("big")
    assert big.shape == (count,) and {at: int(big[at]) for at in marks} == marks
    assert int(big.count_nonzero()) == len(marks)


def test_verify_memory_counts_the_source_and_the_result(tmp_path, monkeypatch):
    """With memory for one float32 model but not two, --verify is refused before anything is written and the
    conversion without it runs."""
    src = tiny_gated_folder(tmp_path / "src")
    parameters = sum(p.numel() for p in load(GatedQwenForCausalLM, src).parameters())
    monkeypatch.setattr(conversion, "available_memory", lambda device: (6 * parameters, "injected"))
    with pytest.raises(ConversionError, match="--verify: both models in float32"):
        convert(src, tmp_path / "verified", to_format="qwen3_5", verify=True)
    assert not (tmp_path / "verified").exists()
    convert(src, tmp_path / "unverified", to_format="qwen3_5", verify=False)


def test_shards_are_safetensors_bytes_written_one_tensor_at_a_time(tmp_path):
    """Every dtype, a scalar and an empty tensor, in shards: each file is byte for byte what save_file writes of the
    same tensors, and no tensor is alive when the next is computed."""
    torch.manual_seed(0)
    tensors = {f"t{i}.{name}": torch.randn(3, 5).to(dtype) for i, (name, dtype) in enumerate(SAFETENSORS_DTYPES.items())}
    tensors |= {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4, dtype=torch.bfloat16)}
    alive: list[weakref.ref] = []

    def make(name: str):
        def compute() -> torch.Tensor:
            assert all(ref() is None for ref in alive), "the previous tensor is still held"
            tensor = tensors[name].clone()
            alive.append(weakref.ref(tensor))
            return tensor
        return compute

    plan = {name: TensorPlan(tuple(t.shape), t.dtype, make(name)) for name, t in tensors.items()}
    write_weights(plan, tmp_path, max_shard_size=64)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and sorted(index["weight_map"]) == sorted(tensors)
    for file in files:
        names = [name for name, f in index["weight_map"].items() if f == file]
        save_file({name: tensors[name] for name in names}, tmp_path / "reference", metadata={"format": "pt"})
        assert (tmp_path / file).read_bytes() == (tmp_path / "reference").read_bytes(), file
