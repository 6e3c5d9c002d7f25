"""Stock Qwen3 checkpoints (Transformers' `Qwen3ForCausalLM`) -> GatedQwen, without a gate or with one added.

Without `add_gate` the result is a no-gate GatedQwen with the same tensors (exact). With `add_gate` (`"elementwise"`,
`"headwise"` or gate fields, as `checkpoint_formats.parse_gate` reads them) the new gate is initialised so that the
model still computes exactly what the source computes: zero gate weights, a constant logit, and the constant gate
value undone on the projection next to the gate, or refused where no initialisation can do that. The rules, per
variant, are `checkpoint_formats.added_gate_init` / `added_gate_targets`, the same that `from_pretrained(stock_folder,
gate_position=...)` applies. Layers outside `gate_layers` stay as they are.
"""

from __future__ import annotations

import torch

from ..checkpoint_formats import (
    added_gate_init,
    added_gate_targets,
    added_gate_tensors,
    changed_for_added_gate,
    parse_gate,
    qwen3_config_fields,
    source_dtype,
)
from ..configuration_gated import GatedQwenConfig
from .common import TensorMap, copy_rest
from .io import Checkpoint, ConversionError, TensorPlan


def plan_qwen3_to_gated(ckpt: Checkpoint, add_gate: str | dict | None = None):
    cfg = ckpt.config
    if cfg.get("model_type") != "qwen3":
        raise ConversionError(f"SRC has model_type={cfg.get('model_type')!r}; `--from qwen3` reads model_type 'qwen3'.")
    config = GatedQwenConfig(**qwen3_config_fields(cfg, parse_gate(add_gate) if add_gate is not None else None))
    config.dtype = source_dtype(cfg)
    return config, plan_stock_tensors(ckpt, config)


def plan_stock_tensors(ckpt: Checkpoint, config: GatedQwenConfig) -> dict[str, TensorPlan]:
    """The tensors of a stock Qwen3 / Qwen3-MoE checkpoint read as the GatedQwen model `config`: unchanged, and in
    the layers of an added gate its new tensors and the projection it changes (`checkpoint_formats.added_gate_*`,
    as `from_pretrained` reads such a folder)."""
    tmap = TensorMap(ckpt)
    if config.gate_position is not None:
        c, _, factor = added_gate_init(config)
        changes = added_gate_targets(config)
        heads, width = config.gate_shape
        shapes = {"g_proj.weight": (heads * width, config.hidden_size), "g_proj.bias": (heads * width,),
                  "logits": (heads, width)}
        for layer in config.gated_layers:
            prefix = f"model.layers.{layer}.self_attn."
            dtype = tmap.info(prefix + "q_proj.weight").dtype
            for kind, value in added_gate_tensors(config, c).items():
                name = prefix + ("gate_logits" if kind == "logits" else kind)
                tmap.put(name, constant(shapes[kind], dtype, value))
            for kind, change in changes.items():
                tmap.put(prefix + kind, changed(tmap, prefix + kind, change, factor))
    copy_rest(tmap, config)
    return tmap.finish()


def constant(shape: tuple[int, ...], dtype: torch.dtype, value: float) -> TensorPlan:
    return TensorPlan(shape, dtype, lambda: torch.full(shape, value, dtype=dtype))


def changed(tmap: TensorMap, name: str, change: str, factor: float) -> TensorPlan:
    info = tmap.info(name)
    tmap.used.add(name)
    return TensorPlan(info.shape, info.dtype, lambda: changed_for_added_gate(tmap.ckpt.get(name), change, factor))
