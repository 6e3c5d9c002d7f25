"""Stock Qwen3 checkpoints (Transformers' `Qwen3ForCausalLM`) -> GatedQwen, without a gate or with one added.

Without `add_gate` the result is a no-gate GatedQwen with the same tensors (exact). With `add_gate`, the new gate is
initialised so that the model still computes exactly what the source computes (function-preserving):

- The gate's free parameters start at a constant logit c: the weights of `g_proj` are zero (so `X W = 0`); a gate
  bias, or the logits of an input-independent gate, are set to c. c = 0, except for a multiplicative silu or
  identity gate with such a free constant, where c = 1 (because silu(0) = identity(0) = 0).
- Multiplicative gate (`Y * act(c)`): the constant g = act(c) is undone by a factor 1/g on the projection next to
  the gate: o_proj's weight for G1 (`sdpa`; `W_o (Y g) / g = W_o Y`, o_proj's bias is added after and stays),
  v_proj / k_proj / q_proj for G2 / G3 / G4 and o_proj for G5 (weight and bias). sigmoid: g = 0.5, the factor 2 is
  exact in every float format; ns_sigmoid: g = 0.75, factor 4/3; silu with a free constant: g = silu(1); identity
  with a free constant: g = 1, nothing to fold. The non-power-of-two factors round once in the checkpoint dtype.
  Refused: silu or identity without a free constant (zero weights give a gate of 0, which silences attention and
  no projection can undo).
- Additive gate (`Y + act(c)`): silu and identity add act(0) = 0, exact with nothing to change. sigmoid and
  ns_sigmoid add 0.5 / 0.75 everywhere (they are never 0); that constant is subtracted from the bias of the
  projection that produces Y (v_proj for G1 too, because attention rows sum to 1), so they need a source with
  `attention_bias=True` and are refused otherwise.
- Layers outside `gate_layers` stay as they are.
"""

from __future__ import annotations

import json

import torch

from ..configuration_gated import CONFIG_ERRORS, GatedQwenConfig
from ..gating import ACTIVATIONS, POSITIONS
from .common import QWEN3_FIELDS, SLIDING_FIELDS, TensorMap, copy_rest, source_dtype
from .io import Checkpoint, ConversionError, TensorPlan

SHORTHANDS = {
    "elementwise": dict(gate_position="sdpa", gate_granularity="elementwise"),
    "headwise": dict(gate_position="sdpa", gate_granularity="headwise"),
}


def parse_gate(variant: str | dict) -> dict:
    """`"elementwise"` / `"headwise"` (G1 sigmoid, the paper's two released variants) or a dict / JSON object of gate
    fields (`gate_position` ..., `sdpa_output_transform` excluded) -> GatedQwenConfig gate fields."""
    if isinstance(variant, dict):
        fields = dict(variant)
    elif variant in SHORTHANDS:
        fields = dict(SHORTHANDS[variant])
    else:
        try:
            fields = json.loads(variant)
        except json.JSONDecodeError:
            fields = None
        if not isinstance(fields, dict):
            raise ConversionError(
                f"--add-gate {variant!r} is not a variant: use 'elementwise', 'headwise' or a JSON object of gate "
                'fields, e.g. \'{"gate_position": "value", "gate_granularity": "headwise"}\'.'
            )
    bad = sorted(k for k in fields if not k.startswith("gate_"))
    if bad:
        raise ConversionError(f"--add-gate takes gate fields (gate_position, gate_granularity, ...), got {bad}.")
    fields.setdefault("gate_position", "sdpa")
    if fields["gate_position"] is None:
        raise ConversionError("--add-gate with gate_position=None adds no gate; leave --add-gate out instead.")
    return fields


def gate_init(config: GatedQwenConfig) -> tuple[float, str, float]:
    """`(c, action, factor)`: the constant logit c of the new gate, and `"scale"` (multiply the producing projection
    by `factor`), `"shift"` (add `factor` to the producing projection's bias) or `"none"`. Raises when no
    function-preserving initialisation exists."""
    activation, combine = config.gate_activation, config.gate_combine
    free = config.gate_bias or not config.gate_input_dependent
    def act(x: float) -> float:  # the gate's activation, in float64
        return ACTIVATIONS[activation](torch.tensor(x, dtype=torch.float64)).item()

    c = 1.0 if combine == "multiply" and free and act(0.0) == 0 else 0.0
    g = act(c)
    if combine == "multiply":
        if g == 0:
            raise ConversionError(
                f"--add-gate: a multiplicative {activation} gate with zero weights and no bias outputs "
                f"{activation}(0) = 0 and silences attention; no initialisation of this variant computes the source "
                "model. Use gate_bias=true or gate_input_dependent=false (a constant logit can then be chosen), or "
                "the sigmoid / ns_sigmoid activation."
            )
        return c, ("none" if g == 1 else "scale"), 1 / g
    if g == 0:
        return c, "none", 0.0
    if not config.attention_bias:
        raise ConversionError(
            f"--add-gate: an additive {activation} gate adds {activation}(x) > 0 for every logit x (at least "
            f"{g:g} here), which can only be cancelled through the bias of {POSITIONS[config.gate_position].producer}; the "
            "source has attention_bias=false. Use an additive silu or identity gate (they add 0 at zero weights)."
        )
    return c, "shift", -g


def plan_qwen3_to_gated(ckpt: Checkpoint, add_gate: str | dict | None = None):
    cfg = ckpt.config
    if cfg.get("model_type") != "qwen3":
        raise ConversionError(f"SRC has model_type={cfg.get('model_type')!r}; `--from qwen3` reads model_type 'qwen3'.")
    release_keys = [k for k in ("headwise_attn_output_gate", "elementwise_attn_output_gate") if cfg.get(k)]
    if release_keys or "qkv_bias" in cfg or cfg.get("use_qk_norm") is False:
        raise ConversionError(
            f"SRC is in the layout of the paper's released checkpoints ({', '.join(release_keys) or 'qkv_bias'} in "
            "config.json), not stock Qwen3; use `--from release`."
        )
    from transformers import Qwen3Config

    stock = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")})
    fields = {k: getattr(stock, k) for k in QWEN3_FIELDS + SLIDING_FIELDS}
    gate = parse_gate(add_gate) if add_gate is not None else dict(gate_position=None)
    try:
        config = GatedQwenConfig(**fields, use_qk_norm=True, **gate)
    except CONFIG_ERRORS as error:
        raise ConversionError(f"--add-gate {add_gate}: {error.__cause__ or error}") from None
    config.dtype = source_dtype(cfg)

    tmap = TensorMap(ckpt)
    if config.gate_position is not None:
        c, action, factor = gate_init(config)
        heads, width = config.gate_shape
        for layer in config.gated_layers:
            prefix = f"model.layers.{layer}.self_attn."
            dtype = tmap.info(prefix + "q_proj.weight").dtype
            if config.gate_input_dependent:
                tmap.put(prefix + "g_proj.weight", constant((heads * width, config.hidden_size), dtype, 0.0))
                if config.gate_bias:
                    tmap.put(prefix + "g_proj.bias", constant((heads * width,), dtype, c))
            else:
                tmap.put(prefix + "gate_logits", constant((heads, width), dtype, c))
            if action == "scale":
                proj = "o_proj" if config.gate_position == "sdpa" else POSITIONS[config.gate_position].producer
                kinds = ("weight",) if config.gate_position == "sdpa" or not config.attention_bias else (
                    "weight", "bias")
                for kind in kinds:
                    tmap.put(prefix + f"{proj}.{kind}", scaled(tmap, prefix + f"{proj}.{kind}", factor))
            elif action == "shift":
                name = prefix + f"{POSITIONS[config.gate_position].producer}.bias"
                tmap.put(name, shifted(tmap, name, factor))
    copy_rest(tmap, config)
    return config, tmap.finish()


def constant(shape: tuple[int, ...], dtype: torch.dtype, value: float) -> TensorPlan:
    return TensorPlan(shape, dtype, lambda: torch.full(shape, value, dtype=dtype))


def scaled(tmap: TensorMap, name: str, factor: float) -> TensorPlan:
    info = tmap.info(name)
    tmap.used.add(name)
    return TensorPlan(info.shape, info.dtype, lambda: (tmap.ckpt.get(name).double() * factor).to(info.dtype))


def shifted(tmap: TensorMap, name: str, delta: float) -> TensorPlan:
    info = tmap.info(name)
    tmap.used.add(name)
    return TensorPlan(info.shape, info.dtype, lambda: (tmap.ckpt.get(name).double() + delta).to(info.dtype))
