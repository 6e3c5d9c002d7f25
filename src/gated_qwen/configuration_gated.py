"""GatedQwen configuration: a Qwen3 decoder in which every gate variant of Qiu et al. (2025) is a config value.

This file is copied to the Hugging Face Hub beside `modeling_gated.py`: relative imports only.
"""

from __future__ import annotations

from typing import Any, ClassVar

from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

GATE_POSITIONS = ("sdpa", "value", "key", "query", "dense")
# The paper's names for the positions (section 2 / table 1): G1 ... G5.
GATE_POSITION_ALIASES = {"G1": "sdpa", "G2": "value", "G3": "key", "G4": "query", "G5": "dense"}
GATE_GRANULARITIES = ("elementwise", "headwise")
GATE_COMBINES = ("multiply", "add")
GATE_ACTIVATIONS = ("sigmoid", "silu", "ns_sigmoid", "identity")
SDPA_OUTPUT_TRANSFORMS = ("rmsnorm", "silu")

# The gate fields and their defaults (the paper's recommendation); used to refuse settings that have no effect.
GATE_DEFAULTS = {
    "gate_granularity": "elementwise",
    "gate_shared_across_heads": False,
    "gate_combine": "multiply",
    "gate_activation": "sigmoid",
    "gate_input_dependent": True,
    "gate_bias": False,
    "gate_layers": None,
}

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
}

# The paper's dense models (appendix table 7). Gated variants shrink the FFN so the parameter count stays equal.
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
    # The 15B-A2B MoE of tables 1, 3 and 4 (appendix table 7). Gated variants add the gate on top (table 1's +M).
    # `norm_topk_prob` and the z-loss coefficient are not in the paper: Qwen3's released MoE models normalise the
    # top-k probabilities, and 1e-3 is ST-MoE's z-loss coefficient.
    "moe-15a2b": dict(
        hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        tie_word_embeddings=False, use_qk_norm=True, max_position_embeddings=4096,
        output_router_logits=True, router_aux_loss_coef=0.001, router_z_loss_coef=0.001,
    ),
}


def _allowed(values) -> str:
    return ", ".join(repr(v) for v in values)


class GatedQwenConfig(PreTrainedConfig):
    r"""
    Configuration of a [`GatedQwenModel`]: every field of [`Qwen3Config`] plus the gate of Qiu et al. (2025).
    The defaults describe the paper's 1.7B dense model (28 layers) with its recommended gate: a sigmoid gate on
    the SDPA output (G1), elementwise, head-specific, multiplicative, computed from the hidden state after the
    pre-attention RMSNorm (the tensor that feeds q/k/v).

    Qwen3 fields (same meaning as in `Qwen3Config`): `vocab_size`, `hidden_size`, `intermediate_size`,
    `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads` (GQA), `head_dim`, `hidden_act`,
    `max_position_embeddings`, `initializer_range`, `rms_norm_eps`, `use_cache`, `tie_word_embeddings`,
    `rope_parameters` (incl. YaRN: `{"rope_type": "yarn", "factor": 4.0, "rope_theta": ...,
    "original_max_position_embeddings": ...}`), `attention_bias`, `use_sliding_window`, `sliding_window`,
    `max_window_layers`, `layer_types`, `attention_dropout`, token ids.

    use_qk_norm (`bool`, defaults to `True`):
        Per-head RMSNorm on queries and keys (Qwen3's QK-norm). The paper's released checkpoints name it the same.
    gate_position (`str` or `None`, defaults to `"sdpa"`):
        Where the gate acts. `"sdpa"` (G1): on the attention output of each head, before `o_proj`;
        `"value"` (G2): on `v_proj`'s output; `"key"` (G3): on `k_proj`'s output; `"query"` (G4): on `q_proj`'s
        output; `"dense"` (G5): on `o_proj`'s output. `None`: no gate (the paper's baseline, exactly Qwen3).
        The paper's names `"G1"` ... `"G5"` are accepted and stored as the names above.
    gate_granularity (`str`, defaults to `"elementwise"`):
        `"elementwise"`: one score per element of each head; `"headwise"`: one scalar score per head.
    gate_shared_across_heads (`bool`, defaults to `False`):
        One set of scores shared by all heads (the paper's head-shared variants) instead of head-specific scores.
        Stored as a single `head_dim`-wide projection (the paper's averaging over heads is the same function).
    gate_combine (`str`, defaults to `"multiply"`):
        `"multiply"`: `Y * act(X W)`; `"add"`: `Y + act(X W)`.
    gate_activation (`str`, defaults to `"sigmoid"`):
        `"sigmoid"`, `"silu"`, `"ns_sigmoid"` (non-sparse `0.5 + 0.5 * sigmoid`, range [0.5, 1]) or `"identity"`.
    gate_input_dependent (`bool`, defaults to `True`):
        `False` replaces `X W` by a learned, zero-initialised logit per score that does not depend on the input
        (the paper's input-independent control), stored as `self_attn.gate_logits`.
    gate_bias (`bool`, defaults to `False`):
        Bias in the gate projection `self_attn.g_proj` (the paper uses none).
    gate_layers (`list[int]` or `None`, defaults to `None`):
        Indices of the layers that carry the gate; `None` means all layers.
    sdpa_output_transform (`str` or `None`, defaults to `None`):
        The paper's two non-gate controls on the SDPA output (table 3), only without a gate: `"rmsnorm"` (a
        per-head RMSNorm with a learned `head_dim` weight) or `"silu"` (a parameter-free SiLU).

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
        Weights of the load-balancing loss (Switch/Qwen3-MoE, over all tokens of the batch) and of the router
        z-loss (ST-MoE: mean squared logsumexp of the router logits) added to the LM loss.
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
    keys_to_ignore_at_inference = ["past_key_values"]

    base_model_tp_plan: ClassVar[dict[str, str]] = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.g_proj": "colwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        # Sparse layers: Qwen3-MoE's experts and Qwen3-Next's shared expert (the router is replicated).
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.shared_expert.gate_proj": "colwise",
        "layers.*.mlp.shared_expert.up_proj": "colwise",
        "layers.*.mlp.shared_expert.down_proj": "rowwise",
    }
    base_model_ep_plan: ClassVar[dict[str, str]] = {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }
    base_model_pp_plan: ClassVar[dict[str, Any]] = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = True
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list[str] | None = None
    attention_dropout: float | int = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    use_qk_norm: bool = True

    gate_position: str | None = "sdpa"
    gate_granularity: str = "elementwise"
    gate_shared_across_heads: bool = False
    gate_combine: str = "multiply"
    gate_activation: str = "sigmoid"
    gate_input_dependent: bool = True
    gate_bias: bool = False
    gate_layers: list[int] | None = None
    sdpa_output_transform: str | None = None

    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    output_router_logits: bool = False

    def __post_init__(self, **kwargs):
        unknown = sorted(k for k in kwargs if k.startswith("gate_") or k.startswith("sdpa_output"))
        if unknown:
            raise ValueError(
                f"GatedQwenConfig got unknown gate field(s) {unknown}; the gate fields are "
                f"{['gate_position', *GATE_DEFAULTS, 'sdpa_output_transform']}."
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.sliding_window = self.sliding_window if self.use_sliding_window else None
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention"
                if self.sliding_window is not None and i >= self.max_window_layers
                else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        self._validate_gate()
        self.base_model_tp_plan = self._tp_plan_with_gate()
        self._validate_moe()
        if getattr(self, "auto_map", None) is None and "auto_map" not in kwargs:
            self.auto_map = dict(AUTO_MAP)
        super().__post_init__(**kwargs)

    # ----------------------------------------------------------------------------------------------- validation
    def _validate_gate(self) -> None:
        """Validates every field once, naming the field, the bad value and what is allowed."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must divide `num_attention_heads` "
                f"({self.num_attention_heads}) for grouped-query attention."
            )
        if self.head_dim % 2:
            raise ValueError(f"`head_dim` must be even for rotary embeddings, got {self.head_dim}.")
        for name in ("use_qk_norm", "gate_shared_across_heads", "gate_input_dependent", "gate_bias",
                     "attention_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")

        position = self.gate_position
        if isinstance(position, str) and position.upper() in GATE_POSITION_ALIASES:
            position = self.gate_position = GATE_POSITION_ALIASES[position.upper()]
        if position is not None and position not in GATE_POSITIONS:
            raise ValueError(
                f"`gate_position` must be None (no gate) or one of {_allowed(GATE_POSITIONS)} "
                f"(the paper's G1...G5), got {position!r}."
            )
        for name, allowed in (("gate_granularity", GATE_GRANULARITIES), ("gate_combine", GATE_COMBINES),
                              ("gate_activation", GATE_ACTIVATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` must be one of {_allowed(allowed)}, got {getattr(self, name)!r}.")
        if self.sdpa_output_transform is not None and self.sdpa_output_transform not in SDPA_OUTPUT_TRANSFORMS:
            raise ValueError(
                f"`sdpa_output_transform` must be None or one of {_allowed(SDPA_OUTPUT_TRANSFORMS)}, "
                f"got {self.sdpa_output_transform!r}."
            )
        if self.gate_layers is not None:
            layers = self.gate_layers
            if (not isinstance(layers, (list, tuple)) or not layers
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
                raise ValueError(
                    f"`gate_layers` must be None (every layer) or a non-empty list of layer indices, got {layers!r}."
                )
            bad = [i for i in layers if not 0 <= i < self.num_hidden_layers]
            if bad or len(set(layers)) != len(layers):
                raise ValueError(
                    f"`gate_layers` must hold distinct indices in [0, {self.num_hidden_layers}) "
                    f"(`num_hidden_layers`={self.num_hidden_layers}), got {list(layers)!r}."
                )
            self.gate_layers = sorted(layers)

        if position is None:
            changed = [k for k, v in GATE_DEFAULTS.items() if getattr(self, k) != v]
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
        if position == "dense" and self.gate_granularity == "headwise":
            raise ValueError(
                "`gate_granularity`='headwise' is not defined for `gate_position`='dense' (G5): the output of "
                "o_proj has no heads. Use 'elementwise' with 'dense', or a head-level position such as 'sdpa'."
            )
        if position == "dense" and self.gate_shared_across_heads:
            raise ValueError(
                "`gate_shared_across_heads`=True is not defined for `gate_position`='dense' (G5): the output of "
                "o_proj has no heads. Set it to False, or use a head-level position such as 'sdpa'."
            )
        if not self.gate_input_dependent and self.gate_bias:
            raise ValueError(
                "`gate_bias`=True is redundant with `gate_input_dependent`=False: the input-independent gate is "
                "already a learned constant logit. Set `gate_bias` to False."
            )

    def _validate_moe(self) -> None:
        """Validates the mixture-of-experts fields, naming the field, the bad value and what is allowed."""
        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not is_int(self.num_experts) or self.num_experts < 0:
            raise ValueError(
                f"`num_experts` must be 0 (a dense model) or a positive integer, got {self.num_experts!r}."
            )
        if self.mlp_only_layers is not None and not isinstance(self.mlp_only_layers, (list, tuple)):
            raise ValueError(
                f"`mlp_only_layers` must be None or a list of layer indices, got {self.mlp_only_layers!r}."
            )
        if self.mlp_only_layers is not None and len(self.mlp_only_layers) == 0:
            self.mlp_only_layers = None  # Qwen3-MoE writes [] for "none"
        if self.num_experts == 0:
            changed = [k for k, v in MOE_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(
                    f"{', '.join(f'`{k}`={getattr(self, k)!r}' for k in changed)} has no effect with `num_experts`=0 "
                    "(a dense model); set `num_experts` (e.g. 128, the paper's MoE) or leave these at their defaults."
                )
            return
        for name in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"`num_experts_per_tok` ({self.num_experts_per_tok}) must be at most `num_experts` "
                f"({self.num_experts})."
            )
        if not is_int(self.shared_expert_intermediate_size) or self.shared_expert_intermediate_size < 0:
            raise ValueError(
                "`shared_expert_intermediate_size` must be 0 (no shared expert) or a positive integer, got "
                f"{self.shared_expert_intermediate_size!r}."
            )
        for name in ("norm_topk_prob", "output_router_logits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"`{name}` must be a number >= 0, got {value!r}.")
        if self.mlp_only_layers is not None:
            layers = list(self.mlp_only_layers)
            bad = [i for i in layers if not is_int(i) or not 0 <= i < self.num_hidden_layers]
            if bad or len(set(layers)) != len(layers):
                raise ValueError(
                    f"`mlp_only_layers` must hold distinct indices in [0, {self.num_hidden_layers}) "
                    f"(`num_hidden_layers`={self.num_hidden_layers}), got {layers!r}."
                )
            self.mlp_only_layers = sorted(layers)
        if not self.sparse_layers:
            raise ValueError(
                f"`num_experts`={self.num_experts} but no layer is sparse: `decoder_sparse_step`="
                f"{self.decoder_sparse_step} and `mlp_only_layers`={self.mlp_only_layers!r} leave every one of the "
                f"{self.num_hidden_layers} layers dense. Set `num_experts`=0 for a dense model."
            )

    # ------------------------------------------------------------------------------------------- derived sizes
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
        """`(heads, width)` of one token's gate scores in a gated layer, or None without a gate.

        G1/G4 act on the query heads, G2/G3 on the key/value heads, G5 on the hidden state; head-shared gates
        have one head, headwise gates width 1.
        """
        if self.gate_position is None:
            return None
        if self.gate_position == "dense":
            return 1, self.hidden_size
        heads = self.num_attention_heads if self.gate_position in ("sdpa", "query") else self.num_key_value_heads
        heads = 1 if self.gate_shared_across_heads else heads
        width = self.head_dim if self.gate_granularity == "elementwise" else 1
        return heads, width

    def _tp_plan_with_gate(self) -> dict[str, str]:
        """The tensor-parallel plan (`tp_plan="auto"`) with the rules this gate variant needs.

        TP splits the attention heads across ranks. A per-head gate (G1-G4, head-specific) is split with them: its
        rows are laid out per head, so a colwise shard of `g_proj` (or a row shard of `gate_logits`) holds exactly
        the local heads' gates. A head-shared gate is whole on every rank but each rank's heads give only part of
        its gradient, which is therefore summed across ranks (as for `q_norm`, and for the per-head `sdpa_norm`
        control). A G5 gate acts on `o_proj`'s all-reduced output: whole on every rank, nothing to sum.
        """
        attn = "layers.*.self_attn"
        gate_rules = (f"{attn}.g_proj", f"{attn}.gate_logits", attn)
        plan = {k: v for k, v in self.base_model_tp_plan.items() if k not in gate_rules}
        if self.sdpa_output_transform == "rmsnorm":
            plan[f"{attn}.sdpa_norm"] = "replicated_with_grad_allreduce"
        if self.gate_position is None or self.gate_position == "dense":
            return plan
        if self.gate_input_dependent:
            # "head_shared_gate" (registered in modeling_gated.py) sums the gradient of the scores across ranks.
            plan[f"{attn}.g_proj"] = "head_shared_gate" if self.gate_shared_across_heads else "colwise"
        elif self.gate_shared_across_heads:
            plan[attn] = "replicated_with_grad_allreduce"  # sums the gradient of the module's own `gate_logits`
        else:
            plan[f"{attn}.gate_logits"] = "colwise"
            plan[attn] = "local_params"  # the module computes with its local rows of `gate_logits`
        return plan

    def gate_parameters_per_layer(self) -> int:
        """Parameters one gated layer adds: `hidden * heads * width` (+ bias) for an input-dependent gate."""
        if self.gate_shape is None:
            return 0
        scores = self.gate_shape[0] * self.gate_shape[1]
        if not self.gate_input_dependent:
            return scores
        return self.hidden_size * scores + (scores if self.gate_bias else 0)

    # ------------------------------------------------------------------------------------------------- presets
    @classmethod
    def from_paper(cls, name: str, **overrides) -> GatedQwenConfig:
        """The paper's models by name: `"dense-1.7b-28l"`, `"dense-1.7b-48l"` or `"moe-15a2b"` (appendix table 7).

        `overrides` set any field (gate fields included). Gated dense variants shrink `intermediate_size` so the
        total parameter count stays that of the baseline, as the paper does, unless `intermediate_size` is given.
        Gated MoE variants keep the experts and add the gate on top (table 1: +201M for G1 elementwise).
        """
        if name not in PAPER_PRESETS:
            raise ValueError(f"Unknown paper preset {name!r}; choose one of {_allowed(PAPER_PRESETS)}.")
        fields = {**PAPER_PRESETS[name], **overrides}
        config = cls(**fields)
        if "intermediate_size" not in overrides and config.gate_position is not None and config.num_experts == 0:
            added = config.gate_parameters_per_layer() * len(config.gated_layers)
            per_unit = 3 * config.hidden_size * config.num_hidden_layers  # gate, up and down rows of every MLP
            config.intermediate_size -= round(added / per_unit)
        return config


__all__ = ["GatedQwenConfig"]
