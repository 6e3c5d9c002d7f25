"""Stock Qwen3-MoE checkpoints (Transformers' `Qwen3MoeForCausalLM`) -> GatedQwen with experts.

A GatedQwen MoE stores its tensors under Qwen3-MoE's names and in its on-disk layout (one tensor per expert,
`mlp.experts.{e}.{gate,up,down}_proj.weight`, or the stacked `mlp.experts.gate_up_proj` / `down_proj`; Transformers
reads both), so the experts, the router and every dense MLP pass through unchanged. Everything else of a Qwen3-MoE
layer is a Qwen3 layer: attention, norms, embeddings and the optional function-preserving gate (`add_gate`) are
planned by the Qwen3 importer (`qwen3.py`, which documents what `add_gate` does per variant) on a view of the
checkpoint whose config reads as Qwen3; the MoE fields are then added to the resulting config.

Qwen3-MoE applies a sliding window to every layer when `use_sliding_window` is set; GatedQwen writes that as
`layer_types` all `"sliding_attention"`. Qwen3-MoE has no router z-loss: `router_z_loss_coef` is 0.
"""

from __future__ import annotations

import copy

from ..configuration_gated import GatedQwenConfig
from .io import Checkpoint, ConversionError
from .qwen3 import plan_qwen3_to_gated

# Qwen3-MoE's mixture-of-experts fields, which GatedQwenConfig shares (same names and meaning).
QWEN3_MOE_FIELDS = (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "router_aux_loss_coef", "output_router_logits",
)


def stock_qwen3_moe_config(cfg: dict):
    """The `Qwen3MoeConfig` of a config.json (so fields it leaves out get Qwen3-MoE's defaults)."""
    from transformers import Qwen3MoeConfig

    if cfg.get("model_type") != "qwen3_moe":
        raise ConversionError(
            f"SRC has model_type={cfg.get('model_type')!r}; `--from qwen3_moe` reads model_type 'qwen3_moe'."
        )
    return Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")})


def plan_qwen3_moe_to_gated(ckpt: Checkpoint, add_gate: str | dict | None = None):
    stock = stock_qwen3_moe_config(ckpt.config)
    layers = stock.num_hidden_layers
    # Qwen3-MoE's own rules, written out in Qwen3's terms: head_dim defaults to hidden / heads, and a sliding
    # window (when enabled) covers every layer.
    head_dim = getattr(stock, "head_dim", None) or stock.hidden_size // stock.num_attention_heads
    sliding = stock.sliding_window is not None
    as_qwen3 = {
        **stock.to_dict(), "model_type": "qwen3", "head_dim": head_dim, "use_sliding_window": sliding,
        "max_window_layers": 0 if sliding else layers,
        "layer_types": ["sliding_attention" if sliding else "full_attention"] * layers,
    }
    view = copy.copy(ckpt)
    view.config = as_qwen3
    dense, plan = plan_qwen3_to_gated(view, add_gate)  # passes the expert, router and MLP tensors through

    fields = dense.to_dict()
    for key in ("architectures", "auto_map", "transformers_version", "model_type"):
        fields.pop(key, None)
    fields.update({name: getattr(stock, name) for name in QWEN3_MOE_FIELDS})
    config = GatedQwenConfig(**fields)
    config.dtype = dense.dtype
    return config, plan
