"""`--from release` / `--to release` and the release layout, against a forward written from its documented index
formulas (`conversion_helpers.release_forward`) and byte equality of tensors."""

from __future__ import annotations

import json

import pytest
import torch

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.conversion import convert
from tests.conversion.conversion_helpers import (
    IDS,
    TINY,
    load,
    logits,
    randomize_,
    refuse,
    release_forward,
    tensors,
    write_release,
)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.parametrize("variant", ["baseline", "headwise", "elementwise"])
def test_release_import_matches_independent_forward(tmp_path, variant, kv_heads):
    logical = write_release(tmp_path / "release", variant, kv_heads)
    convert(tmp_path / "release", tmp_path / "gated", from_format="release", verify=False)
    model = load(GatedQwenForCausalLM, tmp_path / "gated")
    config = model.config
    assert config.gate_position == (None if variant == "baseline" else "sdpa")
    assert variant == "baseline" or config.gate_granularity == variant
    assert config.tie_word_embeddings and "lm_head.weight" not in tensors(tmp_path / "gated")
    torch.testing.assert_close(logits(model), release_forward(logical, kv_heads, variant, False, IDS),
                               rtol=1e-5, atol=1e-5)


def test_release_with_qkv_bias_verifies_and_carries_files(tmp_path):
    logical = write_release(tmp_path / "release", "elementwise", 2, qkv_bias=True)
    convert(tmp_path / "release", tmp_path / "gated", from_format="release", verify=True)  # release_logits reference
    model = load(GatedQwenForCausalLM, tmp_path / "gated")
    assert model.config.attention_bias and model.config.gate_bias
    torch.testing.assert_close(logits(model), release_forward(logical, 2, "elementwise", True, IDS),
                               rtol=1e-5, atol=1e-5)
    assert (tmp_path / "gated" / "tokenizer.json").read_text() == '{"model": "tiny"}'
    assert json.loads((tmp_path / "gated" / "generation_config.json").read_text()) == {"do_sample": False}


# The official configuration's default (qiuzh20/gated_attention, configuration_qwen3.py at 49645df, line 167:
# `rope_theta=10000.0`), which a release config.json without the field means: not Qwen3's 1,000,000.
OFFICIAL_ROPE_THETA = 10000.0


def test_a_release_config_without_rope_theta_means_the_official_default(tmp_path):
    """A config.json that leaves rope_theta out is read, by convert and by from_pretrained, with the official code's
    default, checked against the independent forward (which rotates with that theta) and on the config."""
    logical = write_release(tmp_path / "release", "headwise", 2)
    edited = json.loads((tmp_path / "release" / "config.json").read_text())
    del edited["rope_theta"]
    (tmp_path / "release" / "config.json").write_text(json.dumps(edited))
    convert(tmp_path / "release", tmp_path / "gated", from_format="release", verify=False)
    expected = release_forward(logical, 2, "headwise", False, IDS)
    for model in (load(GatedQwenForCausalLM, tmp_path / "gated"), load(GatedQwenForCausalLM, tmp_path / "release")):
        assert model.config.rope_parameters["rope_theta"] == OFFICIAL_ROPE_THETA
        torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant,kv_heads,qkv_bias", [("headwise", 2, False), ("elementwise", 1, True),
                                                       ("baseline", 4, True)])
def test_release_round_trip_is_byte_identical(tmp_path, variant, kv_heads, qkv_bias):
    write_release(tmp_path / "release", variant, kv_heads, qkv_bias=qkv_bias, dtype=torch.bfloat16)
    convert(tmp_path / "release", tmp_path / "gated", from_format="release", verify=False)
    convert(tmp_path / "gated", tmp_path / "back", to_format="release", verify=False)
    before, after = tensors(tmp_path / "release"), tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and before[name].shape == after[name].shape, name
        assert torch.equal(before[name].view(torch.uint8), after[name].view(torch.uint8)), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["headwise_attn_output_gate"], config["elementwise_attn_output_gate"], config["qkv_bias"]) == (
        variant == "headwise", variant == "elementwise", qkv_bias)


def test_release_export_of_other_g1_sigmoid_gates_is_exact(tmp_path):
    """Head-shared, input-independent and partly-gated models have exact release equivalents (rows repeated, or
    zero rows with o_proj columns scaled); checked against the independent forward of the release layout."""
    for i, fields in enumerate([dict(gate_granularity="headwise", gate_shared_across_heads=True),
                                dict(gate_input_dependent=False, gate_layers=[1])]):
        model = randomize_(GatedQwenForCausalLM(GatedQwenConfig(**TINY, tie_word_embeddings=True, **fields)))
        model.save_pretrained(tmp_path / f"gated{i}")
        convert(tmp_path / f"gated{i}", tmp_path / f"release{i}", to_format="release", verify=True)
        w = tensors(tmp_path / f"release{i}")
        heads, kv, d, hidden = 4, 2, 8, 32
        width = 1 if fields.get("gate_granularity") == "headwise" else d
        logical = {"embed": w["model.embed_tokens.weight"], "norm": w["model.norm.weight"], "layers": []}
        for layer in range(2):
            p = f"model.layers.{layer}."
            rows = w[p + "self_attn.q_proj.weight"].view(kv, -1, hidden)  # per kv group: [G*D queries | G*W gates]
            logical["layers"].append(dict(
                wq=rows[:, : 2 * d].reshape(heads, d, hidden), wg=rows[:, 2 * d:].reshape(heads, width, hidden),
                wk=w[p + "self_attn.k_proj.weight"].view(kv, d, hidden), wv=w[p + "self_attn.v_proj.weight"].view(
                    kv, d, hidden), wo=w[p + "self_attn.o_proj.weight"], qn=w[p + "self_attn.q_norm.weight"],
                kn=w[p + "self_attn.k_norm.weight"], ln1=w[p + "input_layernorm.weight"],
                ln2=w[p + "post_attention_layernorm.weight"], gate=w[p + "mlp.gate_proj.weight"],
                up=w[p + "mlp.up_proj.weight"], down=w[p + "mlp.down_proj.weight"]))
        variant = "headwise" if width == 1 else "elementwise"
        torch.testing.assert_close(release_forward(logical, kv, variant, False, IDS), logits(model),
                                   rtol=1e-5, atol=1e-5)


def test_release_refusals(tmp_path):
    write_release(tmp_path / "hw", "headwise", 2)
    config = json.loads((tmp_path / "hw" / "config.json").read_text())
    config.update(headwise_attn_output_gate=False, elementwise_attn_output_gate=True)
    (tmp_path / "hw" / "config.json").write_text(json.dumps(config))
    refuse(r"elementwise variant .*elementwise_attn_output_gate=True.* 64 rows .* has 36 rows, the headwise layout",
           tmp_path / "hw", tmp_path / "out", from_format="release")
    config.update(elementwise_attn_output_gate=False, headwise_attn_output_gate=True, qkv_bias=True)
    (tmp_path / "hw" / "config.json").write_text(json.dumps(config))
    refuse(r"qkv_bias=True, but model.layers.0.self_attn.q_proj.bias is absent", tmp_path / "hw",
           tmp_path / "out", from_format="release")
    refuse(r"--add-gate applies to `--from qwen3`", tmp_path / "hw", tmp_path / "out", from_format="release",
           add_gate="headwise")
    model = GatedQwenForCausalLM(GatedQwenConfig(**TINY, gate_position="value"))
    model.save_pretrained(tmp_path / "g2")
    refuse(r"release format cannot express this gate \(gate_position='value'", tmp_path / "g2", tmp_path / "out",
           to_format="release")


