"""The checkpoint layouts GatedQwen reads besides its own, defined once for `from_pretrained` and `gated-qwen convert`.

| format    | config.json                                   | what differs from a gated_qwen folder                   |
|-----------|-----------------------------------------------|---------------------------------------------------------|
| `release` | `model_type="qwen3"` + `headwise_attn_output_gate` / `elementwise_attn_output_gate` / `qkv_bias` (the paper's `QwQZh/gated_attention`) | gate rows packed in `q_proj` per kv group `[G·D queries | G·W gates]` |
| `qwen3`   | stock Qwen3 (`model_type="qwen3"`)            | no gate; gate arguments add one that keeps the function  |
| `qwen3_moe` | stock Qwen3-MoE                             | as `qwen3`, with experts                                 |
| `qwen3_5` | Qwen3.5 text / Qwen3-Next, all layers full attention | `q_proj` rows per head `[q_h | g_h]`; norms zero-centred (`x̂·(1 + w)`) |

`gated_config_dict(config_dict, gate)` turns such a config.json into a gated_qwen one, or a gated_qwen_moe one for a
mixture of experts (refusing what GatedQwen cannot compute, with the reason), and records the format in
`_checkpoint_format`; it also reads a mixture of experts saved before it had its own model type (model_type
"gated_qwen" with `num_experts` > 0) as the gated_qwen_moe one it is; `CHECKPOINT_CONVERSIONS` are the
Transformers `WeightConverter`s that `from_pretrained` applies to the tensors of that format (a gated_qwen folder
passes through them unchanged). They reverse to the identity: `save_pretrained` always writes GatedQwen's layout;
`gated-qwen convert --to release|qwen3_5|qwen3_next` writes the foreign ones, from the same functions.

This file is copied to the Hugging Face Hub beside `modeling_gated.py` and `modeling_gated_moe.py`: relative imports
only.
"""

import contextvars
import ctypes
import ctypes.util
import functools
import json
import mmap
import sys

import torch
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.utils import logging

from .gating import ACTIVATIONS, POSITIONS

logger = logging.get_logger(__name__)


class CheckpointFormatError(ValueError):
    """A config.json or tensor that GatedQwen cannot read as a model it computes; the message says why and what
    would work."""


# The Qwen3 fields that every format here shares with GatedQwenConfig (same names, same meaning).
QWEN3_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "tie_word_embeddings", "rope_parameters", "attention_bias", "attention_dropout", "pad_token_id",
    "bos_token_id", "eos_token_id",
)
SLIDING_FIELDS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
# The mixture-of-experts fields that Qwen3-MoE / Qwen3-Next share with GatedQwenMoeConfig.
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers", "router_aux_loss_coef", "output_router_logits")

A7_NOTE = (
    "Note (Qiu et al. 2025, appendix A.7): adding a gate to an already-trained model does not remove the attention "
    "sink or the massive activations it has learned. The model computes what the source computes; only further "
    "training with the gate changes that."
)


def source_dtype(cfg: dict) -> str | None:
    """The checkpoint dtype a config.json names (`dtype`, or the older `torch_dtype`)."""
    return cfg.get("dtype") or cfg.get("torch_dtype")


# ---------------------------------------------------------------------------------------------- the release
# The official configuration's defaults (`configuration_qwen3.py` of qiuzh20/gated_attention).
RELEASE_DEFAULTS = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, head_dim=128, hidden_act="silu", max_position_embeddings=32768, initializer_range=0.02,
    rms_norm_eps=1e-6, use_cache=True, tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None,
    attention_dropout=0.0, use_qk_norm=True, pad_token_id=None, bos_token_id=None, eos_token_id=None,
)
RELEASE_KEYS = ("headwise_attn_output_gate", "elementwise_attn_output_gate", "qkv_bias")
RELEASE_VARIANTS = ("baseline", "headwise", "elementwise")


def release_variant(config: dict) -> str:
    """`"headwise"`, `"elementwise"` or `"baseline"`, as the official code reads the two flags (headwise first)."""
    if config.get("headwise_attn_output_gate", False):
        return "headwise"
    if config.get("elementwise_attn_output_gate", False):
        return "elementwise"
    return "baseline"


def release_q_rows(heads: int, head_dim: int, variant: str) -> int:
    """Rows of a release `q_proj`: H·D queries plus H (headwise) or H·D (elementwise) gate rows."""
    return heads * head_dim + {"baseline": 0, "headwise": heads, "elementwise": heads * head_dim}[variant]


def release_q_rows_error(name: str, rows: int, heads: int, head_dim: int, variant: str) -> CheckpointFormatError:
    """The error for a release `q_proj` tensor `name` with `rows` rows where the config's `variant` has
    `release_q_rows`: it names the flags, both row counts and the variant whose layout the rows are, if any."""
    flags = {"baseline": "headwise_attn_output_gate and elementwise_attn_output_gate false",
             "headwise": "headwise_attn_output_gate=True", "elementwise": "elementwise_attn_output_gate=True"}
    seen = {release_q_rows(heads, head_dim, v): v for v in RELEASE_VARIANTS}.get(rows)
    return CheckpointFormatError(
        f"config.json describes the release's {variant} variant ({flags[variant]}), whose q_proj has "
        f"{release_q_rows(heads, head_dim, variant)} rows (H={heads}, D={head_dim}), but {name} has {rows} rows"
        + (f", the {seen} layout: fix the gate flags in config.json." if seen else ", which is no release layout.")
    )


def split_release_q_proj(packed: torch.Tensor, kv_heads: int, group_q_rows: int, part: int) -> torch.Tensor:
    """Release `q_proj` rows `packed: [K * (G*D + G*W), ...]` -> the queries `[H*D, ...]` (`part=0`) or the gates
    `[H*W, ...]` (`part=1`), rows per query head."""
    grouped = packed.view(kv_heads, -1, *packed.shape[1:])
    rows = slice(None, group_q_rows) if part == 0 else slice(group_q_rows, None)
    return grouped[:, rows].reshape(-1, *packed.shape[1:])


def pack_release_q_proj(queries: torch.Tensor, gates: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The inverse of `split_release_q_proj`: `queries [H*D, ...]`, `gates [H*W, ...]` -> `[K * (G*D + G*W), ...]`."""
    rest = queries.shape[1:]
    return torch.cat([queries.view(kv_heads, -1, *rest), gates.view(kv_heads, -1, *rest)], dim=1).reshape(-1, *rest)


def release_config_fields(cfg: dict) -> dict:
    """GatedQwenConfig fields of a release config.json: the official defaults for what it leaves out, `qkv_bias` as
    the bias of q, k, v, o (and of the gate rows), G1 sigmoid gate of its variant (none for the baseline)."""
    if cfg.get("use_sliding_window", False):
        raise CheckpointFormatError(
            "the release config has use_sliding_window=true; the official code applies the window only with "
            "flash-attention 2 and ignores it otherwise, so which model it describes depends on the backend. "
            "Set use_sliding_window to false in config.json if the model was trained without it."
        )
    fields = {k: cfg.get(k, default) for k, default in RELEASE_DEFAULTS.items()}
    heads, kv_heads = fields["num_attention_heads"], fields["num_key_value_heads"]
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads == 0):
        raise CheckpointFormatError(
            f"num_key_value_heads={kv_heads!r} must divide num_attention_heads={heads!r} in the release config.")
    bias = bool(cfg["qkv_bias"] if "qkv_bias" in cfg else cfg.get("attention_bias", False))
    variant = release_variant(cfg)
    gate = (dict(gate_position=None) if variant == "baseline"
            else dict(gate_position="sdpa", gate_granularity=variant, gate_bias=bias))
    return dict({k: fields[k] for k in QWEN3_FIELDS if k in fields}, rope_theta=fields["rope_theta"],
                rope_scaling=fields["rope_scaling"], attention_bias=bias, use_qk_norm=fields["use_qk_norm"], **gate)


# ------------------------------------------------------------------------------------ stock Qwen3 (+ a gate)
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
            fields = json.loads(variant)
        except json.JSONDecodeError:
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
    """`{projection.kind: "scale" | "shift"}`: the tensors of a gated layer that `added_gate_init` changes."""
    _, action, _ = added_gate_init(config)
    position = config.gate_position
    producer = POSITIONS[position].producer
    if action == "scale":
        projection = "o_proj" if position == "sdpa" else producer
        kinds = ("weight",) if position == "sdpa" or not config.attention_bias else ("weight", "bias")
        return {f"{projection}.{kind}": "scale" for kind in kinds}
    if action == "shift":
        return {f"{producer}.bias": "shift"}
    return {}


def added_gate_tensors(config, c: float) -> dict[str, float]:
    """`{kind: value}`: the new tensors of a gated layer (`g_proj.weight`, `g_proj.bias`, or the `logits` of an
    input-independent gate), each filled with its value: zero weights and the constant logit `c` of
    `added_gate_init`."""
    if not config.gate_input_dependent:
        return {"logits": c}
    return {"g_proj.weight": 0.0, **({"g_proj.bias": c} if config.gate_bias else {})}


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
    from transformers import Qwen3Config

    stock = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")})
    fields = dict({k: getattr(stock, k) for k in QWEN3_FIELDS + SLIDING_FIELDS}, use_qk_norm=True,
                  **(parse_gate(gate) if gate else dict(gate_position=None)))
    if gate:
        from .configuration_gated import CONFIG_ERRORS, GatedQwenConfig

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
    from transformers import Qwen3MoeConfig

    stock = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")})
    layers = stock.num_hidden_layers
    sliding = stock.sliding_window is not None
    as_qwen3 = {**stock.to_dict(), "model_type": "qwen3",
                "head_dim": getattr(stock, "head_dim", None) or stock.hidden_size // stock.num_attention_heads,
                "use_sliding_window": sliding, "max_window_layers": 0 if sliding else layers,
                "layer_types": ["sliding_attention" if sliding else "full_attention"] * layers}
    return dict(qwen3_config_fields(as_qwen3, gate), **{k: getattr(stock, k) for k in MOE_FIELDS})


# --------------------------------------------------------------------------------- Qwen3.5 / Qwen3-Next
def interleave_heads(queries: torch.Tensor, gates: torch.Tensor, heads: int) -> torch.Tensor:
    """`queries, gates: [H*D, ...]` -> Qwen3.5 `q_proj` rows `[H*2D, ...]`, per head `[q_h | gate_h]`."""
    rest = queries.shape[1:]
    return torch.cat([queries.view(heads, -1, *rest), gates.view(heads, -1, *rest)], dim=1).reshape(-1, *rest)


def split_heads(packed: torch.Tensor, heads: int, part: int) -> torch.Tensor:
    """Qwen3.5 `q_proj` rows `[H*2D, ...]` -> the queries `[H*D, ...]` (`part=0`) or the gates `[H*D, ...]`
    (`part=1`)."""
    return packed.view(heads, 2, -1, *packed.shape[1:])[:, part].reshape(-1, *packed.shape[1:])


def qwen3_5_q_rows_error(name: str, rows: int, heads: int, head_dim: int) -> CheckpointFormatError:
    """The error for a Qwen3.5 `q_proj` tensor `name` whose `rows` are not the 2·H·D of `split_heads`."""
    return CheckpointFormatError(
        f"{name} has {rows} rows; Qwen3.5 attention has 2·H·D = {2 * heads * head_dim} (H={heads}, D={head_dim}): "
        "the queries and the gate of each head."
    )


def from_zero_centred(weight: torch.Tensor) -> torch.Tensor:
    """A Qwen3.5 / Qwen3-Next RMSNorm weight `[dim]` (the norm computes `x̂·(1 + w)`) -> GatedQwen's (`x̂·w`):
    `w + 1`. `to_zero_centred` is its inverse."""
    return weight + 1


def to_zero_centred(weight: torch.Tensor) -> torch.Tensor:
    """GatedQwen's RMSNorm weight `[dim]` -> Qwen3.5's zero-centred one: `w - 1` (the inverse of
    `from_zero_centred`)."""
    return weight - 1


def moe_layers(layers: int, num_experts: int, mlp_only_layers: list[int] | None, sparse_step: int) -> list[int]:
    """The mixture-of-experts layers of a Qwen3-MoE / Qwen3-Next config (none with `num_experts=0`)."""
    dense = set(mlp_only_layers or [])
    return [i for i in range(layers) if num_experts and i not in dense and (i + 1) % sparse_step == 0]


def qwen3_5_config_fields(cfg: dict) -> dict:
    """GatedQwenConfig fields (G1 elementwise sigmoid gate) of a Qwen3.5 text or Qwen3-Next config.json whose
    layers are all full attention with RoPE on the whole head; Qwen3-Next's experts come along."""
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig

    model_type = cfg.get("model_type")
    if model_type == "qwen3_5":
        raise CheckpointFormatError(
            "the folder is a Qwen3.5 vision-language checkpoint (model_type 'qwen3_5'); use its text model "
            "(model_type 'qwen3_5_text', e.g. saved from Qwen3_5ForCausalLM)."
        )
    cls = Qwen3_5TextConfig if model_type == "qwen3_5_text" else Qwen3NextConfig
    stock = cls(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")})
    linear = [i for i, t in enumerate(stock.layer_types) if t != "full_attention"]
    if linear:
        raise CheckpointFormatError(
            f"layers {linear} are {stock.layer_types[linear[0]]!r} (Gated DeltaNet linear attention), which GatedQwen "
            "does not have; only checkpoints whose layer_types are all 'full_attention' are GatedQwen models."
        )
    factor = stock.rope_parameters.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise CheckpointFormatError(
            f"the checkpoint rotates only part of each head (partial_rotary_factor={factor}); GatedQwen applies RoPE "
            "to the whole head, so only checkpoints with partial_rotary_factor 1.0 are GatedQwen models."
        )
    rope = {k: v for k, v in stock.rope_parameters.items()
            if k not in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")}  # text: one position a token
    fields = dict({k: getattr(stock, k) for k in QWEN3_FIELDS}, rope_parameters=rope, use_qk_norm=True,
                  gate_position="sdpa", gate_granularity="elementwise", gate_bias=stock.attention_bias)
    if model_type == "qwen3_next" and moe_layers(stock.num_hidden_layers, stock.num_experts, stock.mlp_only_layers,
                                                 stock.decoder_sparse_step):
        fields.update({k: getattr(stock, k) for k in MOE_FIELDS},
                      shared_expert_intermediate_size=stock.shared_expert_intermediate_size,
                      mlp_only_layers=stock.mlp_only_layers or None)
    return fields


# ------------------------------------------------------------------------------------------------ dispatch
READERS = {
    "release": "the paper's released checkpoints (model_type 'qwen3' with headwise_attn_output_gate / "
               "elementwise_attn_output_gate / qkv_bias)",
    "qwen3": "stock Qwen3", "qwen3_moe": "stock Qwen3-MoE",
    "qwen3_5": "Qwen3.5 text or Qwen3-Next with every layer full attention",
}


# This package's model types: dense, and mixture of experts.
GATED_MODEL_TYPES = ("gated_qwen", "gated_qwen_moe")


def checkpoint_format(cfg: dict) -> str | None:
    """The format of a config.json: None for gated_qwen / gated_qwen_moe, else one of `READERS`."""
    model_type = cfg.get("model_type")
    if model_type in GATED_MODEL_TYPES:
        return None
    if model_type == "qwen3":
        official = any(str(ref).startswith(("configuration_qwen3.", "modeling_qwen3."))
                       for ref in (cfg.get("auto_map") or {}).values())
        return "release" if official or any(k in cfg for k in RELEASE_KEYS) else "qwen3"
    if model_type == "qwen3_moe":
        return "qwen3_moe"
    if model_type in ("qwen3_5_text", "qwen3_next", "qwen3_5"):
        return "qwen3_5"
    raise CheckpointFormatError(
        f"config.json has model_type={model_type!r}; GatedQwen reads gated_qwen folders, gated_qwen_moe ones and "
        f"{'; '.join(READERS.values())}. Convert other checkpoints to one of these first."
    )


def gated_config_dict(cfg: dict, gate: dict | None = None) -> dict:
    """The gated_qwen (dense) or gated_qwen_moe (mixture of experts) config.json of a folder in one of the formats,
    with its format in `_checkpoint_format`; a folder of this package is returned unchanged, except a mixture of
    experts saved before it had its own model type (`legacy_moe_config_dict`). `gate`: gate fields to add to a stock
    Qwen3 / Qwen3-MoE model (the function-preserving initialisation of `added_gate_init`); other formats have their
    gate already."""
    fmt = checkpoint_format(cfg)
    if fmt is None:
        return legacy_moe_config_dict(cfg)
    if gate and fmt not in ("qwen3", "qwen3_moe"):
        raise CheckpointFormatError(
            f"gate fields {sorted(gate)} can only be added to a stock Qwen3 or Qwen3-MoE model; this folder is "
            f"{READERS[fmt]}, whose gate is given by its checkpoint."
        )
    fields = {"release": release_config_fields, "qwen3_5": qwen3_5_config_fields}.get(fmt)
    fields = fields(cfg) if fields else {"qwen3": qwen3_config_fields, "qwen3_moe": qwen3_moe_config_fields}[fmt](
        cfg, gate)
    if gate:
        logger.warning_once(A7_NOTE)
    dtype = source_dtype(cfg)
    model_type = "gated_qwen_moe" if "num_experts" in fields else "gated_qwen"
    return dict(fields, model_type=model_type, _checkpoint_format=fmt, **({"dtype": dtype} if dtype else {}))


def legacy_moe_config_dict(cfg: dict) -> dict:
    """A gated_qwen config.json with `num_experts` > 0, as this package wrote mixtures of experts before they had
    their own model type, as the gated_qwen_moe one it is (its `auto_map`, which names the dense classes, left out:
    the config writes its own); any other config.json unchanged. Its tensors are in gated_qwen_moe's layout."""
    if cfg.get("model_type") != "gated_qwen" or not cfg.get("num_experts"):
        return cfg
    return {**{k: v for k, v in cfg.items() if k != "auto_map"}, "model_type": "gated_qwen_moe"}


# -------------------------------------------------------------------------------- load-time conversion
# The first error of the tensors being read: Transformers reports an op's error in its loading report and then
# raises a generic one, which `GatedQwenPreTrainedModel.from_pretrained` replaces by this.
LOAD_ERROR: contextvars.ContextVar[Exception | None] = contextvars.ContextVar("gated_qwen_load_error", default=None)


def _fail(error: Exception):
    if LOAD_ERROR.get() is None:
        LOAD_ERROR.set(error)
    raise error


def _only(input_dict: dict) -> torch.Tensor:
    (value,) = input_dict.values()
    return value[0] if isinstance(value, list) else value


MADV_PAGEOUT = 21  # linux/mman.h (Linux 5.4+)


def release_pages(tensor: torch.Tensor) -> None:
    """Ask the kernel to reclaim the memory pages of a tensor that has just been copied out (the packed `q_proj` of a
    release or Qwen3.5 folder, split into two new tensors). Memory-mapped from the checkpoint, its pages would stay
    resident beside the copies for as long as the file stays mapped, which is as long as the model lives (its other
    weights are views of the same mapping). MADV_PAGEOUT keeps the contents (a later read brings the pages back from
    the file, or from swap for anonymous memory), so this is safe for any tensor; elsewhere than on Linux, or on an
    older kernel, it does nothing."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or not sys.platform.startswith("linux"):
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE  # whole pages
    if last > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_PAGEOUT)


@functools.cache
def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


class KeepLayout(ConversionOps):
    """The reverse of the ops below: `save_pretrained` writes the gated_qwen layout, whatever was read."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {key: _only({key: value}) for key, value in input_dict.items()}

    @property
    def reverse_op(self) -> ConversionOps:
        return self


def _local_shape(model, name: str) -> tuple[int, ...]:
    """The shape of parameter `name` on this rank: its local shard under tensor parallelism (a DTensor)."""
    param = model.get_parameter(name)
    return tuple(param.to_local().shape if hasattr(param, "to_local") else param.shape)


class ReadCheckpointFormat(ConversionOps):
    """One tensor of a folder in `config._checkpoint_format` -> GatedQwen's tensor(s) (unchanged for gated_qwen):
    the release's and Qwen3.5's `q_proj` split into queries and gate rows, Qwen3.5's zero-centred norms shifted by
    +1, and for a gate added to a stock model the new gate tensors (made with o_proj's weight) and the projection
    scaled or shifted as `added_gate_init` says. Under tensor parallelism the tensor arrives already cut like the
    first target (rows of `q_proj`, columns of `o_proj`): whole heads, which it splits the same way."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, config=None, full_layer_name=None, model=None,
                **kwargs):
        tensor = _only(input_dict)
        fmt = getattr(config, "_checkpoint_format", None)
        source = source_patterns[0]
        if fmt is None:
            return {target_patterns[0]: tensor}
        targets = {target: full_layer_name.replace(source, target) for target in target_patterns}
        if fmt in ("release", "qwen3_5") and source.startswith("self_attn.q_proj"):
            return self._split_q_proj(config, fmt, tensor, target_patterns, full_layer_name,
                                      local=_local_shape(model, targets[target_patterns[0]])[0])
        if fmt == "qwen3_5" and source.endswith("norm.weight"):
            return {target_patterns[0]: from_zero_centred(tensor)}
        if fmt in ("qwen3", "qwen3_moe") and _layer(full_layer_name) in config.gated_layers:
            return self._add_gate(config, source, target_patterns, tensor,
                                  lambda target: _local_shape(model, targets[target]))
        return {target_patterns[0]: tensor}

    @staticmethod
    def _split_q_proj(config, fmt, tensor, targets, name, local: int) -> dict:
        """`q_proj` rows `[heads * (D + W)]` (`local` of them queries on this rank) -> queries and gate rows."""
        heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        share = local / (heads * dim)  # of the heads, on this rank (1 without tensor parallelism)
        if fmt == "qwen3_5":
            if tensor.shape[0] != 2 * local:
                _fail(qwen3_5_q_rows_error(name, round(tensor.shape[0] / share), heads, dim))
            part_of = functools.partial(split_heads, tensor, round(heads * share))
        else:
            variant = "baseline" if config.gate_position is None else config.gate_granularity
            expected = release_q_rows(heads, dim, variant)
            if tensor.shape[0] != expected * share:
                _fail(release_q_rows_error(name, round(tensor.shape[0] / share), heads, dim, variant))
            if variant == "baseline":
                return {targets[0]: tensor}
            part_of = functools.partial(split_release_q_proj, tensor, round(kv * share), heads // kv * dim)
        split = {target: part_of(part).contiguous() for part, target in enumerate(targets[:2])}
        release_pages(tensor)  # copied: the packed rows' mapped pages are no longer needed
        return split

    @staticmethod
    def _add_gate(config, source: str, targets: list[str], tensor: torch.Tensor, local_shape) -> dict:
        """A stock projection tensor of a gated layer with the added gate's changes, and with o_proj's weight the new
        gate tensors (each shaped like its parameter on this rank)."""
        c, _, factor = added_gate_init(config)
        change = added_gate_targets(config).get(source.removeprefix("self_attn."))
        out = {targets[0]: changed_for_added_gate(tensor, change, factor)}
        if source == "self_attn.o_proj.weight":
            new = dict(zip(("g_proj.weight", "g_proj.bias", "logits"), targets[1:]))
            for kind, value in added_gate_tensors(config, c).items():
                out[new[kind]] = tensor.new_full(local_shape(new[kind]), value)
        return out

    @property
    def reverse_op(self) -> ConversionOps:
        return KeepLayout()


def _reader(source: str, *new: str) -> WeightConverter:
    return WeightConverter(source, [source, *new], [ReadCheckpointFormat()])


CHECKPOINT_CONVERSIONS = [
    _reader("self_attn.q_proj.weight", "self_attn.gate.g_proj.weight"),
    _reader("self_attn.q_proj.bias", "self_attn.gate.g_proj.bias"),
    _reader("self_attn.o_proj.weight", "self_attn.gate.g_proj.weight", "self_attn.gate.g_proj.bias",
            "self_attn.gate.logits"),
    *(_reader(f"self_attn.{name}") for name in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias",
                                                 "o_proj.bias")),
    _reader("norm.weight"),  # every RMSNorm: input/post-attention, q/k and the final one
]
