"""Stock Qwen3 (`Qwen3ForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`) checkpoints, read as GatedQwen without a gate
or with one added.

Without a gate the tensors are GatedQwen's as they are (exact): these formats only translate config.json, and have
no tensor rule. With gate fields (`--add-gate`, or gate arguments to `from_pretrained`) the new gate starts so that
the model still computes exactly what the source computes: zero gate weights, a constant logit, and the constant
gate value undone on the projection next to the gate (`added_gate_init` says what, per variant), or is refused
where no initialisation can do that. Layers outside `gate_layers` stay as they are. A GatedQwen MoE stores its
experts, router and dense MLPs under Qwen3-MoE's names and in its on-disk layout, so they pass through unchanged;
Qwen3-MoE applies a sliding window to every layer when `use_sliding_window` is set, which GatedQwen writes as
`layer_types` all "sliding_attention"; Qwen3-MoE has no router z-loss (`router_z_loss_coef` stays 0).
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3MoeConfig

from ...model.configuration_gated import CONFIG_ERRORS, GatedQwenConfig
from ...model.gating import ACTIVATIONS, POSITIONS, gated_layers
from ..errors import CheckpointFormatError
from ..format_types import Context, Format, Reading, TensorRule
from ..shared import QWEN3_FIELDS, SLIDING_FIELDS, STOCK_MOE_FIELDS, parse_gate
from .release import RELEASE_KEYS


def _activation(name: str, x: float) -> float:
    return ACTIVATIONS[name](torch.tensor(x, dtype=torch.float64)).item()


def added_gate_init(config) -> tuple[float, str, float]:
    """How a gate added to a model without one starts so that the model computes what it computed before:
    `(c, action, factor)` with c the constant logit of the new gate (its weights are zero), and `action` "scale"
    (multiply the projection next to the gate by `factor`), "shift" (add `factor` to the bias of the projection that
    produces the gated tensor) or "none".

    - c = 0, except for a multiplicative silu/identity gate with a free constant (a bias, or input-independent
      logits), where c = 1 because silu(0) = identity(0) = 0.
    - Multiplicative (`Y * g`, g = act(c)): 1/g is folded into o_proj's weight for G1 (`W_o (Y g) / g`; o_proj's
      bias is added after and stays) and into the producing projection (v/k/q_proj, o_proj for G5, bias included)
      otherwise. sigmoid: g = 0.5, a factor of 2, exact in every float format; ns_sigmoid 0.75 (4/3 rounds once in
      the checkpoint dtype); silu with a free constant silu(1); identity with one 1, nothing to fold.
    - Additive (`Y + g`): silu and identity add 0; sigmoid and ns_sigmoid add g everywhere, subtracted from the bias
      of the producing projection (v_proj for G1: attention rows sum to 1), so they need `attention_bias=True`.
    Raises `CheckpointFormatError` where no initialisation computes the same function."""
    activation, combine = config.gate_activation, config.gate_combine
    free = config.gate_bias or not config.gate_input_dependent
    c = 1.0 if combine == "multiply" and free and _activation(activation, 0.0) == 0 else 0.0
    g = _activation(activation, c)
    if combine == "multiply":
        if g == 0:
            raise CheckpointFormatError(
                f"a multiplicative {activation} gate with zero weights and no bias outputs {activation}(0) = 0 and "
                "silences attention; no initialisation of this variant computes the source model. Use gate_bias=true "
                "or gate_input_dependent=false (a constant logit can then be chosen), or the sigmoid / ns_sigmoid "
                "activation."
            )
        return c, ("none" if g == 1 else "scale"), 1 / g
    if g == 0:
        return c, "none", 0.0
    if not config.attention_bias:
        raise CheckpointFormatError(
            f"an additive {activation} gate adds {activation}(x) > 0 for every logit x (at least {g:g} here), which "
            f"can only be cancelled through the bias of {POSITIONS[config.gate_position].producer}; the source has "
            "attention_bias=false. Use an additive silu or identity gate (they add 0 at zero weights)."
        )
    return c, "shift", -g


def added_gate_targets(config) -> dict[str, str]:
    """`{"self_attn.projection.kind": "scale" | "shift"}`: the tensors of a gated layer that `added_gate_init`
    changes."""
    _, action, _ = added_gate_init(config)
    position = config.gate_position
    producer = POSITIONS[position].producer
    if action == "scale":
        projection = "o_proj" if position == "sdpa" else producer
        kinds = ("weight",) if position == "sdpa" or not config.attention_bias else ("weight", "bias")
        return {f"self_attn.{projection}.{kind}": "scale" for kind in kinds}
    if action == "shift":
        return {f"self_attn.{producer}.bias": "shift"}
    return {}


def added_gate_tensors(config, c: float) -> dict[str, float]:
    """`{name: value}`: the new tensors of a gated layer (`self_attn.gate.g_proj.weight` / `.bias`, or the `logits`
    of an input-independent gate), each filled with its value: zero weights and the constant logit `c` of
    `added_gate_init`."""
    if not config.gate_input_dependent:
        return {"self_attn.gate.logits": c}
    return {"self_attn.gate.g_proj.weight": 0.0, **({"self_attn.gate.g_proj.bias": c} if config.gate_bias else {})}


def changed_for_added_gate(tensor: torch.Tensor, change: str | None, factor: float) -> torch.Tensor:
    """A tensor of a gated layer (any shape) with the `change` that `added_gate_targets` names for it ("scale":
    times `factor`, "shift": plus `factor`, computed in float64; None: unchanged), in its dtype."""
    if change == "scale":
        return (tensor.double() * factor).to(tensor.dtype)
    if change == "shift":
        return (tensor.double() + factor).to(tensor.dtype)
    return tensor


def qwen3_config_fields(cfg: dict, gate: dict | None) -> dict:
    """GatedQwenConfig fields of a stock Qwen3 config.json (Qwen3's defaults for what it leaves out), without a gate
    or with the `gate` fields (then initialised as `added_gate_init` says; a gate that is no valid GatedQwen gate,
    or that no initialisation can add without changing the function, is refused here, before any tensor is
    read)."""
    release_keys = [k for k in RELEASE_KEYS if k in cfg and (k == "qkv_bias" or cfg[k])]
    if release_keys or cfg.get("use_qk_norm") is False:
        raise CheckpointFormatError(
            f"the folder is in the layout of the paper's released checkpoints ({', '.join(release_keys) or 'use_qk_norm'}"
            " in config.json), not stock Qwen3; read it in the `release` format."
        )

    stock = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")})
    fields = dict({k: getattr(stock, k) for k in QWEN3_FIELDS + SLIDING_FIELDS}, use_qk_norm=True,
                  **(parse_gate(gate) if gate else dict(gate_position=None)))
    if gate:
        try:
            config = GatedQwenConfig(**fields)
        except CONFIG_ERRORS as error:
            added = ", ".join(f"{k}={v!r}" for k, v in fields.items() if k.startswith("gate_"))
            raise CheckpointFormatError(
                f"the gate to add ({added}) is not a GatedQwen gate: {' '.join(str(error.__cause__ or error).split())}"
            ) from None
        added_gate_init(config)
    return fields


def qwen3_moe_config_fields(cfg: dict, gate: dict | None) -> dict:
    """As `qwen3_config_fields` for a stock Qwen3-MoE config.json, with its experts (a sliding window, when enabled,
    covers every layer there)."""
    stock = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")})
    layers = stock.num_hidden_layers
    sliding = stock.sliding_window is not None
    as_qwen3 = {**stock.to_dict(), "model_type": "qwen3",
                "head_dim": getattr(stock, "head_dim", None) or stock.hidden_size // stock.num_attention_heads,
                "use_sliding_window": sliding, "max_window_layers": 0 if sliding else layers,
                "layer_types": ["sliding_attention" if sliding else "full_attention"] * layers}
    return dict(qwen3_config_fields(as_qwen3, gate), **{k: getattr(stock, k) for k in STOCK_MOE_FIELDS})


# Every tensor an added gate can change or come with (see `added_gate_targets` / `added_gate_tensors`).
O_PROJ = "self_attn.o_proj.weight"
NEW_GATE_TENSORS = ("self_attn.gate.g_proj.weight", "self_attn.gate.g_proj.bias", "self_attn.gate.logits")
CHANGED = tuple(f"self_attn.{proj}.{kind}" for proj in ("q_proj", "k_proj", "v_proj", "o_proj")
                for kind in ("weight", "bias") if f"self_attn.{proj}.{kind}" != O_PROJ)


def add_gate(context: Context, tensor: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """The tensor `name` of a stock layer, as the layer with an added gate needs it: unchanged outside the gated
    layers (and without a gate), else changed as `added_gate_init` says; with `o_proj.weight` the new gate tensors,
    shaped as the model's."""
    config = context.config
    if config.gate_position is None or context.layer not in gated_layers(config):
        return {name: tensor}
    c, _, factor = added_gate_init(config)
    out = {name: changed_for_added_gate(tensor, added_gate_targets(config).get(name), factor)}
    if name == O_PROJ:
        out |= {new: tensor.new_full(context.shape(new), value) for new, value in added_gate_tensors(config, c).items()}
    return out


ADDED_GATE_RULES = (
    TensorRule(O_PROJ, (O_PROJ, *NEW_GATE_TENSORS), lambda context, tensor: add_gate(context, tensor, O_PROJ)),
    *(TensorRule(name, (name,), lambda context, tensor, name=name: add_gate(context, tensor, name)) for name in CHANGED),
)
QWEN3 = Format("qwen3", "stock Transformers Qwen3, optionally with a gate added that changes nothing yet",
               reading=Reading(("qwen3",), qwen3_config_fields, rules=ADDED_GATE_RULES, takes_gate=True))
QWEN3_MOE = Format("qwen3_moe", "stock Transformers Qwen3-MoE, optionally with a gate added that changes nothing yet",
                   reading=Reading(("qwen3_moe",), qwen3_moe_config_fields, rules=ADDED_GATE_RULES, takes_gate=True))
