"""The paper's models (appendix table 7) as data the package owns, and `from_paper`, which the package attaches to
the config classes when it is imported (`GatedQwenConfig.from_paper`, `GatedQwenMoeConfig.from_paper`): the files a
saved folder ships hold the fields and their rules, not the paper's sizes."""

from typing import Any

from .model.configuration_gated import GatedQwenConfig
from .model.configuration_gated_moe import GatedQwenMoeConfig
from .model.gating import gate_parameters_per_layer, gated_layers

# Dense ones build a GatedQwenConfig, the MoE a GatedQwenMoeConfig. Gated dense variants shrink the FFN so the
# parameter count stays equal (`from_paper`).
PAPER_PRESETS: dict[str, dict[str, Any]] = {
    "dense-1.7b-28l": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, use_qk_norm=True,
        max_position_embeddings=4096,
    ),
    "dense-1.7b-48l": dict(
        hidden_size=1536, intermediate_size=4608, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, use_qk_norm=True,
        max_position_embeddings=4096,
    ),
    # The 15B-A2B MoE of tables 1, 3 and 4. Gated variants add the gate on top (table 1's +M). `norm_topk_prob` and
    # the z-loss coefficient are not in the paper: Qwen3's released MoE models normalise the top-k probabilities,
    # and 1e-3 is ST-MoE's z-loss coefficient.
    "moe-15a2b": dict(
        hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        tie_word_embeddings=False, use_qk_norm=True, max_position_embeddings=4096,
        output_router_logits=True, router_aux_loss_coef=0.001, router_z_loss_coef=0.001,
    ),
}


def from_paper(cls, name: str, **overrides) -> GatedQwenConfig:
    """The paper's models by name: `"dense-1.7b-28l"`, `"dense-1.7b-48l"` (a GatedQwenConfig) or `"moe-15a2b"`
    (a GatedQwenMoeConfig), appendix table 7, whichever of the two classes it is called on.

    `overrides` set any field (gate fields included). Gated dense variants shrink `intermediate_size` so the
    total parameter count stays that of the baseline, as the paper does, unless `intermediate_size` is given.
    Gated MoE variants keep the experts and add the gate on top (table 1: +201M for G1 elementwise).
    """
    if name not in PAPER_PRESETS:
        raise ValueError(f"Unknown paper preset {name!r}; choose one of {', '.join(map(repr, PAPER_PRESETS))}.")
    moe = "num_experts" in PAPER_PRESETS[name]
    config = (GatedQwenMoeConfig if moe else GatedQwenConfig)(**{**PAPER_PRESETS[name], **overrides})
    if "intermediate_size" not in overrides and config.gate_position is not None and not moe:
        added = gate_parameters_per_layer(config) * len(gated_layers(config))
        per_unit = 3 * config.hidden_size * config.num_hidden_layers  # gate, up and down rows of every MLP
        config.intermediate_size -= round(added / per_unit)
    return config
