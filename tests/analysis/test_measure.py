"""The paper's quantities as `gated_qwen.analysis` measures them, against brute force: F-Attn and attention maps
against the eager attention weights (`output_attentions=True`), M-Act against `output_hidden_states=True`, |SDPA
output| and the gate's statistics against values recomputed by hand from the weights, also under a backend that fuses
the gate; `analyze`'s refusals."""

import pytest
import torch

from gated_qwen.analysis import analyze, first_token_attention
from gated_qwen.analysis.measure import GATE_BINS, first_token_attention_per_query
from gated_qwen.model.gating import gate_shape, gated_layers
from tests.analysis.analysis_helpers import VOCAB, eager_outputs, ids, model_for, rms_norm


@pytest.mark.parametrize("overrides", [
    {},  # G1 elementwise
    {"gate_position": None},
    {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},  # layers 1, 2 slide
], ids=["g1", "baseline", "sliding-window"])
def test_first_token_attention_and_maps_match_eager_attention(overrides):
    model = model_for(**overrides)
    x = ids()
    result = analyze(model, x, batch_size=2, map_tokens=7)
    attentions, _ = eager_outputs(model, x)
    assert model.config._attn_implementation == "sdpa"  # restored after the analysis
    for layer, weights in enumerate(attentions):
        p0 = weights[:, :, 1:, 0]  # [B, Hq, S-1]: query 0 can only attend to itself
        entry = result["layers"][layer]
        torch.testing.assert_close(torch.tensor(entry["first_token_attention_per_head"], dtype=torch.float64),
                                   p0.mean(dim=(0, 2)), rtol=1e-5, atol=1e-6)
        assert entry["first_token_attention"] == pytest.approx(p0.mean().item(), abs=1e-6)
        torch.testing.assert_close(result["attention_maps"][layer], weights[:, :, :7, :7].mean(0), rtol=1e-5,
                                   atol=1e-6)
        torch.testing.assert_close(result["first_token_attention_by_position"][layer],
                                   weights[:, :, :, 0].mean(dim=(0, 1)), rtol=1e-5, atol=1e-6)
    assert result["summary"]["first_token_attention"] == pytest.approx(
        torch.stack([w[:, :, 1:, 0].mean() for w in attentions]).mean().item(), abs=1e-6)
    if "sliding_window" in overrides:
        assert (result["first_token_attention_by_position"][1:, 5:] == 0).all()  # key 0 left the window


@pytest.mark.parametrize("overrides", [{}, {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}],
                         ids=["g1", "sliding-window"])
def test_first_token_attention_per_query_matches_eager_attention(overrides):
    model = model_for(**overrides)
    x = ids()
    per_query = first_token_attention_per_query(model, x, batch_size=2)
    attentions, _ = eager_outputs(model, x)
    assert per_query.shape == (3, 3, 4, 19) and model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(per_query, torch.stack([w[..., 0] for w in attentions], dim=1).float(), rtol=1e-5,
                               atol=1e-6)


def test_first_token_attention_of_float32_long_rows_matches_softmax():
    """The fused-kernel route against a plain softmax, float32, GQA, a few hundred rows."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 300, 16, generator=g), torch.randn(2, 3, 300, 16, generator=g)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.3
    scores = scores.masked_fill(torch.ones(300, 300, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(first_token_attention(q, k, 0.3), scores.softmax(-1)[..., 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides", [{}, {"gate_position": None}], ids=["g1", "baseline"])
def test_max_activation_matches_hidden_states(overrides):
    model = model_for(**overrides)
    x = ids()
    result = analyze(model, x, batch_size=2)
    _, hidden = eager_outputs(model, x)
    for layer, entry in enumerate(result["layers"]):
        output = hidden[layer + 1].abs()  # hidden[0] is the embedding output
        assert entry["max_activation"] == pytest.approx(output.max().item(), rel=1e-12)
        assert entry["max_activation_position"] == output.amax(dim=(0, 2)).argmax().item()
        # the paper's massive activation sits at the first token: its largest |value| there and elsewhere
        assert entry["first_token_max_activation"] == pytest.approx(output[:, 0].max().item(), rel=1e-12)
        assert entry["other_max_activation"] == pytest.approx(output[:, 1:].max().item(), rel=1e-12)
    maxima = [output.abs().max().item() for output in hidden[1:]]
    assert result["summary"]["max_activation"] == pytest.approx(max(maxima), rel=1e-12)
    assert result["summary"]["mean_max_activation"] == pytest.approx(sum(maxima) / len(maxima), rel=1e-12)
    # ... in the non-final layers, whose output later layers read (the last layer's only the final norm does)
    assert len(hidden) - 1 == model.config.num_hidden_layers > 1
    assert result["summary"]["first_token_max_activation_nonfinal"] == pytest.approx(
        max(output[:, 0].abs().max().item() for output in hidden[1:-1]), rel=1e-12)
    assert result["summary"]["other_max_activation_nonfinal"] == pytest.approx(
        max(output[:, 1:].abs().max().item() for output in hidden[1:-1]), rel=1e-12)
    one_layer = analyze(model_for(num_hidden_layers=1, **overrides), x)["summary"]
    assert one_layer["first_token_max_activation_nonfinal"] is one_layer["other_max_activation_nonfinal"] is None


def test_sdpa_output_before_and_after_the_gate_match_a_hand_computation():
    model = model_for(gate_scale=8.0)
    config = model.config
    x = ids()
    result = analyze(model, x, batch_size=3)
    attentions, hidden = eager_outputs(model, x)
    groups = config.num_attention_heads // config.num_key_value_heads
    for layer, block in enumerate(model.model.layers):
        normed = rms_norm(hidden[layer], block.input_layernorm.weight, config.rms_norm_eps)
        v = (normed @ block.self_attn.v_proj.weight.T).view(*x.shape, config.num_key_value_heads, config.head_dim)
        v = v.transpose(1, 2).repeat_interleave(groups, dim=1)  # [B, Hq, S, D]
        sdpa = (attentions[layer] @ v).transpose(1, 2)  # [B, S, Hq, D]
        gate = torch.sigmoid(normed @ block.self_attn.gate.g_proj.weight.T).view_as(sdpa)
        entry = result["layers"][layer]
        assert entry["sdpa_output_mean_abs"] == pytest.approx(sdpa.abs().mean().item(), rel=1e-6)
        assert entry["gated_output_mean_abs"] == pytest.approx((sdpa * gate).abs().mean().item(), rel=1e-6)


@pytest.mark.parametrize("overrides", [
    {},
    {"gate_granularity": "headwise"},
    {"gate_activation": "ns_sigmoid"},
    {"gate_position": "value"},
    {"gate_input_dependent": False},
    {"gate_layers": [1]},
], ids=["elementwise", "headwise", "ns-sigmoid", "g2-value", "input-independent", "one-layer"])
def test_gate_statistics_match_scores_recomputed_from_the_weights(overrides):
    model = model_for(gate_scale=12.0, **overrides)
    config = model.config
    with torch.no_grad():
        for block in model.model.layers:
            if hasattr(block.self_attn.gate, "logits"):  # spread the learned constants over the sigmoid's range
                logits = block.self_attn.gate.logits
                logits.copy_(torch.linspace(-4, 4, logits.numel())[torch.randperm(logits.numel())].view_as(logits))
    x = ids()
    result = analyze(model, x, batch_size=2)
    _, hidden = eager_outputs(model, x)
    heads, width = gate_shape(config)
    means = []
    for layer, block in enumerate(model.model.layers):
        entry = result["layers"][layer]["gate"]
        if layer not in gated_layers(config):
            assert entry is None
            continue
        normed = rms_norm(hidden[layer], block.input_layernorm.weight, config.rms_norm_eps)
        logits = (normed @ block.self_attn.gate.g_proj.weight.T if config.gate_input_dependent
                  else block.self_attn.gate.logits.reshape(-1).expand(*x.shape, heads * width))
        scores = torch.sigmoid(logits).view(*x.shape, heads, width)
        if config.gate_activation == "ns_sigmoid":
            scores = 0.5 + 0.5 * scores
        per_head = scores.movedim(-2, 0).reshape(heads, -1)  # [heads, every score of every token]
        assert per_head.min() < 0.1 < 0.5 < per_head.max() or config.gate_activation == "ns_sigmoid"
        torch.testing.assert_close(torch.tensor(entry["mean_per_head"], dtype=torch.float64), per_head.mean(1),
                                   rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(entry["below_0.1_per_head"], dtype=torch.float64),
                                   (per_head < 0.1).double().mean(1))
        torch.testing.assert_close(torch.tensor(entry["below_0.5_per_head"], dtype=torch.float64),
                                   (per_head < 0.5).double().mean(1))
        assert entry["mean"] == pytest.approx(per_head.mean().item(), rel=1e-6)
        assert entry["below_0.5"] == (per_head < 0.5).double().mean().item()
        bins = (per_head * GATE_BINS).floor().clamp(max=GATE_BINS - 1).long()
        histogram = torch.stack([torch.bincount(row, minlength=GATE_BINS) for row in bins]) / per_head.shape[1]
        torch.testing.assert_close(torch.tensor(entry["histogram_per_head"], dtype=torch.float64), histogram.double())
        means.append(per_head.mean().item())
    assert result["summary"]["gate_mean"] == pytest.approx(sum(means) / len(means), rel=1e-6)


def test_analysis_sees_the_ungated_output_under_a_backend_that_fuses_the_gate():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def fused(module, query, key, value, attention_mask, output_gate=None, **kwargs):  # returns the gated output
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out * torch.sigmoid(output_gate), weights

    fused.applies_output_gate = True  # how an attention function says it takes the gate's logits
    AttentionInterface.register("test_fused_gate", fused)
    AttentionMaskInterface.register("test_fused_gate", sdpa_mask)
    model, x = model_for(gate_scale=8.0), ids()
    expected = analyze(model, x)
    model.set_attn_implementation("test_fused_gate")
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, model_for(gate_scale=8.0)(x).logits)  # the backend is right
    result = analyze(model, x)
    assert model.config._attn_implementation == "test_fused_gate"  # restored
    for got, want in zip(result["layers"], expected["layers"]):
        assert got["sdpa_output_mean_abs"] == pytest.approx(want["sdpa_output_mean_abs"], rel=1e-12)
        assert got["gated_output_mean_abs"] == pytest.approx(want["gated_output_mean_abs"], rel=1e-12)
        assert got["gated_output_mean_abs"] < 0.9 * got["sdpa_output_mean_abs"]


def test_analyze_refuses_bad_input():
    model = model_for()
    with pytest.raises(ValueError, match="vocabulary"):
        analyze(model, torch.full((1, 8), VOCAB))
    with pytest.raises(ValueError, match="length >= 2"):
        analyze(model, torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="map_layers"):
        analyze(model, ids(), map_layers=[3])
