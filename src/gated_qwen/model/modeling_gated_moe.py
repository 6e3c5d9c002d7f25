"""GatedQwen with a mixture of experts: the gated attention of `modeling_gated.py` with Qwen3-MoE's sparse
feed-forward block (its router and experts, same parameters and names, so its checkpoints load as they are) and
Qwen3-Next's optional shared expert, as `transformers/models/qwen3_moe/modeling_qwen3_moe.py` builds on Qwen3.

Everything but the feed-forward block is the dense model's, imported from `modeling_gated.py`: the attention and
its gate, the norms, the rotary embedding, the decoder layer (given the sparse block as its `mlp`) and the base
model's forward. What is new here is the sparse block, the router logits among the outputs and the auxiliary losses
(Qwen3-MoE's load balancing and ST-MoE's router z-loss) in the causal LM's loss.

This file is copied to the Hugging Face Hub beside `modeling_gated.py` and `configuration_gated.py`: relative imports
only.
"""

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.integrations import use_experts_implementation
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
)
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeExperts,
    Qwen3MoeMLP,
    Qwen3MoeTopKRouter,
    load_balancing_loss_func,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import OutputRecorder

from .configuration_gated_moe import GatedQwenMoeConfig
from .modeling_gated import GatedQwenDecoderLayer, GatedQwenForCausalLM, GatedQwenModel, GatedQwenPreTrainedModel


def register_expert_layout() -> None:
    """Registers this model type's checkpoint names with Transformers (idempotent): Qwen3-MoE's, its experts stored
    one by one (`mlp.experts.{e}.{gate,up,down}_proj.weight`) as on the Hub, stacked when loaded and unstacked when
    saved (Transformers' own conversion for Qwen3-MoE). Custom-code models get a conversion only when it is
    registered like this; a model registers it when it is built, before it loads or saves."""
    if get_checkpoint_conversion_mapping(GatedQwenMoeConfig.model_type) is None:
        register_checkpoint_conversion_mapping(
            GatedQwenMoeConfig.model_type, get_checkpoint_conversion_mapping("qwen3_moe"), overwrite=True)


class GatedQwenMoeMLP(Qwen3MoeMLP):
    """SwiGLU, `[B, S, hidden]` -> `[B, S, hidden]`, of width `intermediate_size` (default: the config's): the MLP of
    the layers that are not sparse, and Qwen3-Next's shared expert."""


# The expert computation is Transformers' own: `use_experts_implementation` picks it from
# `config._experts_implementation` ("grouped_mm" by default, "batched_mm", or "eager"). The decorator is applied
# again here because Transformers looks for it in the model's own source file before it allows anything but
# "eager" (which is also why the dense model, in a file without it, is never treated as having experts).
@use_experts_implementation
class GatedQwenMoeExperts(Qwen3MoeExperts):
    """`gate_up_proj: [E, 2 * moe_intermediate_size, hidden]`, `down_proj: [E, hidden, moe_intermediate_size]`.

    forward(`hidden_states: [T, hidden]`, `top_k_index: [T, k]`, `top_k_weights: [T, k]`) -> `[T, hidden]`: the
    sum over each token's k experts of `weight * down(act(gate(x)) * up(x))`.
    """


class GatedQwenMoeTopKRouter(Qwen3MoeTopKRouter):
    """`weight: [E, hidden]`. forward(`hidden_states: [T, hidden]`) -> `(logits [T, E], top_k_weights [T, k],
    top_k_index [T, k])`: softmax over the E logits, the k largest probabilities (renormalised to sum to 1 when
    `config.norm_topk_prob`)."""


class GatedQwenMoeSparseMoeBlock(nn.Module):
    """The sparse feed-forward block: `gate` (the router) and `experts` as in Qwen3-MoE, and with
    `config.shared_expert_intermediate_size > 0` Qwen3-Next's `shared_expert` scaled by
    `sigmoid(shared_expert_gate(x))`."""

    def __init__(self, config: GatedQwenMoeConfig):
        super().__init__()
        self.gate = GatedQwenMoeTopKRouter(config)
        self.experts = GatedQwenMoeExperts(config)
        self.shared_expert = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = GatedQwenMoeMLP(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`hidden_states: [B, S, hidden]` -> `[B, S, hidden]`."""
        batch_size, seq_len, hidden_size = hidden_states.shape
        tokens = hidden_states.reshape(-1, hidden_size)
        _, top_k_weights, top_k_index = self.gate(tokens)
        output = self.experts(tokens, top_k_index, top_k_weights)
        if self.shared_expert is not None:
            output = output + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return output.reshape(batch_size, seq_len, hidden_size)


def router_z_loss_func(
    router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens and sparse layers of `logsumexp(router logits)^2`.

    `router_logits`: one `[B * S, E]` tensor per sparse layer; `attention_mask: [B, S]` (1 = token, 0 = padding)
    leaves padding out of the mean. Returns a float32 scalar.
    """
    device = router_logits[0].device
    log_z = torch.stack([torch.logsumexp(logits.to(device).float(), dim=-1) for logits in router_logits])  # [L, T]
    z_loss = log_z.square()
    if attention_mask is None:
        return z_loss.mean()
    mask = attention_mask.reshape(1, -1).to(device=device, dtype=z_loss.dtype)
    return (z_loss * mask).sum() / (mask.sum() * z_loss.shape[0])


@dataclass
class GatedQwenMoeModelOutputWithPast(MoeModelOutputWithPast):
    r"""
    gate_logits (`tuple(torch.Tensor | None)`, returned with `output_gate_logits=True`):
        As in [`GatedQwenModelOutputWithPast`]: one entry per layer, the gate's logits or None.
    """

    gate_logits: tuple[torch.Tensor | None, ...] | None = None


@dataclass
class GatedQwenMoeCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""
    gate_logits (`tuple(torch.Tensor | None)`, returned with `output_gate_logits=True`):
        As in [`GatedQwenModelOutputWithPast`].
    """

    gate_logits: tuple[torch.Tensor | None, ...] | None = None


class GatedQwenMoePreTrainedModel(GatedQwenPreTrainedModel):
    config: GatedQwenMoeConfig
    _can_record_outputs = {
        "router_logits": OutputRecorder(GatedQwenMoeTopKRouter, index=0),
        **GatedQwenPreTrainedModel._can_record_outputs,
    }

    def __init__(self, config: GatedQwenMoeConfig, *inputs, **kwargs):
        register_expert_layout()  # how its checkpoints name the experts, without the package too
        super().__init__(config, *inputs, **kwargs)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # Transformers answers this from the class's source file (this one applies `use_experts_implementation`) and
        # caches the answer on the class it asks about; GatedQwenMoeModel subclasses GatedQwenModel, which would
        # otherwise pass on a cached "no".
        return True

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, GatedQwenMoeExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.down_proj, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, GatedQwenMoeTopKRouter):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)


class GatedQwenMoeModel(GatedQwenMoePreTrainedModel, GatedQwenModel):
    output_class = GatedQwenMoeModelOutputWithPast

    @staticmethod
    def decoder_layer(config: GatedQwenMoeConfig, layer_idx: int) -> GatedQwenDecoderLayer:
        """The sparse block in `config.sparse_layers`, the dense MLP (of `intermediate_size`) elsewhere."""
        sparse = layer_idx in config.sparse_layers
        return GatedQwenDecoderLayer(config, layer_idx, GatedQwenMoeSparseMoeBlock(config) if sparse else None)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> GatedQwenMoeModelOutputWithPast:
        """`GatedQwenModel.forward`, which also returns `router_logits` (one `[B * S, num_experts]` per sparse layer)
        with `output_router_logits=True`."""
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)


class GatedQwenMoeForCausalLM(GatedQwenMoePreTrainedModel, GatedQwenForCausalLM):
    """The dense causal LM (`GatedQwenForCausalLM`: the head, its plans, the loss) over `GatedQwenMoeModel`, with the
    router logits among the outputs and the auxiliary losses in the loss."""

    base_model_class = GatedQwenMoeModel
    output_class = GatedQwenMoeCausalLMOutputWithPast

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        labels: torch.LongTensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> GatedQwenMoeCausalLMOutputWithPast:
        """`GatedQwenForCausalLM.forward` (the same arguments, by keyword after `attention_mask`): `input_ids: [B, S]`
        -> `logits: [B, S, vocab]`, the shifted cross-entropy `loss` with `labels: [B, S]`.

        With `output_router_logits` (default: `config.output_router_logits`), also `router_logits` (one `[B * S,
        num_experts]` per sparse layer) and `aux_loss`, the load-balancing loss; with `labels`, `loss` then adds
        `router_aux_loss_coef * aux_loss` and `router_z_loss_coef * router_z_loss_func(router_logits)`, as Qwen3-MoE
        does for the first term."""
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        output = super().forward(input_ids, attention_mask, labels=labels, output_router_logits=output_router_logits,
                                 return_dict=True, **kwargs)
        if not (output_router_logits and output.router_logits):
            return output
        # A 2-D padding mask covers the cached tokens too when decoding: keep the columns of this step's tokens.
        mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            mask = attention_mask[:, -(output.router_logits[0].shape[0] // attention_mask.shape[0]):]
        aux_loss = load_balancing_loss_func(
            output.router_logits, self.config.num_experts, self.config.num_experts_per_tok, mask
        )
        loss = output.loss
        if labels is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
            if self.config.router_z_loss_coef > 0:
                z_loss = router_z_loss_func(output.router_logits, mask)
                loss = loss + self.config.router_z_loss_coef * z_loss.to(loss.device)
        return dataclasses.replace(output, loss=loss, aux_loss=aux_loss)


class GatedQwenMoeForSequenceClassification(GenericForSequenceClassification, GatedQwenMoePreTrainedModel):
    pass


class GatedQwenMoeForTokenClassification(GenericForTokenClassification, GatedQwenMoePreTrainedModel):
    pass


class GatedQwenMoeForQuestionAnswering(GenericForQuestionAnswering, GatedQwenMoePreTrainedModel):
    pass


__all__ = [
    "GatedQwenMoePreTrainedModel",
    "GatedQwenMoeModel",
    "GatedQwenMoeForCausalLM",
    "GatedQwenMoeForSequenceClassification",
    "GatedQwenMoeForTokenClassification",
    "GatedQwenMoeForQuestionAnswering",
]
