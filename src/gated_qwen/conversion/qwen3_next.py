"""GatedQwen with experts <-> Transformers' Qwen3-Next (`Qwen3NextForCausalLM`) with every layer full attention.

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
Qwen3-Next checkpoint, dense or MoE, and gives a G1 elementwise sigmoid GatedQwen.
"""

from __future__ import annotations

import copy

from ..checkpoint_formats import MOE_FIELDS, QWEN3_FIELDS, qwen3_5_config_fields, source_dtype
from ..configuration_gated import MOE_DEFAULTS, GatedQwenConfig
from .io import Checkpoint, ConversionError
from .qwen3_5 import plan_gated_to_qwen3_5, plan_qwen3_5_tensors


def _view(ckpt: Checkpoint, config: dict) -> Checkpoint:
    """`ckpt` with its config.json replaced by `config` (the tensors are the same)."""
    view = copy.copy(ckpt)
    view.config = config
    return view


def plan_gated_to_qwen3_next(ckpt: Checkpoint):
    from transformers import Qwen3NextConfig

    if ckpt.config.get("model_type") != GatedQwenConfig.model_type:
        raise ConversionError(
            f"SRC has model_type={ckpt.config.get('model_type')!r}; `--to qwen3_next` converts a gated_qwen "
            "checkpoint. To import this one use `--from` with its format."
        )
    config = GatedQwenConfig.from_dict(ckpt.config)
    if config.num_experts and config.shared_expert_intermediate_size == 0:
        raise ConversionError(
            "Qwen3-Next's sparse layers always have a shared expert; this model has none "
            "(shared_expert_intermediate_size=0), so it has no Qwen3-Next equivalent. Nothing was written."
        )
    dense = {**ckpt.config, **MOE_DEFAULTS, "num_experts": 0}
    out35, plan = plan_gated_to_qwen3_5(_view(ckpt, dense))  # passes the expert, router and MLP tensors through

    fields = {k: getattr(out35, k) for k in QWEN3_FIELDS}
    fields.update({k: getattr(config, k) for k in (*MOE_FIELDS, "shared_expert_intermediate_size")})
    fields.update(
        rope_parameters=out35.rope_parameters, attention_bias=out35.attention_bias,
        layer_types=["full_attention"] * config.num_hidden_layers, mlp_only_layers=config.mlp_only_layers or [],
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
    config = GatedQwenConfig(**qwen3_5_config_fields(ckpt.config))  # refuses linear attention and partial RoPE
    config.dtype = source_dtype(ckpt.config)
    return config, plan_qwen3_5_tensors(ckpt, config)  # passes the expert, router and MLP tensors through
