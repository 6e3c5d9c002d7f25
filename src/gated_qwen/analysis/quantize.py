"""Low-bit inference, simulated: how much held-out perplexity a model loses when its linear layers compute in a few
bits (the paper's massive activations are what make activation quantization lose accuracy; the gate removes them).

Fake quantization: each number is rounded to the nearest of 2^bits evenly spaced levels and mapped back at once, so
the model runs in its own dtype with exactly the values an integer kernel would see. It is symmetric
round-to-nearest with a scale per group, `s = max|group| / (2^(bits-1) - 1)`, `q(x) = s * clamp(round(x / s),
-2^(bits-1), 2^(bits-1) - 1)`, computed by PyTorch's own `torch.fake_quantize_per_channel_affine` (plain PyTorch:
torchao is not in the lock). Every `nn.Linear` inside the decoder layers is quantized: attention q/k/v/o, the gate's
projection, the MLP (and a mixture of experts' router and shared expert; its fused expert weights are not
`nn.Linear` and stay in float). The embedding and the LM head stay in float, as in the usual W8A8 / W4A4 set-ups.

- weights: one scale per output channel (row of the weight);
- activations (each linear layer's input), dynamic: `"token"`, one scale per token; `"tensor"`, one scale for the
  whole input matrix of a sequence (what a batch of one sees, so results do not depend on batching).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from .measure import _decoder
from .perplexity import mean_nll


@dataclass(frozen=True)
class Scheme:
    """A fake-quantization scheme: `weight_bits` (per output channel), `activation_bits` and `activation_scale`
    ("tensor": one scale per sequence, "token": one per token)."""

    weight_bits: int
    activation_bits: int
    activation_scale: str

    def __str__(self) -> str:
        return (f"{self.weight_bits}-bit weights per channel, {self.activation_bits}-bit activations per "
                f"{self.activation_scale}")


SCHEMES: dict[str, Scheme] = {  # `gated-qwen analyze --quant NAME ...`
    "w8a8-tensor": Scheme(8, 8, "tensor"),
    "w8a8-token": Scheme(8, 8, "token"),
    "w4a8": Scheme(4, 8, "token"),
    "w4a4": Scheme(4, 4, "token"),
}


def fake_quantize_rows(x: torch.Tensor, bits: int) -> torch.Tensor:
    """`x: [rows, columns]` -> the same shape and dtype, each row fake-quantized to `bits` with its own symmetric
    scale `max|row| / (2^(bits-1) - 1)` (an all-zero row stays zero), computed in float32 or wider."""
    top = 2 ** (bits - 1) - 1
    scale = (x.detach().abs().amax(dim=1).float() / top).clamp(min=torch.finfo(torch.float32).tiny)
    zero = torch.zeros(x.shape[0], dtype=torch.int32, device=x.device)
    return torch.fake_quantize_per_channel_affine(x, scale, zero, 0, -top - 1, top)


def fake_quantize_activation(x: torch.Tensor, bits: int, scale: str) -> torch.Tensor:
    """`x: [B, S, features]` (or `[S, features]`, one sequence): one scale per token (`scale="token"`) or per sequence
    (`"tensor"`) -> the same shape."""
    rows = x.reshape(-1, x.shape[-1]) if scale == "token" else x.reshape(x.shape[0] if x.dim() > 2 else 1, -1)
    return fake_quantize_rows(rows, bits).view_as(x)


def quantized_linears(model) -> list[torch.nn.Linear]:
    """The layers a scheme quantizes: every `nn.Linear` inside the decoder layers."""
    return [m for layer in _decoder(model).layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]


@contextlib.contextmanager
def fake_quantized(model, scheme: Scheme):
    """Inside the block, every layer of `quantized_linears(model)` computes with its weight fake-quantized per output
    channel and its input fake-quantized as `scheme` says; the float weights are restored on exit."""
    originals, hooks = {}, []

    def quantize_input(module, args):
        return (fake_quantize_activation(args[0], scheme.activation_bits, scheme.activation_scale), *args[1:])

    try:
        with torch.no_grad():
            for linear in quantized_linears(model):
                originals[linear] = linear.weight.data
                linear.weight.data = fake_quantize_rows(linear.weight.data, scheme.weight_bits)
                hooks.append(linear.register_forward_pre_hook(quantize_input))
        yield model
    finally:
        for hook in hooks:
            hook.remove()
        for linear, weight in originals.items():
            linear.weight.data = weight


def perplexity_under_quantization(model, input_ids: torch.Tensor, schemes: list[str], batch_size: int = 8) -> dict:
    """Held-out perplexity of `model` on `input_ids: [N, S]` in float and under each of `schemes` (names in
    `SCHEMES`): `{"float": {"nll", "ppl"}, name: {"nll", "ppl", "increase"}}`, `increase` = PPL / float PPL - 1."""
    unknown = [name for name in schemes if name not in SCHEMES]
    if unknown:
        raise ValueError(f"Unknown quantization scheme(s) {unknown}; choose from {', '.join(SCHEMES)}.")
    nll = mean_nll(model, input_ids, batch_size)
    rows = {"float": {"nll": nll, "ppl": math.exp(nll)}}
    for name in schemes:
        with fake_quantized(model, SCHEMES[name]):
            nll = mean_nll(model, input_ids, batch_size)
        rows[name] = {"nll": nll, "ppl": math.exp(nll), "increase": math.exp(nll - rows["float"]["nll"]) - 1}
    return rows
