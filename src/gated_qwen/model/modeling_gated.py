"""GatedQwen: a Qwen3 decoder with the gated attention of Qiu et al. (2025), "Gated Attention for Large Language
Models" (arXiv 2505.06708).

Reads like `transformers/models/qwen3/modeling_qwen3.py`, whose building blocks (RMSNorm, MLP, rotary embedding,
eager attention, the attention projections) it imports with their Hub-kernel hooks. The gate is the only new idea:
`GatedQwenGate` (gating.py), which the attention module calls at each place a gate can act. Every variant of the
paper is a config value. This is the dense model; the mixture of experts (`modeling_gated_moe.py`) builds on it.

Checkpoints hold exactly the model's own tensor names (the gate's `self_attn.gate.*` included): a gated_qwen folder
loads with no conversion.

A saved folder ships this file with `configuration_gated.py`, `gating.py`, `attention_choice.py` (the default
attention and the Hub kernel's loading), `loading_checks.py` and `transformers_compat.py` (and the mixture of
experts' two files for one): relative imports only, nothing of the gated_qwen package. The fused kernel is found in
Transformers' attention registry, where the package registers it when it is imported, or, without the package, where
attention_choice.py registers the Hub kernel that config.json names. What the package adds (reading other checkpoint
formats, its model card on `push_to_hub`) it attaches when it is imported; this file does not contain it.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .attention_choice import choose_attention
from .configuration_gated import GatedQwenConfig
from .gating import GatedQwenGate, applies_output_gate, register_head_shared_gate_style
from .loading_checks import refuse_unexpected_gates, refuse_unloaded_tensors
from .transformers_compat import (
    CACHE_FIELD,
    create_causal_mask,
    create_sliding_window_causal_mask,
    slice_logits_to_keep,
)

logger = logging.get_logger(__name__)


class GatedQwenRMSNorm(Qwen3RMSNorm):
    """Qwen3's RMSNorm: `hidden_states: [..., size]` -> `x̂ · weight`, normalised over the last dimension."""


class GatedQwenMLP(Qwen3MLP):
    """Qwen3's SwiGLU MLP of width `config.intermediate_size`: `[B, S, hidden]` -> `[B, S, hidden]`."""


class GatedQwenRotaryEmbedding(Qwen3RotaryEmbedding):
    """Qwen3's rotary embedding (default, YaRN and the other `rope_parameters` types): forward(`x`,
    `position_ids: [B, S]`) -> `(cos, sin)`, each `[B, S, head_dim]` in `x`'s dtype."""


class GatedQwenAttention(Qwen3Attention):
    """Qwen3's attention (projections, QK-norm, RoPE, cache, every attention backend) with the gate.

    `self.gate` (a `GatedQwenGate`) computes its logits from this module's input (the hidden state after the
    pre-attention RMSNorm, the tensor that feeds q/k/v) and acts at `config.gate_position`: on q, k or v right after
    their projections (G4, G3, G2), on the attention output per head (G1, "sdpa") or on `o_proj`'s output (G5,
    "dense"). An attention function that `applies_output_gate` (gating.py) receives the G1 sigmoid gate's logits
    as `output_gate` and applies them itself. `use_qk_norm=False` drops QK-norm (the paper's released code
    makes it optional).
    """

    def __init__(self, config: GatedQwenConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if not config.use_qk_norm:
            self.q_norm = self.k_norm = nn.Identity()
        self.gate = GatedQwenGate(config, layer_idx)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`hidden_states: [B, S, hidden]` (after the pre-attention norm) -> `([B, S, hidden], weights or None)`."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        gate_logits = self.gate(hidden_states)

        query_states = self.gate.apply_at("query", self.q_proj(hidden_states).view(hidden_shape), gate_logits)
        key_states = self.gate.apply_at("key", self.k_proj(hidden_states).view(hidden_shape), gate_logits)
        value_states = self.gate.apply_at("value", self.v_proj(hidden_states).view(hidden_shape), gate_logits)
        query_states = self.q_norm(query_states).transpose(1, 2)
        key_states = self.k_norm(key_states).transpose(1, 2)
        value_states = value_states.transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        fused = self.gate.fusable and applies_output_gate(attention_interface)
        if fused:
            kwargs["output_gate"] = gate_logits.expand(*input_shape, query_states.shape[1], self.gate.width)

        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        if not fused:
            # The attention interface promises only an output that reshapes to `[*input_shape, -1]`: Transformers'
            # backends return `[B, S, H, D]`, vLLM's `[tokens, H * D]`. The gate acts per head: `[*input_shape, H, D]`.
            attn_output = self.gate.apply_at("sdpa", attn_output.reshape(hidden_shape), gate_logits)

        attn_output = self.o_proj(attn_output.reshape(*input_shape, -1).contiguous())
        attn_output = self.gate.apply_at("dense", attn_output, gate_logits)
        return attn_output, attn_weights


class GatedQwenDecoderLayer(GradientCheckpointingLayer):
    """Qwen3's decoder layer with the gated attention. `mlp`: its feed-forward block, `[B, S, hidden]` ->
    `[B, S, hidden]` (default: the SwiGLU `GatedQwenMLP`; the mixture of experts passes its sparse block)."""

    def __init__(self, config: GatedQwenConfig, layer_idx: int, mlp: nn.Module | None = None):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = GatedQwenAttention(config=config, layer_idx=layer_idx)
        self.mlp = GatedQwenMLP(config) if mlp is None else mlp
        self.input_layernorm = GatedQwenRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GatedQwenRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """`hidden_states: [B, S, hidden]` -> `[B, S, hidden]`."""
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


@dataclass
class GatedQwenModelOutputWithPast(BaseModelOutputWithPast):
    r"""
    gate_logits (`tuple(torch.Tensor | None)`, returned with `output_gate_logits=True`):
        One entry per layer: the gate's logits (`[B, S, heads, width]`, or `[heads, width]` for the input-independent
        gate; the scores are `act(logits)`), or None in a layer without a gate.
    """

    gate_logits: tuple[torch.Tensor | None, ...] | None = None


@dataclass
class GatedQwenCausalLMOutputWithPast(CausalLMOutputWithPast):
    r"""
    gate_logits (`tuple(torch.Tensor | None)`, returned with `output_gate_logits=True`):
        As in [`GatedQwenModelOutputWithPast`].
    """

    gate_logits: tuple[torch.Tensor | None, ...] | None = None


class GatedQwenPreTrainedModel(PreTrainedModel):
    config: GatedQwenConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["GatedQwenDecoderLayer"]
    _skip_keys_device_placement = [CACHE_FIELD]  # the cache, named as the installed Transformers' models name it
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "gate_logits": OutputRecorder(GatedQwenGate),
        "hidden_states": GatedQwenDecoderLayer,
        "attentions": GatedQwenAttention,
    }

    def __init__(self, config: GatedQwenConfig, *inputs, **kwargs):
        if config.model_type != self.config_class.model_type:  # e.g. a mixture of experts given to a dense class
            ours, theirs = self.config_class.__name__.removesuffix("Config"), type(config).__name__.removesuffix("Config")
            raise ValueError(
                f"{type(self).__name__} builds model_type {self.config_class.model_type!r} ({self.config_class.__name__})"
                f"; this config is a {type(config).__name__} (model_type {config.model_type!r}): use "
                f"{type(self).__name__.replace(ours, theirs, 1)}, or the Auto classes."
            )
        register_head_shared_gate_style()  # what its tensor-parallel plan names, without the package too
        super().__init__(config, *inputs, **kwargs)
        # Tags of the Hub card that `push_to_hub` writes (per instance: Transformers appends to this list).
        self.model_tags = ["gated-attention", "custom_code"]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Transformers' `from_pretrained`, which refuses a checkpoint that lacks a gate tensor its config has,
        holds one its config does not have, or holds one of another shape (even with `ignore_mismatched_sizes=True`),
        rather than starting that gate at random (Transformers' own answer is a "newly initialized" warning), and any other tensor of another shape
        unless `ignore_mismatched_sizes=True`: one error naming the tensor. The gated_qwen package replaces
        `_read_pretrained` to also read other checkpoint formats; this check holds for both."""
        wants_info = kwargs.get("output_loading_info", False)
        allows_mismatch = kwargs.get("ignore_mismatched_sizes", False)
        # Loaded either way, so that a mismatch is refused below by name (Transformers raises a RuntimeError that
        # points at its log); with the caller's ignore_mismatched_sizes=True only non-gate tensors may be re-started.
        kwargs.update(output_loading_info=True, ignore_mismatched_sizes=True)
        model, info = cls._read_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        refuse_unloaded_tensors(model, info, allows_mismatch)
        refuse_unexpected_gates(model, info)
        return (model, info) if wants_info else model

    @classmethod
    def _read_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`(model, loading info)`: Transformers' `from_pretrained` with `output_loading_info=True`."""
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """By default the fused attention where the registry offers it, else Transformers' choice with the gate
        after it (attention_choice.py)."""
        return choose_attention(self.config, requested_attention, lambda: super(
            GatedQwenPreTrainedModel, self).get_correct_attn_implementation(requested_attention, is_init_check))

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, GatedQwenGate) and hasattr(module, "logits"):
            init.zeros_(module.logits)  # the paper's input-independent gate starts at sigmoid(0) = 0.5


class GatedQwenModel(GatedQwenPreTrainedModel):
    output_class = GatedQwenModelOutputWithPast  # what `forward` returns (the mixture of experts adds router logits)

    def __init__(self, config: GatedQwenConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [self.decoder_layer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = GatedQwenRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = GatedQwenRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.has_sliding_layers = "sliding_attention" in config.layer_types
        self.post_init()

    @staticmethod
    def decoder_layer(config: GatedQwenConfig, layer_idx: int) -> GatedQwenDecoderLayer:
        """Decoder layer `layer_idx` (the mixture of experts gives its sparse layers their sparse block here)."""
        return GatedQwenDecoderLayer(config, layer_idx)

    @merge_with_config_defaults
    @capture_outputs
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
    ) -> GatedQwenModelOutputWithPast:
        """`input_ids: [B, S]` (or `inputs_embeds: [B, S, hidden]`) -> `last_hidden_state: [B, S, hidden]`
        (and `gate_logits`, one per layer, with `output_gate_logits=True`)."""
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        if not isinstance(causal_mask_mapping := attention_mask, dict):
            mask_kwargs = {
                "config": self.config,
                "inputs_embeds": inputs_embeds,
                "attention_mask": attention_mask,
                "cache": cache,
                "position_ids": position_ids,
            }
            causal_mask_mapping = {"full_attention": create_causal_mask(**mask_kwargs)}
            if self.has_sliding_layers:
                causal_mask_mapping["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask_mapping[self.config.layer_types[i]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return self.output_class(last_hidden_state=hidden_states, **{CACHE_FIELD: cache if use_cache else None})


class GatedQwenForCausalLM(GatedQwenPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}
    base_model_class = GatedQwenModel  # the model under the head (the mixture of experts' causal LM has its own)
    output_class = GatedQwenCausalLMOutputWithPast

    def __init__(self, config: GatedQwenConfig):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> GatedQwenCausalLMOutputWithPast:
        """`input_ids: [B, S]` -> `logits: [B, S, vocab]` (the last `logits_to_keep` positions if set), and the
        shifted cross-entropy `loss` when `labels: [B, S]` are given; the model's other outputs as it returns them
        (cache, hidden states, attentions, `gate_logits`)."""
        outputs: GatedQwenModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        carried = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
        return self.output_class(loss=loss, logits=logits, **carried)


class GatedQwenForSequenceClassification(GenericForSequenceClassification, GatedQwenPreTrainedModel):
    pass


class GatedQwenForTokenClassification(GenericForTokenClassification, GatedQwenPreTrainedModel):
    pass


class GatedQwenForQuestionAnswering(GenericForQuestionAnswering, GatedQwenPreTrainedModel):
    pass


__all__ = [
    "GatedQwenPreTrainedModel",
    "GatedQwenModel",
    "GatedQwenForCausalLM",
    "GatedQwenForSequenceClassification",
    "GatedQwenForTokenClassification",
    "GatedQwenForQuestionAnswering",
]
