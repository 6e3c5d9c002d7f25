"""`GatedQwenMoeConfig` (model_type "gated_qwen_moe"): a `GatedQwenConfig` (the gate, its defaults, the attention)
with Qwen3-MoE's mixture of experts. Dense and mixture-of-experts models are separate model types, as Qwen3 and
Qwen3-MoE are.

This file is copied to the Hugging Face Hub beside `modeling_gated_moe.py`: relative imports only.
"""

from typing import ClassVar

from huggingface_hub.dataclasses import strict, validated_field

from .configuration_gated import GatedQwenConfig, at_least_zero, is_int, non_negative_number, positive
from .transformers_compat import derived_plan

# What a saved folder's config.json names for loading with `trust_remote_code=True` where the package is absent.
MOE_AUTO_MAP = {
    "AutoConfig": "configuration_gated_moe.GatedQwenMoeConfig",
    "AutoModel": "modeling_gated_moe.GatedQwenMoeModel",
    "AutoModelForCausalLM": "modeling_gated_moe.GatedQwenMoeForCausalLM",
    "AutoModelForSequenceClassification": "modeling_gated_moe.GatedQwenMoeForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_gated_moe.GatedQwenMoeForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_gated_moe.GatedQwenMoeForQuestionAnswering",
}


def sparse_layer_indices(num_hidden_layers: int, decoder_sparse_step: int, mlp_only_layers: list[int] | None,
                         num_experts: int = 1) -> list[int]:
    """Qwen3-MoE's rule: layer `i` is a mixture of experts when `(i + 1) % decoder_sparse_step == 0` and `i` is not in
    `mlp_only_layers`; no layer is without experts (`num_experts=0`)."""
    dense = set(mlp_only_layers or [])
    return [i for i in range(num_hidden_layers)
            if num_experts and i not in dense and (i + 1) % decoder_sparse_step == 0]


def _num_experts(value) -> None:
    if not is_int(value) or value <= 0:
        raise ValueError(
            f"`num_experts` must be a positive integer (a GatedQwenMoeConfig has experts; a dense model is a "
            f"GatedQwenConfig), got {value!r}."
        )


@strict
class GatedQwenMoeConfig(GatedQwenConfig):
    r"""
    Configuration of a [`GatedQwenMoeModel`]: a [`GatedQwenConfig`] (the gate, its defaults, the attention) with
    Qwen3-MoE's mixture of experts (its fields, defaults and weight layout) and Qwen3-Next's optional shared expert.
    Layers that are not sparse keep the dense `intermediate_size` MLP.

    num_experts (`int`, defaults to 128):
        Routed experts per sparse layer (Qwen3-MoE's default, and the paper's MoE).
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
    >>> config = GatedQwenMoeConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
    ...                             num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
    ...                             moe_intermediate_size=64, gate_granularity="headwise")
    >>> model = GatedQwenMoeForCausalLM(config)
    ```
    """

    model_type = "gated_qwen_moe"
    default_auto_map: ClassVar[dict[str, str]] = MOE_AUTO_MAP

    num_experts: int = validated_field(_num_experts, default=128)
    num_experts_per_tok: int = validated_field(positive("num_experts_per_tok"), default=8)
    moe_intermediate_size: int = validated_field(positive("moe_intermediate_size"), default=768)
    norm_topk_prob: bool = False
    decoder_sparse_step: int = validated_field(positive("decoder_sparse_step"), default=1)
    mlp_only_layers: list[int] | None = None
    shared_expert_intermediate_size: int = validated_field(
        at_least_zero("shared_expert_intermediate_size", "no shared expert"), default=0)
    router_aux_loss_coef: float | int = validated_field(non_negative_number("router_aux_loss_coef"), default=0.001)
    router_z_loss_coef: float | int = validated_field(non_negative_number("router_z_loss_coef"), default=0.0)
    output_router_logits: bool = False

    def __post_init__(self, **kwargs):
        if self.mlp_only_layers is not None and len(self.mlp_only_layers) == 0:
            self.mlp_only_layers = None  # Qwen3-MoE writes [] for "none"
        super().__post_init__(**kwargs)

    def __setattr__(self, name, value):
        if name == "mlp_only_layers" and isinstance(value, (list, tuple)):
            value = sorted(value)
        super().__setattr__(name, value)

    def validate_moe(self) -> None:
        """The mixture-of-experts fields together."""
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
                f"{self.num_hidden_layers} layers dense. A dense model is a GatedQwenConfig."
            )

    @property
    def sparse_layers(self) -> list[int]:
        """Indices of the mixture-of-experts layers (`sparse_layer_indices`)."""
        return sparse_layer_indices(self.num_hidden_layers, self.decoder_sparse_step, self.mlp_only_layers)

    @derived_plan
    def base_model_tp_plan(self) -> dict[str, str]:
        """GatedQwenConfig's plan (the dense MLP's rules only where some layer keeps it), Qwen3-MoE's expert rules
        (the router is replicated) and Qwen3-Next's shared-expert rules when there is one."""
        mlp = "layers.*.mlp"
        plan = GatedQwenConfig.base_model_tp_plan.fget(self)
        if len(self.sparse_layers) == self.num_hidden_layers:  # no layer keeps the dense MLP
            plan = {rule: style for rule, style in plan.items() if not rule.startswith(f"{mlp}.")}
        plan |= {f"{mlp}.experts.gate_up_proj": "packed_colwise", f"{mlp}.experts.down_proj": "rowwise",
                 f"{mlp}.experts": "moe_tp_experts"}
        if self.shared_expert_intermediate_size:
            plan |= {f"{mlp}.shared_expert.gate_proj": "colwise", f"{mlp}.shared_expert.up_proj": "colwise",
                     f"{mlp}.shared_expert.down_proj": "rowwise"}
        return plan

    @property
    def base_model_ep_plan(self) -> dict[str, str]:
        """Expert parallelism (`distributed_config` with experts): Qwen3-MoE's plan."""
        return {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm", "layers.*.mlp.experts.down_proj": "grouped_gemm",
                "layers.*.mlp.experts": "ep_dispatch_experts"}


__all__ = ["GatedQwenMoeConfig"]
