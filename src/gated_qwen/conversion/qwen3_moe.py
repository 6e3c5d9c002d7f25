"""Stock Qwen3-MoE checkpoints (Transformers' `Qwen3MoeForCausalLM`) -> GatedQwen-MoE (`GatedQwenMoeConfig`).

A GatedQwen MoE stores its tensors under Qwen3-MoE's names and in its on-disk layout (one tensor per expert,
`mlp.experts.{e}.{gate,up,down}_proj.weight`, or the stacked `mlp.experts.gate_up_proj` / `down_proj`; Transformers
reads both), so the experts, the router and every dense MLP pass through unchanged. Everything else of a Qwen3-MoE
layer is a Qwen3 layer: attention, norms, embeddings and the optional function-preserving gate (`add_gate`) are
planned as for Qwen3 (`qwen3.py`). The config is `checkpoint_formats.qwen3_moe_config_fields`: Qwen3-MoE applies a
sliding window to every layer when `use_sliding_window` is set, which GatedQwen writes as `layer_types` all
`"sliding_attention"`; Qwen3-MoE has no router z-loss: `router_z_loss_coef` is 0.
"""

from __future__ import annotations

from ..checkpoint_formats import parse_gate, qwen3_moe_config_fields, source_dtype
from ..configuration_gated import GatedQwenMoeConfig
from .io import Checkpoint, ConversionError
from .qwen3 import plan_stock_tensors


def plan_qwen3_moe_to_gated(ckpt: Checkpoint, add_gate: str | dict | None = None):
    cfg = ckpt.config
    if cfg.get("model_type") != "qwen3_moe":
        raise ConversionError(
            f"SRC has model_type={cfg.get('model_type')!r}; `--from qwen3_moe` reads model_type 'qwen3_moe'."
        )
    config = GatedQwenMoeConfig(**qwen3_moe_config_fields(cfg, parse_gate(add_gate) if add_gate is not None else None))
    config.dtype = source_dtype(cfg)
    return config, plan_stock_tensors(ckpt, config)  # passes the expert, router and MLP tensors through
