"""GatedQwen and Megatron-core 0.16.1, each way, against Megatron-core's own forward (docs/conversion.md).

- The fixtures `make test` reads (tests/conversion/formats/megatron) are what Megatron-core makes today: made
  again here (tensor parallel 1 and 2, torch_dist and the legacy torch format), the same tensors and logits; `--from megatron` of the fresh saves gives
  Megatron's logits within 1e-5 (float32).
- `--to megatron` of GatedQwen models (elementwise, headwise written as repeated rows, a layer without a gate) is
  loaded by Megatron-core's `dist_checkpointing.load` with tensor parallelism 1 and 2, and its forward gives
  GatedQwen's logits within 1e-5.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: make test-megatron (.venv-megatron)")

from safetensors.torch import load_file  # noqa: E402

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM  # noqa: E402
from gated_qwen.conversion import convert  # noqa: E402
from gated_qwen.conversion.formats.megatron import open_megatron  # noqa: E402
from tests.conversion.conversion_helpers import TINY, gated_logits, randomize_  # noqa: E402

HERE = Path(__file__).parent
FIXTURES = HERE.parent / "conversion" / "formats" / "megatron"
PARITY = 1e-5


def megatron(*args: str) -> None:
    """megatron_cpu.py ARGS in a process of its own (its writers and tensor-parallel ranks are processes)."""
    subprocess.run([sys.executable, str(HERE / "megatron_cpu.py"), *args], check=True, timeout=900)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("megatron-fixtures")
    megatron("fixtures", str(out))
    return out


@pytest.mark.parametrize("save", ["tp1", "tp2", "legacy_tp2"])
def test_the_committed_fixtures_are_what_megatron_core_saves_and_computes(fresh, save):
    new, committed = (open_megatron(root / save, allow_pickle=True) for root in (fresh, FIXTURES))
    assert new.tensors.keys() == committed.tensors.keys() and new.config == committed.config
    assert all(torch.equal(new.get(name), committed.get(name)) for name in new.tensors)
    if save == "legacy_tp2":
        return
    new_logits, old_logits = (load_file(root / f"{save}.logits.safetensors") for root in (fresh, FIXTURES))
    assert torch.equal(new_logits["logits"], old_logits["logits"])


@pytest.mark.parametrize("save", ["tp1", "tp2"])
def test_from_megatron_gives_megatrons_logits(fresh, tmp_path, save):
    convert(fresh / save, tmp_path / "gated", from_format="megatron")
    expected = load_file(fresh / f"{save}.logits.safetensors")
    error = (gated_logits(tmp_path / "gated", expected["input_ids"]) - expected["logits"]).abs().max().item()
    print(f"Megatron-core {save} save -> gated_qwen: max |logit difference| {error:.3g}")
    assert error <= PARITY


CASES = {"elementwise": {}, "headwise": {"gate_granularity": "headwise"}, "gate on layer 1": {"gate_layers": [1]}}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_to_megatron_loads_in_megatron_core_with_the_same_logits(tmp_path, name, tp):
    config = GatedQwenConfig(**{**TINY, "vocab_size": 128, "num_key_value_heads": 2, "tie_word_embeddings": False,
                                "max_position_embeddings": 64, **CASES[name]})
    randomize_(GatedQwenForCausalLM(config), seed=3).save_pretrained(tmp_path / "gated")
    convert(tmp_path / "gated", tmp_path / "megatron", to_format="megatron")
    megatron("logits", str(tmp_path / "megatron"), str(tmp_path / "logits.safetensors"), "--tp", str(tp))
    ran = load_file(tmp_path / "logits.safetensors")
    error = (gated_logits(tmp_path / "gated", ran["input_ids"]) - ran["logits"]).abs().max().item()
    print(f"gated_qwen {name} -> Megatron-core (tensor parallel {tp}): max |logit difference| {error:.3g}")
    assert error <= PARITY
