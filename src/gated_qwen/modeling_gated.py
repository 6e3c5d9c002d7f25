"""GatedQwen: a Qwen3 decoder with the gated attention of Qiu et al. (2025), "Gated Attention for Large Language
Models" (arXiv 2505.06708).

Reads like `transformers/models/qwen3/modeling_qwen3.py`; the gate is the only new idea and lives in
`GatedQwenAttention` (`g_proj`, `_gate_logits`, `_apply_gate`). Every variant of the paper is a config value.

This file is copied to the Hugging Face Hub beside `configuration_gated.py`, the `gated_triton` attention backend
(`gated_triton_backend.py`) and the Triton kernel it drives: relative imports only, Triton only behind a guard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GenericForSequenceClassification, GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeExperts,
    Qwen3MoeTopKRouter,
    load_balancing_loss_func,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, is_torch_distributed_available
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_gated import GatedQwenConfig
from .gated_triton_backend import gated_triton_is_default  # registers attn_implementation="gated_triton"


class GatedQwenRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`hidden_states: [..., hidden_size]` -> same shape, normalised over the last dimension."""
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class GatedQwenMLP(nn.Module):
    def __init__(self, config: GatedQwenConfig, intermediate_size: int | None = None):
        super().__init__()
        intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x: [B, S, hidden]` -> `[B, S, hidden]` (SwiGLU)."""
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


# Mixture of experts: Qwen3-MoE's router and experts (same parameters and names, so its checkpoints load as they
# are), plus Qwen3-Next's optional shared expert. The expert computation is Transformers' own:
# `use_experts_implementation` picks it from `config._experts_implementation` ("grouped_mm" by default,
# "batched_mm", or "eager", Qwen3-MoE's loop over the experts that received tokens). The decorator is applied again
# here because Transformers looks for it in the model's own source file before it allows anything but "eager".
@use_experts_implementation
class GatedQwenExperts(Qwen3MoeExperts):
    """`gate_up_proj: [E, 2 * moe_intermediate_size, hidden]`, `down_proj: [E, hidden, moe_intermediate_size]`.

    forward(`hidden_states: [T, hidden]`, `top_k_index: [T, k]`, `top_k_weights: [T, k]`) -> `[T, hidden]`: the
    sum over each token's k experts of `weight * down(act(gate(x)) * up(x))`.
    """


class GatedQwenTopKRouter(Qwen3MoeTopKRouter):
    """`weight: [E, hidden]`. forward(`hidden_states: [T, hidden]`) -> `(logits [T, E], top_k_weights [T, k],
    top_k_index [T, k])`: softmax over the E logits, the k largest probabilities (renormalised to sum to 1 when
    `config.norm_topk_prob`)."""


class GatedQwenSparseMoeBlock(nn.Module):
    """The sparse feed-forward block: `gate` (the router) and `experts` as in Qwen3-MoE, and with
    `config.shared_expert_intermediate_size > 0` Qwen3-Next's `shared_expert` scaled by
    `sigmoid(shared_expert_gate(x))`."""

    def __init__(self, config: GatedQwenConfig):
        super().__init__()
        self.gate = GatedQwenTopKRouter(config)
        self.experts = GatedQwenExperts(config)
        self.shared_expert = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = GatedQwenMLP(config, intermediate_size=config.shared_expert_intermediate_size)
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


# Checkpoints store the experts one by one (`mlp.experts.{e}.{gate,up,down}_proj.weight`), as Qwen3-MoE's do on the
# Hub; Transformers stacks them into `gate_up_proj` / `down_proj` when loading and splits them again when saving.
# Custom-code models get that only when the mapping is registered under their model_type.
register_checkpoint_conversion_mapping(
    GatedQwenConfig.model_type, get_checkpoint_conversion_mapping("qwen3_moe"), overwrite=True
)


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


class GatedQwenRotaryEmbedding(nn.Module):
    def __init__(self, config: GatedQwenConfig):
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: GatedQwenConfig, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`position_ids: [B, S]` -> `(cos, sin)`, each `[B, S, head_dim]` in `x`'s dtype."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """`q: [B, Hq, S, D]`, `k: [B, Hkv, S, D]`, `cos, sin: [B, S, D]` -> rotated `(q, k)`."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`[B, Hkv, S, D]` -> `[B, Hkv * n_rep, S, D]` (each kv head repeated for its group of query heads)."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`query: [B, Hq, S, D]`, `key, value: [B, Hkv, S_k, D]`, additive `attention_mask: [B, 1, S, S_k]`
    -> `(out: [B, S, Hq, D], weights: [B, Hq, S, S_k])`."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


def _ns_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 0.5 + 0.5 * torch.sigmoid(x)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "ns_sigmoid": _ns_sigmoid,
    "identity": _identity,
}


class GatedQwenAttention(nn.Module):
    """Qwen3 attention with the gate of Qiu et al. (2025).

    The gate scores are `act(X W_g)` where X is this module's input (the hidden state after the pre-attention
    RMSNorm, the same tensor that feeds q/k/v) and `W_g` is `g_proj`, laid out per head: its output viewed as
    `[..., heads, width]` (see `GatedQwenConfig.gate_shape`). They multiply (or are added to) the tensor at
    `config.gate_position`: the attention output per head (G1, "sdpa"), v, k or q right after their projections
    (G2-G4), or o_proj's output (G5, "dense"). An attention backend whose function carries
    `fuses_output_gate = True` receives the G1 sigmoid gate logits as `output_gate` and applies them itself.
    """

    def __init__(self, config: GatedQwenConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None

        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_bias)
        if config.use_qk_norm:
            self.q_norm = GatedQwenRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = GatedQwenRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

        self.gate_position = config.gate_position if layer_idx in config.gated_layers else None
        if self.gate_position is not None:
            self.gate_shape = config.gate_shape
            heads, width = self.gate_shape
            if config.gate_input_dependent:
                self.g_proj = nn.Linear(config.hidden_size, heads * width, bias=config.gate_bias)
            else:
                self.gate_logits = nn.Parameter(torch.zeros(heads, width))
            self.gate_act = GATE_ACTIVATIONS[config.gate_activation]
            self.gate_multiplies = config.gate_combine == "multiply"
            # The G1 sigmoid product is what a fused attention kernel can apply in its epilogue.
            self.gate_fusable = (
                self.gate_position == "sdpa" and self.gate_multiplies and config.gate_activation == "sigmoid"
            )
        self.sdpa_output_transform = config.sdpa_output_transform
        if self.sdpa_output_transform == "rmsnorm":
            self.sdpa_norm = GatedQwenRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _gate_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`hidden_states: [B, S, hidden]` -> logits `[B, S, heads, width]` (`[heads, width]` if input-independent)."""
        if hasattr(self, "g_proj"):
            # -1, not gate_shape[0]: under tensor parallelism g_proj holds only this rank's heads.
            return self.g_proj(hidden_states).view(*hidden_states.shape[:-1], -1, self.gate_shape[1])
        return self.gate_logits

    def _apply_gate(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """`x: [B, S, heads_x, D]`, `logits` broadcastable to it -> `x * act(logits)` or `x + act(logits)`."""
        scores = self.gate_act(logits).to(x.dtype)
        return x * scores if self.gate_multiplies else x + scores

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
        position = self.gate_position
        gate = self._gate_logits(hidden_states) if position is not None else None

        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape)
        if position == "query":
            query_states = self._apply_gate(query_states, gate)
        elif position == "key":
            key_states = self._apply_gate(key_states, gate)
        elif position == "value":
            value_states = self._apply_gate(value_states, gate)
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
        fused = (
            position == "sdpa" and self.gate_fusable and getattr(attention_interface, "fuses_output_gate", False)
        )
        gate_kwargs = {}
        if fused:
            heads = query_states.shape[1]
            gate_kwargs["output_gate"] = gate.expand(*input_shape, heads, self.gate_shape[1])

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
            **gate_kwargs,
        )

        if position == "sdpa" and not fused:
            attn_output = self._apply_gate(attn_output, gate)
        elif self.sdpa_output_transform == "rmsnorm":
            attn_output = self.sdpa_norm(attn_output)
        elif self.sdpa_output_transform == "silu":
            attn_output = F.silu(attn_output)

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        if position == "dense":
            attn_output = self._apply_gate(attn_output.unsqueeze(-2), gate).squeeze(-2)
        return attn_output, attn_weights


class GatedQwenDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: GatedQwenConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = GatedQwenAttention(config=config, layer_idx=layer_idx)
        if layer_idx in config.sparse_layers:
            self.mlp = GatedQwenSparseMoeBlock(config)
        else:
            self.mlp = GatedQwenMLP(config)
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


class GatedQwenPreTrainedModel(PreTrainedModel):
    config: GatedQwenConfig
    config_class = GatedQwenConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["GatedQwenDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(GatedQwenTopKRouter, index=0),
        "hidden_states": GatedQwenDecoderLayer,
        "attentions": GatedQwenAttention,
    }

    # Set by the gated_qwen package (`hub.push_card_if_missing`): uploads its model card to a repository that has
    # none before `push_to_hub` pushes the model. Without the package (remote code) Transformers' card is written.
    card_pusher: Callable | None = None

    def __init__(self, config: GatedQwenConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        # Tags of the Hub card that `push_to_hub` writes (per instance: Transformers appends to this list).
        self.model_tags = ["gated-attention", "custom_code"]

    def push_to_hub(self, *args, **kwargs):
        """Transformers' `push_to_hub`; with the gated_qwen package installed, a repository without a card first
        gets the package's card (gate variant, sizes, loading instructions, citation), which the push then keeps."""
        repo_id = kwargs.get("repo_id", args[0] if args else None)
        if self.card_pusher is not None and repo_id is not None:
            type(self).card_pusher(self, repo_id, token=kwargs.get("token"), private=kwargs.get("private"))
        return super().push_to_hub(*args, **kwargs)

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        if requested_attention is None and gated_triton_is_default(self.config):
            return "gated_triton"  # the fused Triton kernel, see gated_triton_backend.py
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, GatedQwenAttention) and hasattr(module, "gate_logits"):
            init.zeros_(module.gate_logits)  # the paper's input-independent gate starts at sigmoid(0) = 0.5
        elif isinstance(module, GatedQwenExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.down_proj, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, GatedQwenTopKRouter):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)


class GatedQwenModel(GatedQwenPreTrainedModel):
    def __init__(self, config: GatedQwenConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [GatedQwenDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = GatedQwenRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = GatedQwenRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.has_sliding_layers = "sliding_attention" in config.layer_types
        self.post_init()

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
    ) -> MoeModelOutputWithPast:
        """`input_ids: [B, S]` (or `inputs_embeds: [B, S, hidden]`) -> `last_hidden_state: [B, S, hidden]`
        (and `router_logits`, one `[B * S, num_experts]` per sparse layer, with `output_router_logits=True`)."""
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
        return MoeModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None)


class GatedQwenForCausalLM(GatedQwenPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: GatedQwenConfig):
        super().__init__(config)
        self.model = GatedQwenModel(config)
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
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        """`input_ids: [B, S]` -> `logits: [B, S, vocab]` (the last `logits_to_keep` positions if set), and the
        shifted cross-entropy `loss` when `labels: [B, S]` are given.

        With experts and `output_router_logits` (default: `config.output_router_logits`), also `router_logits` and
        `aux_loss`, the load-balancing loss; with `labels`, `loss` then adds `router_aux_loss_coef * aux_loss` and
        `router_z_loss_coef * router_z_loss_func(router_logits)`, as Qwen3-MoE does for the first term."""
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        outputs: MoeModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        aux_loss = None
        if output_router_logits and outputs.router_logits:
            # A 2-D padding mask covers the cached tokens too when decoding: keep the columns of this step's tokens.
            seq_len = outputs.last_hidden_state.shape[1]
            mask = attention_mask[:, -seq_len:] if attention_mask is not None and attention_mask.dim() == 2 else None
            aux_loss = load_balancing_loss_func(
                outputs.router_logits, self.config.num_experts, self.config.num_experts_per_tok, mask
            )
            if labels is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
                if self.config.router_z_loss_coef > 0:
                    z_loss = router_z_loss_func(outputs.router_logits, mask)
                    loss = loss + self.config.router_z_loss_coef * z_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )


class GatedQwenForSequenceClassification(GenericForSequenceClassification, GatedQwenPreTrainedModel):
    pass


# Tensor parallelism (`tp_plan="auto"`, see `GatedQwenConfig._tp_plan_with_gate`) splits the heads across ranks. A
# head-shared gate is whole on every rank, but each rank's heads give only part of the gradient of its scores: this
# style sums that gradient across ranks in the backward pass (the forward pass is unchanged).
if is_torch_distributed_available():
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, _AllReduceBackward
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    class HeadSharedGateParallel(TensorParallelLayer):
        def transform_output_post_forward(self, module, output, mesh):
            return _AllReduceBackward.apply(output, mesh.get_group())

    ALL_PARALLEL_STYLES.register("head_shared_gate", HeadSharedGateParallel())


__all__ = [
    "GatedQwenPreTrainedModel",
    "GatedQwenModel",
    "GatedQwenForCausalLM",
    "GatedQwenForSequenceClassification",
]
