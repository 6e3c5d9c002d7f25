"""`--from olmo_core` / `--to olmo_core` against OLMo-core 3.0.0 itself, with no OLMo-core installed: `elementwise/`
and `headwise/` beside this file are what OLMo-core's `save_model_and_optim_state` (its trainer's) wrote for its
default block with the attention gate, with the model's config as its trainer's ConfigSaverCallback writes it, and
`*.logits.safetensors` the logits OLMo-core's forward computed. `make test-olmo` regenerates them
(tests/engine_olmo/olmo_cpu.py) and checks the other direction in OLMo-core."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.conversion import convert
from gated_qwen.conversion.dcp import DcpCheckpoint
from gated_qwen.conversion.formats.olmo_core import olmo_logits, open_olmo
from tests.conversion.conversion_helpers import TINY, gated_logits, randomize_
from tests.helpers import assert_refused

HERE = Path(__file__).parent
PARITY = 1e-5


@pytest.mark.parametrize("granularity", ["elementwise", "headwise"])
def test_an_olmo_core_save_converts_to_its_own_logits(tmp_path, granularity):
    convert(HERE / granularity, tmp_path / "gated", from_format="olmo_core")
    expected = load_file(HERE / f"{granularity}.logits.safetensors")
    error = (gated_logits(tmp_path / "gated", expected["input_ids"]) - expected["logits"]).abs().max().item()
    print(f"olmo_core {granularity} -> gated_qwen: max |logit difference| {error:.3g}")
    assert error <= PARITY
    config = json.loads((tmp_path / "gated" / "config.json").read_text())
    assert (config["gate_position"], config["gate_granularity"]) == ("sdpa", granularity)  # headwise stays headwise


@pytest.mark.parametrize("granularity", ["elementwise", "headwise"])
def test_the_verify_reference_is_olmo_cores_forward(granularity):
    expected = load_file(HERE / f"{granularity}.logits.safetensors")
    got = olmo_logits(open_olmo(HERE / granularity), expected["input_ids"])
    assert (got - expected["logits"]).abs().max().item() <= PARITY


@pytest.mark.parametrize("fields", [{}, {"gate_granularity": "headwise"}, {"gate_shared_across_heads": True},
                                    {"gate_input_dependent": False}, {"tie_word_embeddings": True}],
                         ids=["elementwise", "headwise", "head-shared", "input-independent", "tied"])
def test_to_olmo_core_and_back_computes_the_same_logits(tmp_path, fields):
    source = tmp_path / "gated"
    config = GatedQwenConfig(**{**TINY, "num_key_value_heads": 2, "tie_word_embeddings": False, **fields})
    randomize_(GatedQwenForCausalLM(config), seed=2).save_pretrained(source)
    convert(source, tmp_path / "olmo", to_format="olmo_core")  # verified against `olmo_logits`
    convert(tmp_path / "olmo", tmp_path / "back", from_format="olmo_core")
    ids = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    assert (gated_logits(tmp_path / "back", ids) - gated_logits(source, ids)).abs().max().item() <= PARITY
    written = json.loads((tmp_path / "olmo" / "config.json").read_text())["model"]
    assert written["block"]["name"] == "default"
    gate = written["block"]["sequence_mixer"]["gate"]["granularity"]
    assert gate == ("headwise" if fields.get("gate_granularity") == "headwise" else "elementwise")
    keys = DcpCheckpoint(tmp_path / "olmo" / "model_and_optim", {}).tensors
    assert all(name.startswith("model.") for name in keys) and "model.blocks.1.attention.w_g.weight" in keys


# ------------------------------------------------------------------------------------------------------ refusals
def spoiled(tmp_path: Path, edit) -> Path:
    src = Path(shutil.copytree(HERE / "elementwise", tmp_path / "src"))
    saved = json.loads((src / "config.json").read_text())
    edit(saved["model"])
    (src / "config.json").write_text(json.dumps(saved))
    return src


REFUSALS = {
    "reordered_norm": (lambda m: m["block"].update(name="reordered_norm"), "block.name='reordered_norm'"),
    "a layer count that disagrees": (lambda m: m.update(n_layers=3), "missing (model.blocks.2.attention.w_q.weight"),
    "QK norm over all heads": (lambda m: m["block"]["sequence_mixer"].update(use_head_qk_norm=False),
                               "use_head_qk_norm=False"),
    "a mixture of experts": (lambda m: m["block"].update(feed_forward_moe={"num_experts": 4}),
                             "block.feed_forward_moe"),
    "sliding windows": (lambda m: m["block"]["sequence_mixer"].update(sliding_window={"pattern": [64, -1]}),
                        "sliding_window="),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_bad_checkpoint_is_refused_in_one_line(tmp_path, capsys, name):
    edit, message = REFUSALS[name]
    src = spoiled(tmp_path, edit)
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "out"), "--from", "olmo_core"], message,
                   nothing_at=tmp_path / "out")


def test_a_missing_shard_is_refused_in_one_line(tmp_path, capsys):
    src = Path(shutil.copytree(HERE / "headwise", tmp_path / "src"))
    (src / "model_and_optim" / "__0_3.distcp").unlink()
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "out"), "--from", "olmo_core"],
                   "names data files that SRC lacks: ['__0_3.distcp']", nothing_at=tmp_path / "out")
