"""GatedQwen configuration: Qwen3's config plus the gate of Qiu et al. (2025) and optional mixture-of-experts.

A strict dataclass like `Qwen3Config`: every field is checked when it is set (at construction and on assignment
later), the rules that tie fields together when the config is built and by `config.validate()` (which
`save_pretrained` runs). Errors name the field, the bad value and what is allowed.

This file is copied to the Hugging Face Hub beside `modeling_gated.py`: relative imports only.
"""

from typing import Any, ClassVar, Literal

from huggingface_hub.dataclasses import strict, validated_field
from huggingface_hub.errors import StrictDataclassError
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from .checkpoint_formats import gated_config_dict
from .gating import ALIASES, DEFAULTS, FIELDS, POSITIONS, canonical_position

# What building or changing a config raises for a bad value: a strict-dataclass error (one field, or a rule across
# fields) or a ValueError (an unknown gate field, a preset name).
CONFIG_ERRORS = (ValueError, TypeError, StrictDataclassError)

# The mixture-of-experts fields (Qwen3-MoE's names; `shared_expert_intermediate_size` is Qwen3-Next's) and their
# defaults. `num_experts=0` means a dense model; the other fields must then stay at these defaults.
MOE_DEFAULTS = {
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": None,
    "shared_expert_intermediate_size": 0,
    "router_aux_loss_coef": 0.001,
    "router_z_loss_coef": 0.0,
    "output_router_logits": False,
}

# What a saved folder's config.json names for loading with `trust_remote_code=True` where the package is absent.
AUTO_MAP = {
    "AutoConfig": "configuration_gated.GatedQwenConfig",
    "AutoModel": "modeling_gated.GatedQwenModel",
    "AutoModelForCausalLM": "modeling_gated.GatedQwenForCausalLM",
    "AutoModelForSequenceClassification": "modeling_gated.GatedQwenForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_gated.GatedQwenForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_gated.GatedQwenForQuestionAnswering",
}

# The paper's models (appendix table 7). Gated dense variants shrink the FFN so the parameter count stays equal.
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


def _allowed(values) -> str:
    return ", ".join(repr(v) for v in values)


# ------------------------------------------------------------------------------------------ field validators
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(name: str):
    def check(value) -> None:
        if value is not None and (not _is_int(value) or value <= 0):
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return check


def _at_least_zero(name: str, what: str):
    def check(value) -> None:
        if not _is_int(value) or value < 0:
            raise ValueError(f"`{name}` must be 0 ({what}) or a positive integer, got {value!r}.")
    return check


def _non_negative_number(name: str):
    def check(value) -> None:
        if not value >= 0:
            raise ValueError(f"`{name}` must be a number >= 0, got {value!r}.")
    return check


def _even(value) -> None:
    if value % 2:
        raise ValueError(f"`head_dim` must be even for rotary embeddings, got {value}.")


def _gate_position(value) -> None:
    if value is not None and canonical_position(value) not in POSITIONS:
        raise ValueError(
            f"`gate_position` must be None (no gate) or one of {_allowed(POSITIONS)} (the paper's "
            f"{', '.join(ALIASES)}), got {value!r}."
        )


def _layer_list(name: str, meaning: str):
    def check(value) -> None:
        if value is not None and (not value or not all(_is_int(i) for i in value)):
            raise ValueError(f"`{name}` must be None ({meaning}) or a non-empty list of layer indices, got {value!r}.")
    return check


@strict
class GatedQwenConfig(Qwen3Config):
    r"""
    Configuration of a [`GatedQwenModel`]: every field of [`Qwen3Config`] plus the gate of Qiu et al. (2025) and an
    optional mixture of experts. The defaults describe the paper's 1.7B dense model (28 layers) with its recommended
    gate: a sigmoid gate on the SDPA output (G1), elementwise, head-specific, multiplicative, computed from the
    hidden state after the pre-attention RMSNorm (the tensor that feeds q/k/v). The variants, their paper names and
    their meaning are listed once, in `gating.py`.

    use_qk_norm (`bool`, defaults to `True`):
        Per-head RMSNorm on queries and keys (Qwen3's QK-norm). The paper's released checkpoints name it the same.
    gate_position (`str` or `None`, defaults to `"sdpa"`):
        Where the gate acts: `"sdpa"` (G1) on the attention output of each head, before `o_proj`; `"value"` (G2),
        `"key"` (G3), `"query"` (G4) on the output of `v_proj` / `k_proj` / `q_proj`; `"dense"` (G5) on `o_proj`'s
        output. `None`: no gate (the paper's baseline, exactly Qwen3). `"G1"` ... `"G5"` are stored as these names.
    gate_granularity (`str`, defaults to `"elementwise"`):
        `"elementwise"`: one score per element of each head; `"headwise"`: one scalar score per head.
    gate_shared_across_heads (`bool`, defaults to `False`):
        One set of scores for all heads (the paper's head-shared variants), stored as one `head_dim`-wide
        projection (the paper's averaging over heads is the same function).
    gate_combine (`str`, defaults to `"multiply"`):
        `"multiply"`: `Y * act(X W)`; `"add"`: `Y + act(X W)`.
    gate_activation (`str`, defaults to `"sigmoid"`):
        `"sigmoid"`, `"silu"`, `"ns_sigmoid"` (non-sparse `0.5 + 0.5 * sigmoid`, range [0.5, 1]) or `"identity"`.
    gate_input_dependent (`bool`, defaults to `True`):
        `False` replaces `X W` by a learned, zero-initialised logit per score (the paper's input-independent control).
    gate_bias (`bool`, defaults to `False`):
        Bias in the gate projection (the paper uses none).
    gate_layers (`list[int]` or `None`, defaults to `None`):
        Indices of the layers that carry the gate; `None` means all layers.
    sdpa_output_transform (`str` or `None`, defaults to `None`):
        The paper's two non-gate controls on the SDPA output (table 3), only without a gate: `"rmsnorm"` (a per-head
        RMSNorm with a learned `head_dim` weight) or `"silu"` (a parameter-free SiLU).

    Mixture of experts (Qwen3-MoE's fields and weight layout; `num_experts=0`, the default, is a dense model):
    num_experts (`int`, defaults to 0):
        Routed experts per sparse layer; 0 means every layer has the dense `intermediate_size` MLP.
    num_experts_per_tok (`int`, defaults to 8):
        Experts each token is routed to (top-k of a softmax over the router logits).
    moe_intermediate_size (`int`, defaults to 768):
        Width of each routed expert.
    norm_topk_prob (`bool`, defaults to `False`):
        Renormalise the top-k probabilities to sum to 1.
    decoder_sparse_step (`int`, defaults to 1), mlp_only_layers (`list[int]` or `None`, defaults to `None`):
        Layer `i` is sparse when `(i + 1) % decoder_sparse_step == 0` and `i` is not in `mlp_only_layers`; other
        layers keep the dense `intermediate_size` MLP (as in Qwen3-MoE).
    shared_expert_intermediate_size (`int`, defaults to 0):
        Width of an always-active shared expert scaled by `sigmoid(shared_expert_gate(x))` (Qwen3-Next); 0: none.
    router_aux_loss_coef (`float`, defaults to 0.001), router_z_loss_coef (`float`, defaults to 0.0):
        Weights of the load-balancing loss (Switch/Qwen3-MoE) and of the router z-loss (ST-MoE) in the LM loss.
    output_router_logits (`bool`, defaults to `False`):
        Return the router logits of every sparse layer; the auxiliary losses are computed only when set (as in
        Qwen3-MoE), so set it for training.

    Example:
    ```python
    >>> from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
    >>> config = GatedQwenConfig.from_paper("dense-1.7b-28l", gate_granularity="headwise")
    >>> model = GatedQwenForCausalLM(config)
    ```
    """

    model_type = "gated_qwen"

    # Qwen3's fields whose defaults differ here (the paper's 1.7B dense model), each checked when set.
    vocab_size: int = validated_field(_positive("vocab_size"), default=151936)
    hidden_size: int = validated_field(_positive("hidden_size"), default=2048)
    intermediate_size: int = validated_field(_positive("intermediate_size"), default=6144)
    num_hidden_layers: int = validated_field(_positive("num_hidden_layers"), default=28)
    num_attention_heads: int = validated_field(_positive("num_attention_heads"), default=16)
    num_key_value_heads: int | None = validated_field(_positive("num_key_value_heads"), default=8)
    head_dim: int = validated_field([_positive("head_dim"), _even], default=128)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    use_qk_norm: bool = True

    gate_position: str | None = validated_field(_gate_position, default="sdpa")
    gate_granularity: Literal["elementwise", "headwise"] = DEFAULTS["gate_granularity"]
    gate_shared_across_heads: bool = DEFAULTS["gate_shared_across_heads"]
    gate_combine: Literal["multiply", "add"] = DEFAULTS["gate_combine"]
    gate_activation: Literal["sigmoid", "silu", "ns_sigmoid", "identity"] = DEFAULTS["gate_activation"]
    gate_input_dependent: bool = DEFAULTS["gate_input_dependent"]
    gate_bias: bool = DEFAULTS["gate_bias"]
    gate_layers: list[int] | None = validated_field(_layer_list("gate_layers", "every layer"), default=None)
    sdpa_output_transform: Literal["rmsnorm", "silu"] | None = None

    num_experts: int = validated_field(_at_least_zero("num_experts", "a dense model"), default=0)
    num_experts_per_tok: int = validated_field(_positive("num_experts_per_tok"), default=8)
    moe_intermediate_size: int = validated_field(_positive("moe_intermediate_size"), default=768)
    norm_topk_prob: bool = False
    decoder_sparse_step: int = validated_field(_positive("decoder_sparse_step"), default=1)
    mlp_only_layers: list[int] | None = None
    shared_expert_intermediate_size: int = validated_field(
        _at_least_zero("shared_expert_intermediate_size", "no shared expert"), default=0)
    router_aux_loss_coef: float | int = validated_field(_non_negative_number("router_aux_loss_coef"), default=0.001)
    router_z_loss_coef: float | int = validated_field(_non_negative_number("router_z_loss_coef"), default=0.0)
    output_router_logits: bool = False

    base_model_pp_plan: ClassVar[dict[str, Any]] = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    def __post_init__(self, **kwargs):
        unknown = sorted(k for k in kwargs if k.startswith("gate_") or k.startswith("sdpa_output"))
        if unknown:
            raise ValueError(f"GatedQwenConfig got unknown gate field(s) {unknown}; the gate fields are {list(FIELDS)}.")
        if self.mlp_only_layers is not None and len(self.mlp_only_layers) == 0:
            self.mlp_only_layers = None  # Qwen3-MoE writes [] for "none"
        if getattr(self, "auto_map", None) is None and "auto_map" not in kwargs:
            self.auto_map = dict(AUTO_MAP)
        super().__post_init__(**kwargs)

    def __setattr__(self, name, value):
        if name == "gate_position":
            value = canonical_position(value)  # the validator has accepted the paper's names too
        elif name in ("gate_layers", "mlp_only_layers") and isinstance(value, (list, tuple)):
            value = sorted(value)
        super().__setattr__(name, value)

    # ------------------------------------------------------------------------------- reading other formats
    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """config.json of a gated_qwen folder, or of one in a format `checkpoint_formats.py` reads (the paper's
        release, stock Qwen3 / Qwen3-MoE, Qwen3.5 text / Qwen3-Next with every layer full attention) turned into
        GatedQwen's fields. Gate fields among `kwargs` add a gate to a stock Qwen3 / Qwen3-MoE model."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") != cls.model_type:
            gate = {name: kwargs.pop(name) for name in FIELDS if name in kwargs}
            config_dict = gated_config_dict(config_dict, gate)
        return config_dict, kwargs

    def to_dict(self) -> dict[str, Any]:
        # The format a folder was read from only tells `from_pretrained` how to read its tensors; what is saved is
        # always gated_qwen.
        output = super().to_dict()
        output.pop("_checkpoint_format", None)
        return output

    # ------------------------------------------------------------------ rules across fields (`validate()`)
    def validate_architecture(self) -> None:
        """Grouped-query attention needs `num_key_value_heads` to divide `num_attention_heads`."""
        super().validate_architecture()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must divide `num_attention_heads` "
                f"({self.num_attention_heads}) for grouped-query attention."
            )

    def validate_gate(self) -> None:
        """The gate fields together: settings without effect and combinations the paper does not define."""
        position = self.gate_position
        if self.gate_layers is not None:
            layers = list(self.gate_layers)
            if any(not 0 <= i < self.num_hidden_layers for i in layers) or len(set(layers)) != len(layers):
                raise ValueError(
                    f"`gate_layers` must hold distinct indices in [0, {self.num_hidden_layers}) "
                    f"(`num_hidden_layers`={self.num_hidden_layers}), got {layers!r}."
                )
        if position is None:
            changed = [k for k, v in DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(
                    f"{', '.join(f'`{k}`={getattr(self, k)!r}' for k in changed)} has no effect with "
                    "`gate_position=None` (no gate); set `gate_position` (e.g. 'sdpa', the paper's G1) or leave "
                    "these at their defaults."
                )
            return
        if self.sdpa_output_transform is not None:
            raise ValueError(
                f"`sdpa_output_transform`={self.sdpa_output_transform!r} is one of the paper's non-gate controls and "
                f"is only defined without a gate; got it with `gate_position`={position!r}. Set one of the two to None."
            )
        if POSITIONS[position].heads is None:
            for name, bad in (("gate_granularity", "headwise"), ("gate_shared_across_heads", True)):
                if getattr(self, name) == bad:
                    raise ValueError(
                        f"`{name}`={bad!r} is not defined for `gate_position`={position!r} ({POSITIONS[position].paper})"
                        f": the output of o_proj has no heads. Leave `{name}` at {DEFAULTS[name]!r} with "
                        f"{position!r}, or use a head-level position such as 'sdpa'."
                    )
        if not self.gate_input_dependent and self.gate_bias:
            raise ValueError(
                "`gate_bias`=True is redundant with `gate_input_dependent`=False: the input-independent gate is "
                "already a learned constant logit. Set `gate_bias` to False."
            )

    def validate_moe(self) -> None:
        """The mixture-of-experts fields together."""
        if self.num_experts == 0:
            changed = [k for k, v in MOE_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(
                    f"{', '.join(f'`{k}`={getattr(self, k)!r}' for k in changed)} has no effect with `num_experts`=0 "
                    "(a dense model); set `num_experts` (e.g. 128, the paper's MoE) or leave these at their defaults."
                )
            return
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"`num_experts_per_tok` ({self.num_experts_per_tok}) must be at most `num_experts` "
                f"({self.num_experts})."
            )
        if self.mlp_only_layers is not None:
            layers = list(self.mlp_only_layers)
            if any(not 0 <= i < self.num_hidden_layers for i in layers) or len(set(layers)) != len(layers):
                raise ValueError(
                    f"`mlp_only_layers` must hold distinct indices in [0, {self.num_hidden_layers}) "
                    f"(`num_hidden_layers`={self.num_hidden_layers}), got {layers!r}."
                )
        if not self.sparse_layers:
            raise ValueError(
                f"`num_experts`={self.num_experts} but no layer is sparse: `decoder_sparse_step`="
                f"{self.decoder_sparse_step} and `mlp_only_layers`={self.mlp_only_layers!r} leave every one of the "
                f"{self.num_hidden_layers} layers dense. Set `num_experts`=0 for a dense model."
            )

    # ------------------------------------------------------------------------------------ derived sizes
    @property
    def gated_layers(self) -> list[int]:
        """Indices of the layers that carry a gate (empty without a gate)."""
        if self.gate_position is None:
            return []
        return list(range(self.num_hidden_layers)) if self.gate_layers is None else list(self.gate_layers)

    @property
    def sparse_layers(self) -> list[int]:
        """Indices of the mixture-of-experts layers (Qwen3-MoE's rule; empty for a dense model)."""
        if self.num_experts == 0:
            return []
        dense = set(self.mlp_only_layers or [])
        return [i for i in range(self.num_hidden_layers) if i not in dense and (i + 1) % self.decoder_sparse_step == 0]

    @property
    def gate_shape(self) -> tuple[int, int] | None:
        """`(heads, width)` of one token's gate scores in a gated layer, or None without a gate: G1/G4 act on the
        query heads, G2/G3 on the key/value heads, G5 on the hidden state (one "head"); head-shared gates have one
        head, headwise gates width 1."""
        if self.gate_position is None:
            return None
        heads = POSITIONS[self.gate_position].heads
        if heads is None:
            return 1, self.hidden_size
        heads = 1 if self.gate_shared_across_heads else (
            self.num_attention_heads if heads == "query" else self.num_key_value_heads)
        return heads, self.head_dim if self.gate_granularity == "elementwise" else 1

    def gate_parameters_per_layer(self) -> int:
        """Parameters one gated layer adds: `hidden * heads * width` (+ bias) for an input-dependent gate."""
        if self.gate_shape is None:
            return 0
        scores = self.gate_shape[0] * self.gate_shape[1]
        if not self.gate_input_dependent:
            return scores
        return self.hidden_size * scores + (scores if self.gate_bias else 0)

    # ------------------------------------------------------------------------------------------- plans
    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """The tensor-parallel plan (`tp_plan="auto"`): Qwen3's rules for the parameters this config has, and the
        gate's. TP splits the heads across ranks; a per-head gate (G1-G4, head-specific: its rows are laid out per
        head) is split with them. A head-shared gate is whole on every rank but each rank's heads give only part of
        its gradient, which is summed across ranks ("head_shared_gate", see gating.py; `replicated_with_grad_allreduce`
        for learned logits, and for the per-head `sdpa_norm` control). A G5 gate acts on `o_proj`'s all-reduced
        output: whole on every rank, nothing to sum."""
        attn, mlp = "layers.*.self_attn", "layers.*.mlp"
        plan = {f"{attn}.q_proj": "colwise", f"{attn}.k_proj": "colwise", f"{attn}.v_proj": "colwise",
                f"{attn}.o_proj": "rowwise"}
        if self.use_qk_norm:
            plan |= {f"{attn}.q_norm": "replicated_with_grad_allreduce",
                     f"{attn}.k_norm": "replicated_with_grad_allreduce"}
        if self.sdpa_output_transform == "rmsnorm":
            plan[f"{attn}.gate.sdpa_norm"] = "replicated_with_grad_allreduce"
        if self.gate_position is not None and POSITIONS[self.gate_position].heads is not None:
            shared = self.gate_shared_across_heads
            if self.gate_input_dependent:
                plan[f"{attn}.gate.g_proj"] = "head_shared_gate" if shared else "colwise"
            elif shared:
                plan[f"{attn}.gate"] = "replicated_with_grad_allreduce"  # sums the gradient of its own `logits`
            else:
                plan[f"{attn}.gate.logits"] = "colwise"
                plan[f"{attn}.gate"] = "local_params"  # the gate computes with its local rows of `logits`
        if len(self.sparse_layers) < self.num_hidden_layers:  # some layers keep the dense MLP
            plan |= {f"{mlp}.gate_proj": "colwise", f"{mlp}.up_proj": "colwise", f"{mlp}.down_proj": "rowwise"}
        if self.num_experts:  # Qwen3-MoE's experts (the router is replicated)
            plan |= {f"{mlp}.experts.gate_up_proj": "packed_colwise", f"{mlp}.experts.down_proj": "rowwise",
                     f"{mlp}.experts": "moe_tp_experts"}
        if self.shared_expert_intermediate_size:  # Qwen3-Next's shared expert
            plan |= {f"{mlp}.shared_expert.gate_proj": "colwise", f"{mlp}.shared_expert.up_proj": "colwise",
                     f"{mlp}.shared_expert.down_proj": "rowwise"}
        return plan

    @property
    def base_model_ep_plan(self) -> dict[str, str] | None:
        """Expert parallelism (`distributed_config` with experts): Qwen3-MoE's plan; None for a dense model."""
        if not self.num_experts:
            return None
        return {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm", "layers.*.mlp.experts.down_proj": "grouped_gemm",
                "layers.*.mlp.experts": "ep_dispatch_experts"}

    # ----------------------------------------------------------------------------------------- presets
    @classmethod
    def from_paper(cls, name: str, **overrides) -> "GatedQwenConfig":
        """The paper's models by name: `"dense-1.7b-28l"`, `"dense-1.7b-48l"` or `"moe-15a2b"` (appendix table 7).

        `overrides` set any field (gate fields included). Gated dense variants shrink `intermediate_size` so the
        total parameter count stays that of the baseline, as the paper does, unless `intermediate_size` is given.
        Gated MoE variants keep the experts and add the gate on top (table 1: +201M for G1 elementwise).
        """
        if name not in PAPER_PRESETS:
            raise ValueError(f"Unknown paper preset {name!r}; choose one of {_allowed(PAPER_PRESETS)}.")
        config = cls(**{**PAPER_PRESETS[name], **overrides})
        if "intermediate_size" not in overrides and config.gate_position is not None and config.num_experts == 0:
            added = config.gate_parameters_per_layer() * len(config.gated_layers)
            per_unit = 3 * config.hidden_size * config.num_hidden_layers  # gate, up and down rows of every MLP
            config.intermediate_size -= round(added / per_unit)
        return config


__all__ = ["GatedQwenConfig"]
