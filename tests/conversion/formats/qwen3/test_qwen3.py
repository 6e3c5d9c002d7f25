"""`--from qwen3` (and `--add-gate`) against stock Transformers Qwen3 with the same weights."""

from __future__ import annotations

import json

import pytest
import torch

from gated_qwen import GatedQwenForCausalLM
from gated_qwen.conversion import VerificationError, convert
from gated_qwen.conversion.formats import qwen3 as qwen3_module
from tests.conversion.conversion_helpers import load, logits, refuse
from tests.helpers import assert_nothing_written


def test_qwen3_without_gate_is_exact_and_sharded(qwen3_sources, tmp_path):
    src, reference = qwen3_sources[False]
    assert (src / "model.safetensors.index.json").exists()
    convert(src, tmp_path / "gated", from_format="qwen3", verify=False)
    index = json.loads((tmp_path / "gated" / "model.safetensors.index.json").read_text())
    shard_bytes = [(tmp_path / "gated" / f).stat().st_size for f in set(index["weight_map"].values())]
    largest_in = max(f.stat().st_size for f in src.glob("*.safetensors"))
    assert len(shard_bytes) > 1 and max(shard_bytes) <= largest_in // 2 + 1024  # default: half; 1 KB header slack
    model = load(GatedQwenForCausalLM, tmp_path / "gated")
    assert model.config.gate_position is None
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=1e-6)


ADD_GATE_VARIANTS = [  # (gate fields, source with attention_bias)
    *[(dict(gate_granularity=g, gate_shared_across_heads=s, gate_activation=a), False)
      for g in ("elementwise", "headwise") for s in (False, True) for a in ("sigmoid", "ns_sigmoid")],
    (dict(gate_activation="silu", gate_bias=True), False),
    (dict(gate_activation="identity", gate_bias=True), False),
    (dict(gate_activation="silu", gate_input_dependent=False), False),
    (dict(gate_activation="sigmoid", gate_input_dependent=False, gate_granularity="headwise"), False),
    (dict(gate_combine="add", gate_activation="silu"), False),
    (dict(gate_combine="add", gate_activation="identity", gate_granularity="headwise"), False),
    (dict(gate_combine="add", gate_activation="sigmoid"), True),
    (dict(gate_combine="add", gate_activation="ns_sigmoid", gate_shared_across_heads=True), True),
    (dict(gate_bias=True, gate_layers=[1]), True),
    *[(dict(gate_position=p), True) for p in ("value", "key", "query", "dense")],
    (dict(gate_position="key", gate_combine="add", gate_activation="sigmoid"), True),
]


@pytest.mark.parametrize("fields,bias", ADD_GATE_VARIANTS, ids=lambda v: json.dumps(v) if isinstance(v, dict) else "")
def test_qwen3_add_gate_preserves_logits(qwen3_sources, tmp_path, fields, bias):
    src, reference = qwen3_sources[bias]
    convert(src, tmp_path / "gated", from_format="qwen3", add_gate=json.dumps(fields), verify=False)
    model = load(GatedQwenForCausalLM, tmp_path / "gated")
    assert model.config.gate_position == fields.get("gate_position", "sdpa")
    assert all(getattr(model.config, k) == v for k, v in fields.items())
    torch.testing.assert_close(logits(model), reference, rtol=1e-5, atol=1e-5)


def test_qwen3_add_gate_refusals(qwen3_sources, tmp_path, capsys):
    src = qwen3_sources[False][0]
    refuse(r"multiplicative silu gate with zero weights and no bias outputs silu\(0\) = 0", src, tmp_path / "o",
           from_format="qwen3", add_gate='{"gate_activation": "silu"}')
    refuse(r"multiplicative identity gate", src, tmp_path / "o", from_format="qwen3",
           add_gate='{"gate_activation": "identity", "gate_granularity": "headwise"}')
    refuse(r"additive sigmoid gate adds sigmoid\(x\) > 0 .* bias of v_proj; the source has attention_bias=false",
           src, tmp_path / "o", from_format="qwen3", add_gate='{"gate_combine": "add"}')
    refuse(r"not a variant", src, tmp_path / "o", from_format="qwen3", add_gate="elementwize")
    refuse(r"gate_granularity' expected one of \('elementwise', 'headwise'\), got rowwise", src, tmp_path / "o", from_format="qwen3",
           add_gate='{"gate_granularity": "rowwise"}')
    convert(src, tmp_path / "ok", from_format="qwen3", add_gate="headwise", verify=False)
    assert "appendix A.7" in capsys.readouterr().err


def test_verify_catches_a_wrong_conversion(qwen3_sources, tmp_path, monkeypatch):
    """With the constant gate value not folded into o_proj the logits change; --verify must refuse to publish."""
    src = qwen3_sources[False][0]
    monkeypatch.setattr(qwen3_module, "added_gate_init", lambda config: (0.0, "none", 1.0))
    with pytest.raises(VerificationError, match="logits differ"):
        convert(src, tmp_path / "gated", from_format="qwen3", add_gate="elementwise", verify=True)
    assert_nothing_written(tmp_path / "gated")


