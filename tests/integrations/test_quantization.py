"""Transformers' quantizers load GatedQwen folders as they load stock Qwen3: optimum-quanto and torchao int8 weights,
on a gated_qwen folder (no conversion on any tensor) and on a folder of another format read through the package's
load-time conversion (the paper's release layout). Each is held against an independent reference: the model with
every linear weight quantized by hand with the quantizer's own formula (the gate's projection included), and, for
the model without a gate, stock `Qwen3ForCausalLM` quantized the same way."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, QuantoConfig, Qwen3Config, Qwen3ForCausalLM, TorchAoConfig

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.conversion import CheckpointFormatError, convert
from tests.conversion.conversion_helpers import write_release
from tests.helpers import TINY, randomize_

pytest.importorskip("optimum.quanto", reason="needs the quant extra: pip install 'gated-qwen[quant]'")
pytest.importorskip("torchao", reason="needs the quant extra: pip install 'gated-qwen[quant]'")

IDS = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(4))


def quanto_int8(weight: torch.Tensor) -> torch.Tensor:
    """optimum-quanto's int8 weights: symmetric per output row, scale = max |w| / 127, round(w / scale)."""
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    return (weight / scale).round().clamp(-127, 127) * scale


def torchao_int8(weight: torch.Tensor) -> torch.Tensor:
    """torchao's int8 weight-only: symmetric per output row over [-128, 127], scale = max |w| / 127.5,
    round(w * (1 / scale))."""
    scale = weight.abs().amax(dim=1, keepdim=True) / 127.5
    return (weight * (1.0 / scale)).round().clamp(-128, 127) * scale


def quantizers():
    from torchao.quantization import Int8WeightOnlyConfig

    return {"quanto int8": (QuantoConfig(weights="int8"), quanto_int8),
            "torchao int8": (TorchAoConfig(Int8WeightOnlyConfig()), torchao_int8)}


QUANTIZERS = ["quanto int8", "torchao int8"]


def quantized_by_hand(model, formula):
    """`model` with the weight of every linear layer of the decoder (attention, gate, MLP; not the output head,
    which the quantizers keep) replaced by its fake-quantized value."""
    model = copy.deepcopy(model)
    for module in model.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = formula(module.weight.data)
    return model


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def is_quantized(linear: torch.nn.Linear) -> bool:
    """Whether a quantizer replaced the layer (quanto) or its weight (torchao)."""
    return type(linear).__name__ == "QLinear" or type(linear.weight).__name__ not in ("Parameter", "Tensor")


@pytest.mark.parametrize("gate", [dict(), dict(gate_granularity="headwise", gate_bias=True), dict(gate_position=None)],
                         ids=["G1 elementwise", "G1 headwise with bias", "no gate"])
@pytest.mark.parametrize("name", QUANTIZERS)
def test_a_gated_qwen_folder_loads_quantized(tmp_path, name, gate):
    quantization, formula = quantizers()[name]
    model = randomize_(GatedQwenForCausalLM(GatedQwenConfig(**TINY, **gate)), seed=2).eval()
    model.save_pretrained(tmp_path / "gated")
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path / "gated", quantization_config=quantization)
    attention = quantized.model.layers[0].self_attn
    assert is_quantized(attention.q_proj) and is_quantized(quantized.model.layers[1].mlp.down_proj)
    if gate.get("gate_position", "sdpa") is not None:
        assert is_quantized(attention.gate.g_proj)  # the gate is quantized like every projection
    reference = logits(quantized_by_hand(model, formula))
    torch.testing.assert_close(logits(quantized), reference, rtol=1e-5, atol=1e-5)
    assert (logits(quantized) - logits(model)).abs().max() > 1e-4  # and that is not the float model

    if gate.get("gate_position", "sdpa") is None:  # without a gate: exactly stock Qwen3, quantized the same way
        stock = Qwen3ForCausalLM(Qwen3Config(**TINY))
        stock.load_state_dict(model.state_dict())
        stock.save_pretrained(tmp_path / "stock")
        stock = AutoModelForCausalLM.from_pretrained(tmp_path / "stock", quantization_config=quantization)
        torch.testing.assert_close(logits(quantized), logits(stock), rtol=0, atol=0)


@pytest.mark.parametrize("name", QUANTIZERS)
def test_a_converted_release_folder_loads_quantized_and_the_release_folder_is_refused_naming_convert(tmp_path, name):
    """A folder that `gated-qwen convert` wrote from the paper's release is a gated_qwen folder: it loads quantized
    like any, its gate too. The release folder itself is read through load-time conversions that split q_proj into
    two tensors, which Transformers' quantizers cannot take (their op loads the first tensor of a conversion only):
    refused before anything is read, naming the convert command."""
    quantization, formula = quantizers()[name]
    write_release(tmp_path / "release", "elementwise", 2)
    convert(tmp_path / "release", tmp_path / "converted", from_format="release", verify=False)
    converted = GatedQwenForCausalLM.from_pretrained(tmp_path / "converted", quantization_config=quantization)
    assert is_quantized(converted.model.layers[0].self_attn.gate.g_proj)
    float_model = GatedQwenForCausalLM.from_pretrained(tmp_path / "release")
    torch.testing.assert_close(logits(converted), logits(quantized_by_hand(float_model, formula)), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(CheckpointFormatError, match="in the release format.*gated-qwen convert SRC DST --from release"):
        GatedQwenForCausalLM.from_pretrained(tmp_path / "release", quantization_config=quantization)
