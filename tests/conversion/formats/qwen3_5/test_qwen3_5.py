"""`--to qwen3_5` / `--to qwen3_next` and their imports, against stock Transformers Qwen3.5 / Qwen3-Next with the
same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.conversion import convert
from tests.conversion.conversion_helpers import TINY, VOCAB, load, logits, randomize_, refuse, tensors

QWEN3_5_EXPORTS = [
    dict(),
    dict(gate_granularity="headwise", attention_bias=True),
    dict(gate_shared_across_heads=True, gate_bias=True),
    dict(gate_input_dependent=False, gate_layers=[0]),
    dict(gate_position=None, num_key_value_heads=1),
]


@pytest.mark.parametrize("fields", QWEN3_5_EXPORTS, ids=lambda v: json.dumps(v))
def test_gated_to_qwen3_5_loads_in_stock_class_and_back(tmp_path, fields):
    config = GatedQwenConfig(**{**TINY, **fields}, tie_word_embeddings=False)
    model = randomize_(GatedQwenForCausalLM(config))
    model.save_pretrained(tmp_path / "gated")
    reference = logits(model)
    convert(tmp_path / "gated", tmp_path / "q35", to_format="qwen3_5", verify=False,
            allow_o_proj_bias=config.attention_bias)
    stock = load(Qwen3_5ForCausalLM, tmp_path / "q35")
    assert set(stock.config.layer_types) == {"full_attention"}
    # vLLM reads the q/k/v bias flag from qkv_bias (tests/serving serves these exports with vLLM)
    assert json.loads((tmp_path / "q35" / "config.json").read_text()).get("qkv_bias", False) == stock.config.attention_bias
    assert stock.config.rope_parameters["partial_rotary_factor"] == 1.0
    torch.testing.assert_close(logits(stock), reference, rtol=1e-5, atol=1e-5)
    convert(tmp_path / "q35", tmp_path / "back", from_format="qwen3_5", verify=False)
    back = load(GatedQwenForCausalLM, tmp_path / "back")
    assert (back.config.gate_position, back.config.gate_granularity) == ("sdpa", "elementwise")
    torch.testing.assert_close(logits(back), reference, rtol=1e-5, atol=1e-5)


def test_stock_qwen3_5_and_dense_qwen3_next_import(tmp_path):
    layers = ["full_attention"] * 2
    q35 = randomize_(Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        **TINY, layer_types=layers, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0})), norm_center=0)
    nxt = randomize_(Qwen3NextForCausalLM(Qwen3NextConfig(
        **TINY, layer_types=layers, mlp_only_layers=[0, 1], num_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0})), norm_center=0)
    for name, model in (("q35", q35), ("next", nxt)):
        model.save_pretrained(tmp_path / name)
        convert(tmp_path / name, tmp_path / f"{name}-gated", from_format="qwen3_5", verify=name == "next")
        gated = load(GatedQwenForCausalLM, tmp_path / f"{name}-gated")
        torch.testing.assert_close(logits(gated), logits(model), rtol=1e-5, atol=1e-5)
        norm = tensors(tmp_path / f"{name}-gated")["model.layers.0.self_attn.q_norm.weight"]
        torch.testing.assert_close(norm, 1 + model.model.layers[0].self_attn.q_norm.weight.detach())


def _config_only(folder: Path, config) -> Path:
    folder.mkdir()
    config.save_pretrained(folder)
    save_file({"model.embed_tokens.weight": torch.zeros(VOCAB, 32)}, folder / "model.safetensors")
    return folder


def test_qwen3_5_refusals(tmp_path):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    refuse(r"layers \[0, 1, 2\] are 'linear_attention'",
           _config_only(tmp_path / "hybrid", Qwen3_5TextConfig(**{**TINY, "num_hidden_layers": 4},
                                                               rope_parameters=rope)),
           tmp_path / "o", from_format="qwen3_5")
    refuse(r"partial_rotary_factor=0.25", _config_only(tmp_path / "partial", Qwen3_5TextConfig(
        **TINY, layer_types=["full_attention"] * 2)), tmp_path / "o", from_format="qwen3_5")
    refuse(r"layers \[1\] of SRC are mixture-of-experts", _config_only(tmp_path / "moe", Qwen3NextConfig(
        **TINY, layer_types=["full_attention"] * 2, mlp_only_layers=[0], num_experts=4, rope_parameters=rope)),
        tmp_path / "o", from_format="qwen3_5")
    refuse(r"model_type='qwen3'; `--from qwen3_5` reads", _config_only(tmp_path / "q3", Qwen3Config(**TINY)),
           tmp_path / "o", from_format="qwen3_5")
    for i, (fields, match) in enumerate([
        (dict(gate_position="query"), r"gates only the attention output"),
        (dict(gate_combine="add", gate_activation="silu"), r"multiplies by the gate, it cannot add it"),
        (dict(gate_activation="ns_sigmoid"), r"ns_sigmoid of a linear map is not the sigmoid"),
        (dict(gate_position=None, sdpa_output_transform="rmsnorm"), r"no equivalent of sdpa_output_transform"),
        (dict(use_qk_norm=False), r"always normalises queries and keys"),
        (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), r"no sliding-window attention"),
    ]):
        GatedQwenForCausalLM(GatedQwenConfig(**TINY, **fields)).save_pretrained(tmp_path / f"g{i}")
        refuse(match, tmp_path / f"g{i}", tmp_path / "o", to_format="qwen3_5")




def test_the_language_model_prefix_names_the_text_model_as_qwen3_5_releases_do(tmp_path):
    """`--language-model-prefix` (torchtitan's qwen3_5 reads only these names: tests/engine_torchtitan): every tensor
    but lm_head under `model.language_model.`, which the structural check accepts and stock `Qwen3_5ForCausalLM`
    loads cleanly (Transformers' prefix change) with the gated model's logits."""
    model = randomize_(GatedQwenForCausalLM(GatedQwenConfig(**TINY, tie_word_embeddings=False)))
    model.save_pretrained(tmp_path / "gated")
    convert(tmp_path / "gated", tmp_path / "q35", to_format="qwen3_5", language_model_prefix=True)
    names = set(tensors(tmp_path / "q35"))
    assert names - {"lm_head.weight"} and all(n.startswith("model.language_model.") for n in names - {"lm_head.weight"})
    stock, info = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "q35", dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    torch.testing.assert_close(logits(stock.eval()), logits(model), rtol=1e-5, atol=1e-5)
