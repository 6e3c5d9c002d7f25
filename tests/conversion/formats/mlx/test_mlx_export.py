"""`gated-qwen convert --to mlx` without mlx-lm (which `make test-mlx` runs, tests/engine_mlx): the folder's tensors
read back into stock Transformers `Qwen3_5ForCausalLM` / `Qwen3NextForCausalLM` give the source's logits (`--verify`), a
folder written wrong fails that check, and every refusal is one line with exit status 2 and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, GatedQwenMoeConfig, GatedQwenMoeForCausalLM
from gated_qwen.cli import main
from gated_qwen.conversion import VerificationError, convert
from gated_qwen.conversion.formats import mlx as mlx_format
from gated_qwen.conversion.io import Checkpoint
from tests.helpers import SMALL, TINY_MOE, assert_refused, randomize_, sizes

DENSE = sizes(SMALL, vocab_size=320)
MOE = sizes(DENSE, **TINY_MOE, shared_expert_intermediate_size=32)


def saved(folder: Path, fields: dict) -> Path:
    moe = "num_experts" in fields
    model = (GatedQwenMoeForCausalLM(GatedQwenMoeConfig(**fields)) if moe
             else GatedQwenForCausalLM(GatedQwenConfig(**fields)))
    randomize_(model).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["dense", "moe", "moe_without_shared_expert"])
def test_mlx_folder_verifies_in_stock_transformers(tmp_path, capsys, kind):
    """`--verify` (on by default) read the folder into stock Transformers and found the source's logits; the folder
    has mlx-lm's architecture for the kind of model, its model file, and no tensor but mlx-lm's parameters."""
    fields = {"dense": DENSE, "moe": MOE, "moe_without_shared_expert": sizes(MOE, shared_expert_intermediate_size=0)}
    src = saved(tmp_path / "gated", fields[kind])
    assert main(["convert", str(src), str(tmp_path / "mlx"), "--to", "mlx"]) == 0
    assert "verified: logits agree to" in capsys.readouterr().err
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert config["model_type"] == ("qwen3_5" if kind == "dense" else "qwen3_next")
    assert config["full_attention_interval"] == 1 and config["model_file"] == mlx_format.MODEL_FILE
    assert "ssm_idx = None" in (tmp_path / "mlx" / mlx_format.MODEL_FILE).read_text()
    found = {name: info.shape for name, info in Checkpoint(tmp_path / "mlx").tensors.items()}
    assert found == mlx_format.mlx_tensor_shapes(config)
    prefix = "language_model." if kind == "dense" else ""
    assert found[f"{prefix}model.layers.0.self_attn.q_proj.weight"] == (2 * DENSE["num_attention_heads"] *
                                                                       DENSE["head_dim"], DENSE["hidden_size"])
    if kind != "dense":
        assert found["model.layers.0.mlp.switch_mlp.gate_proj.weight"] == (
            MOE["num_experts"], MOE["moe_intermediate_size"], MOE["hidden_size"])


def test_mlx_norms_are_gatedqwens_own(tmp_path):
    """mlx-lm computes `x̂·w` and, for this layout, adds nothing to the weights: they are the source's, unshifted
    (the Qwen3.5 export's are zero-centred)."""
    src = saved(tmp_path / "gated", DENSE)
    convert(src, tmp_path / "mlx", to_format="mlx")
    source, written = Checkpoint(src), Checkpoint(tmp_path / "mlx")
    for name in ("model.norm.weight", "model.layers.1.self_attn.q_norm.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert torch.equal(written.get("language_model." + name), source.get(name))


def test_mlx_read_back_is_an_independent_check(tmp_path, monkeypatch):
    """A folder whose experts' gate and up projections were swapped fails `--verify`: exit status 1, nothing written
    (the read-back does not share the writer's names)."""
    src = saved(tmp_path / "gated", MOE)
    stack = mlx_format._stacked_experts

    def swapped(plan, layer, experts):
        out = stack(plan, layer, experts)
        gate, up = (f"model.layers.{layer}.mlp.switch_mlp.{p}_proj.weight" for p in ("gate", "up"))
        out[gate], out[up] = out[up], out[gate]
        return out

    monkeypatch.setattr(mlx_format, "_stacked_experts", swapped)
    with pytest.raises(VerificationError, match="verification failed"):
        convert(src, tmp_path / "mlx", to_format="mlx")
    assert not (tmp_path / "mlx").exists()


REFUSED = {  # name: (config fields, the message)
    "G2 value gate": (dict(gate_position="value"), "gates only the attention output"),
    "additive gate": (dict(gate_combine="add", gate_activation="silu"), "cannot add it"),
    "silu gate": (dict(gate_activation="silu", gate_bias=True), "gate_activation='silu'"),
    "non-gate control": (dict(gate_position=None, sdpa_output_transform="rmsnorm"), "sdpa_output_transform"),
    "dynamic RoPE": (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
                     "rope_type='dynamic'"),
    "YaRN's attention factor": (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                                      "original_max_position_embeddings": 128,
                                                      "attention_factor": 1.5}), "['attention_factor']"),
    "gelu MLP": (dict(hidden_act="gelu"), "SwiGLU"),
    "no qk norm": (dict(use_qk_norm=False), "use_qk_norm=False"),
    "sliding window": (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
                       "no sliding-window attention"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_mlx_lm_cannot_express_is_refused(tmp_path, capsys, case):
    changes, message = REFUSED[case]
    src = saved(tmp_path / "gated", sizes(DENSE, **changes))
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "mlx"), "--to", "mlx"], message, tmp_path / "mlx")
