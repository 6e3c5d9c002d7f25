"""What the format modules share: the config fields every format here has in common with GatedQwen's, the
checkpoint dtype a config.json names, the gate an import may add (`--add-gate`, gate fields of `from_pretrained`)
and the note that goes with it."""

from __future__ import annotations

from ..files import parse_json
from ..model.configuration_gated import MOE_FIELDS
from .errors import CheckpointFormatError

# The Qwen3 fields that every format here shares with GatedQwenConfig (same names, same meaning).
QWEN3_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "tie_word_embeddings", "rope_parameters", "attention_bias", "attention_dropout", "pad_token_id",
    "bos_token_id", "eos_token_id",
)
SLIDING_FIELDS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
# The mixture-of-experts fields of GatedQwenMoeConfig that Qwen3-MoE and Qwen3-Next have too (Qwen3-Next adds the
# shared expert's width; neither has the router z-loss).
STOCK_MOE_FIELDS = tuple(f for f in MOE_FIELDS if f not in ("shared_expert_intermediate_size", "router_z_loss_coef"))

A7_NOTE = (
    "Note (Qiu et al. 2025, appendix A.7): adding a gate to an already-trained model does not remove the attention "
    "sink or the massive activations it has learned. The model computes what the source computes; only further "
    "training with the gate changes that."
)


def source_dtype(cfg: dict) -> str | None:
    """The checkpoint dtype a config.json names (`dtype`, or the older `torch_dtype`)."""
    return cfg.get("dtype") or cfg.get("torch_dtype")


SHORTHANDS = {
    "elementwise": dict(gate_position="sdpa", gate_granularity="elementwise"),
    "headwise": dict(gate_position="sdpa", gate_granularity="headwise"),
}


def parse_gate(variant: str | dict) -> dict:
    """`"elementwise"` / `"headwise"` (G1 sigmoid, the paper's two released variants) or a dict / JSON object of
    gate fields (`sdpa_output_transform` excluded) -> GatedQwenConfig gate fields; `gate_position` defaults to G1."""
    if isinstance(variant, dict):
        fields = dict(variant)
    elif variant in SHORTHANDS:
        fields = dict(SHORTHANDS[variant])
    else:
        try:
            fields = parse_json(variant, "--add-gate", CheckpointFormatError)
        except CheckpointFormatError:
            fields = None
        if not isinstance(fields, dict):
            raise CheckpointFormatError(
                f"gate {variant!r} is not a variant: use 'elementwise', 'headwise' or a JSON object of gate fields, "
                'e.g. \'{"gate_position": "value", "gate_granularity": "headwise"}\'.'
            )
    bad = sorted(k for k in fields if not k.startswith("gate_"))
    if bad:
        raise CheckpointFormatError(f"an added gate takes gate fields (gate_position, gate_granularity, ...), got {bad}.")
    fields.setdefault("gate_position", "sdpa")
    if fields["gate_position"] is None:
        raise CheckpointFormatError("adding a gate with gate_position=None adds no gate; leave the gate out instead.")
    return fields
