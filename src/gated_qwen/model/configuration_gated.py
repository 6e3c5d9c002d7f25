"""`GatedQwenConfig` (model_type "gated_qwen"): Qwen3's config plus the gate of Qiu et al. (2025). The mixture of
experts, `GatedQwenMoeConfig` ("gated_qwen_moe"), is configuration_gated_moe.py.

Each is a strict dataclass like `Qwen3Config`: every field is checked when it is set (at construction and on assignment
later), the rules that tie fields together when the config is built and by `config.validate()` (which
`save_pretrained` runs). Errors name the field, the bad value and what is allowed.

This file is copied to the Hugging Face Hub beside `modeling_gated.py`: relative imports only.
"""

import re
from typing import Any, ClassVar, Literal

from huggingface_hub.dataclasses import strict, validated_field
from huggingface_hub.errors import StrictDataclassError
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from .gating import (
    ACTIVATIONS,
    ALIASES,
    COMBINES,
    DEFAULTS,
    FIELDS,
    GRANULARITIES,
    HEAD_SHARED_GATE_STYLE,
    POSITIONS,
    SDPA_OUTPUT_TRANSFORMS,
    canonical_position,
)
from .transformers_compat import derived_plan

# What building or changing a config raises for a bad value: a strict-dataclass error (one field, or a rule across
# fields) or a ValueError (an unknown gate field, a preset name).
CONFIG_ERRORS = (ValueError, TypeError, StrictDataclassError)

# This package's model types: dense, and mixture of experts (configuration_gated_moe.py).
GATED_MODEL_TYPES = ("gated_qwen", "gated_qwen_moe")
# The fields the mixture of experts adds (GatedQwenMoeConfig's), refused by name on the dense config.
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers", "shared_expert_intermediate_size", "router_aux_loss_coef", "router_z_loss_coef",
              "output_router_logits")


# What a saved folder's config.json names for loading with `trust_remote_code=True` where the package is absent.
AUTO_MAP = {
    "AutoConfig": "configuration_gated.GatedQwenConfig",
    "AutoModel": "modeling_gated.GatedQwenModel",
    "AutoModelForCausalLM": "modeling_gated.GatedQwenForCausalLM",
    "AutoModelForSequenceClassification": "modeling_gated.GatedQwenForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_gated.GatedQwenForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_gated.GatedQwenForQuestionAnswering",
}

def _allowed(values) -> str:
    return ", ".join(repr(v) for v in values)


# ------------------------------------------------------------------------------------------ field validators
def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive(name: str):
    def check(value) -> None:
        if value is not None and (not is_int(value) or value <= 0):
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    return check


def at_least_zero(name: str, what: str):
    def check(value) -> None:
        if not is_int(value) or value < 0:
            raise ValueError(f"`{name}` must be 0 ({what}) or a positive integer, got {value!r}.")
    return check


def non_negative_number(name: str):
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
        if value is not None and (not value or not all(is_int(i) for i in value)):
            raise ValueError(f"`{name}` must be None ({meaning}) or a non-empty list of layer indices, got {value!r}.")
    return check


# A Hub repository id, `owner/name` (huggingface_hub's rule: letters, digits, `-`, `_`, `.`; at most 96 characters).
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def _hub_kernel_repo(value) -> None:
    if value is not None and not (isinstance(value, str) and len(value) <= 96 and _REPO_ID.fullmatch(value)
                                  and ".." not in value and "--" not in value):
        raise ValueError(f"`hub_kernel_repo` must be None (no Hub kernel) or the id of a Hub kernel repository, "
                         f"'owner/name', got {value!r}.")


def _hub_kernel_revision(value) -> None:
    if value is not None and not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{40}", value)):
        raise ValueError(f"`hub_kernel_revision` must be None (no Hub kernel) or the full commit hash (40 lower-case "
                         f"hex digits) of the Hub kernel to load: a pinned revision, not a branch or tag, got "
                         f"{value!r}.")


@strict
class GatedQwenConfig(Qwen3Config):
    r"""
    Configuration of a [`GatedQwenModel`]: every field of [`Qwen3Config`] plus the gate of Qiu et al. (2025). The
    defaults describe the paper's 1.7B dense model (28 layers) with its recommended gate: a sigmoid gate on the SDPA
    output (G1), elementwise, head-specific, multiplicative, computed from the hidden state after the pre-attention
    RMSNorm (the tensor that feeds q/k/v). The variants, their paper names and their meaning are listed once, in
    `gating.py`. A mixture of experts is a [`GatedQwenMoeConfig`].

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
    hub_kernel_repo (`str` or `None`, defaults to `None`), hub_kernel_revision (`str` or `None`, defaults to `None`):
        The Hub kernel a saved folder's own code uses as its default attention on a CUDA GPU where the gated_qwen
        package is not installed and Hugging Face's `kernels` is: a kernel repository id (`"owner/name"`) and the commit to load (40 hex digits). Both or neither; `None`: no Hub kernel. The
        package, where it is imported, uses its own kernel and ignores them.

    Example:
    ```python
    >>> config = GatedQwenConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    ...                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, gate_granularity="headwise")
    >>> model = GatedQwenForCausalLM(config)
    ```
    """

    model_type = "gated_qwen"
    default_auto_map: ClassVar[dict[str, str]] = AUTO_MAP

    # Qwen3's fields whose defaults differ here (the paper's 1.7B dense model), each checked when set.
    vocab_size: int = validated_field(positive("vocab_size"), default=151936)
    hidden_size: int = validated_field(positive("hidden_size"), default=2048)
    intermediate_size: int = validated_field(positive("intermediate_size"), default=6144)
    num_hidden_layers: int = validated_field(positive("num_hidden_layers"), default=28)
    num_attention_heads: int = validated_field(positive("num_attention_heads"), default=16)
    num_key_value_heads: int | None = validated_field(positive("num_key_value_heads"), default=8)
    head_dim: int = validated_field([positive("head_dim"), _even], default=128)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    use_qk_norm: bool = True

    # The gate: each field accepts the values of the registry in gating.py (strict checks them as Literals).
    gate_position: str | None = validated_field(_gate_position, default="sdpa")
    gate_granularity: Literal[GRANULARITIES] = DEFAULTS["gate_granularity"]
    gate_shared_across_heads: bool = DEFAULTS["gate_shared_across_heads"]
    gate_combine: Literal[tuple(COMBINES)] = DEFAULTS["gate_combine"]
    gate_activation: Literal[tuple(ACTIVATIONS)] = DEFAULTS["gate_activation"]
    gate_input_dependent: bool = DEFAULTS["gate_input_dependent"]
    gate_bias: bool = DEFAULTS["gate_bias"]
    gate_layers: list[int] | None = validated_field(_layer_list("gate_layers", "every layer"), default=None)
    sdpa_output_transform: Literal[SDPA_OUTPUT_TRANSFORMS] | None = None
    # The Hub kernel of a saved folder without the package.
    hub_kernel_repo: str | None = validated_field(_hub_kernel_repo, default=None)
    hub_kernel_revision: str | None = validated_field(_hub_kernel_revision, default=None)

    base_model_pp_plan: ClassVar[dict[str, Any]] = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    def __post_init__(self, **kwargs):
        unknown = sorted(k for k in kwargs if k.startswith("gate_") or k.startswith("sdpa_output"))
        if unknown:
            raise ValueError(f"GatedQwenConfig got unknown gate field(s) {unknown}; the gate fields are {list(FIELDS)}.")
        if self.model_type == GATED_MODEL_TYPES[0]:  # a mixture-of-experts field given to the dense config
            moe = [k for k in kwargs if k in MOE_FIELDS]
            if moe:
                raise ValueError(_dense_error(f"`{moe[0]}`={kwargs[moe[0]]!r}"))
        if getattr(self, "auto_map", None) is None and "auto_map" not in kwargs:
            self.auto_map = dict(self.default_auto_map)
        super().__post_init__(**kwargs)

    def __setattr__(self, name, value):
        if name == "gate_position":
            value = canonical_position(value)  # the validator has accepted the paper's names too
        elif name == "gate_layers" and isinstance(value, (list, tuple)):
            value = sorted(value)
        elif name == "num_experts" and name not in self.__dataclass_fields__:
            raise ValueError(_dense_error(f"`num_experts`={value!r}"))
        super().__setattr__(name, value)

    # ----------------------------------------------------------------------------------------- reading
    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """config.json of a GatedQwen folder of this model type. A folder of the other GatedQwen model type (dense
        read as a mixture of experts, or the reverse) is refused, naming the classes that read it, and so is a folder
        of another model type (the gated_qwen package reads the paper's release, stock Qwen3 and Qwen3.5 folders)."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") != cls.model_type:
            raise ValueError(model_type_error(cls, config_dict, str(pretrained_model_name_or_path)))
        return config_dict, kwargs

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

    def validate_hub_kernel(self) -> None:
        """A Hub kernel is a repository and a commit of it: both or neither."""
        if (self.hub_kernel_repo is None) != (self.hub_kernel_revision is None):
            given, missing = (("hub_kernel_repo", "hub_kernel_revision") if self.hub_kernel_revision is None
                              else ("hub_kernel_revision", "hub_kernel_repo"))
            raise ValueError(
                f"`{given}`={getattr(self, given)!r} needs `{missing}` too: a Hub kernel is a repository id and the "
                f"commit of it to load (both, or neither for no Hub kernel)."
            )

    # ------------------------------------------------------------------------------------------- plans
    @derived_plan
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
                plan[f"{attn}.gate.g_proj"] = HEAD_SHARED_GATE_STYLE if shared else "colwise"
            elif shared:
                plan[f"{attn}.gate"] = "replicated_with_grad_allreduce"  # sums the gradient of its own `logits`
            else:
                plan[f"{attn}.gate.logits"] = "colwise"
                plan[f"{attn}.gate"] = "local_params"  # the gate computes with its local rows of `logits`
        plan |= {f"{mlp}.gate_proj": "colwise", f"{mlp}.up_proj": "colwise", f"{mlp}.down_proj": "rowwise"}
        return plan


def _dense_error(what: str) -> str:
    return (f"{what} asks for a mixture of experts, which GatedQwenConfig (the dense model, model_type 'gated_qwen') "
            "does not have; use GatedQwenMoeConfig (model_type 'gated_qwen_moe') and the GatedQwenMoe* models, e.g. "
            "GatedQwenMoeForCausalLM.")


def model_type_error(cls, config_dict: dict, source: str) -> str:
    """Why `cls` cannot read `config_dict`, a model of another model type, naming the classes that can."""
    if config_dict.get("model_type") not in GATED_MODEL_TYPES:
        return (f"{source} has model_type {config_dict.get('model_type')!r}; this code reads "
                f"{' and '.join(repr(t) for t in GATED_MODEL_TYPES)} folders. Folders of other formats are read by "
                "the gated_qwen package (`gated-qwen convert --help` lists them).")
    if config_dict["model_type"] == GATED_MODEL_TYPES[1]:
        what, readers = (f"a mixture of experts (num_experts={config_dict.get('num_experts')!r})",
                         "GatedQwenMoeConfig and the GatedQwenMoe* models (e.g. GatedQwenMoeForCausalLM)")
    else:
        what, readers = "a dense model", "GatedQwenConfig and the dense GatedQwen* models (e.g. GatedQwenForCausalLM)"
    kind = "the mixture of experts" if cls.model_type == GATED_MODEL_TYPES[1] else "the dense model"
    return (f"{source} holds {what}; {cls.__name__} is {kind} (model_type {cls.model_type!r}): load it with {readers}, "
            "or with the Auto classes.")


__all__ = ["GatedQwenConfig"]
