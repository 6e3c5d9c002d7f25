"""GatedQwen-MoE (`GatedQwenMoeConfig`) <-> Transformers' Qwen3-Next (`Qwen3NextForCausalLM`) with every layer full attention.

A Qwen3-Next full-attention layer is a Qwen3 attention with the G1 elementwise sigmoid gate packed into `q_proj`, and
its sparse block is Qwen3-MoE's router and experts plus a shared expert scaled by `sigmoid(shared_expert_gate(x))`.
With `layer_types` all `"full_attention"` and `partial_rotary_factor=1.0` it computes exactly a G1-gated GatedQwen
MoE with `shared_expert_intermediate_size` set. What differs is the format of the attention part only, which
Qwen3.5 shares: the fused per-head `[q_h | gate_h]` `q_proj`, the zero-centred RMSNorms (`x̂ · (1 + w)`), partial
RoPE. That part is planned by the Qwen3.5 converter (`qwen3_5.py`, which documents it; the export on a view of the
checkpoint whose config hides the experts); the MLP tensors have the same names and on-disk layout in both models
and pass through unchanged. The import's config is `checkpoint_formats.qwen3_5_config_fields`, experts included, as
`from_pretrained` reads such a folder.

Export needs a shared expert in every sparse layer (Qwen3-Next's sparse block always has one) and a gate that
Qwen3.5's export accepts (every G1 sigmoid multiplicative gate; see `qwen3_5.py`). Qwen3-Next has no router z-loss:
`router_z_loss_coef` is not carried over (it only weighs a training loss). Import reads every all-full-attention
Qwen3-Next checkpoint, dense or MoE, and gives a G1 elementwise sigmoid GatedQwen (a GatedQwen-MoE when it has
mixture-of-experts layers). Mixtures of experts saved before they had their own model type (model_type "gated_qwen"
with `num_experts` > 0) export as well.
"""

from __future__ import annotations

import copy

from ..checkpoint_formats import (
    GATED_MODEL_TYPES,
    MOE_FIELDS,
    QWEN3_FIELDS,
    legacy_moe_config_dict,
    qwen3_5_config_fields,
    source_dtype,
)
from ..configuration_gated import MOE_DEFAULTS, GatedQwenConfig, GatedQwenMoeConfig
from .io import Checkpoint, ConversionError
from .qwen3_5 import plan_gated_to_qwen3_5, plan_qwen3_5_tensors


def _view(ckpt: Checkpoint, config: dict) -> Checkpoint:
    """`ckpt` with its config.json replaced by `config` (the tensors are the same)."""
    view = copy.copy(ckpt)
    view.config = config
    return view


def plan_gated_to_qwen3_next(ckpt: Checkpoint):
    from transformers import Qwen3NextConfig

    cfg = legacy_moe_config_dict(ckpt.config)
    if cfg.get("model_type") not in GATED_MODEL_TYPES:
        raise ConversionError(
            f"SRC has model_type={cfg.get('model_type')!r}; `--to qwen3_next` converts a gated_qwen or "
            "gated_qwen_moe checkpoint. To import this one use `--from` with its format."
        )
    config = GatedQwenConfig.from_dict(cfg)  # a GatedQwenMoeConfig for a mixture of experts
    moe = isinstance(config, GatedQwenMoeConfig)
    if moe and config.shared_expert_intermediate_size == 0:
        raise ConversionError(
            "Qwen3-Next's sparse layers always have a shared expert; this model has none "
            "(shared_expert_intermediate_size=0), so it has no Qwen3-Next equivalent. Nothing was written."
        )
    # The attention part is Qwen3.5's: planned on a dense view of the config (the same tensors).
    dense = {k: v for k, v in cfg.items() if k not in ("num_experts", *MOE_DEFAULTS, "auto_map")}
    out35, plan = plan_gated_to_qwen3_5(_view(ckpt, dict(dense, model_type=GatedQwenConfig.model_type)))

    experts = config.to_dict() if moe else {"num_experts": 0, **MOE_DEFAULTS}  # the tensors pass through
    fields = {k: getattr(out35, k) for k in QWEN3_FIELDS}
    fields.update({k: experts[k] for k in (*MOE_FIELDS, "shared_expert_intermediate_size")})
    fields.update(
        rope_parameters=out35.rope_parameters, attention_bias=out35.attention_bias,
        layer_types=["full_attention"] * config.num_hidden_layers, mlp_only_layers=experts["mlp_only_layers"] or [],
    )
    out = Qwen3NextConfig(**fields)
    out.architectures = ["Qwen3NextForCausalLM"]
    out.dtype = out35.dtype
    return out, plan


def plan_qwen3_next_to_gated(ckpt: Checkpoint):
    if ckpt.config.get("model_type") != "qwen3_next":
        raise ConversionError(
            f"SRC has model_type={ckpt.config.get('model_type')!r}; `--from qwen3_next` reads model_type 'qwen3_next'."
        )
    fields = qwen3_5_config_fields(ckpt.config)  # refuses linear attention and partial RoPE
    config = (GatedQwenMoeConfig if "num_experts" in fields else GatedQwenConfig)(**fields)
    config.dtype = source_dtype(ckpt.config)
    return config, plan_qwen3_5_tensors(ckpt, config)  # passes the expert, router and MLP tensors through
