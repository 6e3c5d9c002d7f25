"""Fake quantization against its formula written out by hand and a model quantized by hand."""

import pytest
import torch

from gated_qwen.analysis.quantize import SCHEMES, fake_quantize_rows, fake_quantized, perplexity_under_quantization
from tests.analysis.analysis_helpers import hand_quantized, ids, model_for, nll_by_hand, quantize_by_hand


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_fake_quantization_matches_its_formula(bits, dtype):
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(40, 33, generator=g) * torch.rand(40, 1, generator=g) * 10).to(dtype)
    x[3] = 0.0  # an all-zero row stays zero
    got = fake_quantize_rows(x, bits)
    torch.testing.assert_close(got, quantize_by_hand(x, bits, 40), rtol=0, atol=0)
    assert got.dtype == dtype and (got[3] == 0).all()
    steps = got.float() / (x.float().abs().amax(1, keepdim=True) / (2 ** (bits - 1) - 1)).clamp(min=1e-30)
    assert all(len(row.round().unique()) <= 2 ** bits for row in steps)  # at most 2^bits levels per row
    if dtype != torch.bfloat16:  # rounding to nearest: never off by more than half a step
        assert ((got - x).abs() <= x.abs().amax(1, keepdim=True) / (2 ** (bits - 1) - 1) / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("overrides", [{}, {"gate_position": None}], ids=["g1", "baseline"])
def test_fake_quantized_model_matches_a_model_quantized_by_hand(scheme, overrides):
    model = model_for(gate_scale=8.0, **overrides)
    x = ids(batch=3, length=21)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        float_logits = model(x).logits
        with fake_quantized(model, SCHEMES[scheme]):
            quantized = model(x).logits
        expected = hand_quantized(model, SCHEMES[scheme])(x).logits
    torch.testing.assert_close(quantized, expected, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(quantized, float_logits, rtol=1e-4, atol=1e-4)  # quantization changed something
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the float weights are back
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, float_logits, rtol=0, atol=0)
    rows = perplexity_under_quantization(model, x, [scheme], batch_size=2)  # a batch of 2 and one of 1
    assert rows["float"]["nll"] == pytest.approx(nll_by_hand(model, x), rel=1e-10)
    assert rows[scheme]["nll"] == pytest.approx(nll_by_hand(hand_quantized(model, SCHEMES[scheme]), x), rel=1e-10)
    assert rows[scheme]["increase"] == pytest.approx(rows[scheme]["ppl"] / rows["float"]["ppl"] - 1, rel=1e-9)
    with pytest.raises(ValueError, match="w3a3"):
        perplexity_under_quantization(model, x, ["w3a3"])


def test_per_tensor_activations_lose_more_than_per_token_at_an_outlier_token():
    """One token 100 times larger than the others: per tensor, the others are rounded to a few levels."""
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[0, 0] *= 100
    from gated_qwen.analysis.quantize import fake_quantize_activation

    per_token = (fake_quantize_activation(x, 8, "token") - x)[0, 1:].abs().mean()
    per_tensor = (fake_quantize_activation(x, 8, "tensor") - x)[0, 1:].abs().mean()
    assert per_tensor > 10 * per_token
    torch.testing.assert_close(fake_quantize_activation(x, 8, "tensor"), quantize_by_hand(x, 8, 1), rtol=0, atol=0)
