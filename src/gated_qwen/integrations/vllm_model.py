"""GatedQwen (dense) for vLLM, built from vLLM's own layers: the faster way to serve a native gated_qwen folder.

vLLM's Transformers backend serves every gated_qwen folder by running this package's Transformers modules
(`model_impl="transformers"`); this model runs vLLM's fused QKV projection, fused SwiGLU, its RMSNorm and rotary
kernels and its paged attention, with the gate of `gating.GatedQwenGate` (the same module, its projection made a
vLLM parallel linear layer) at the configured position. It is registered by the plugin (`vllm_plugin.py`, the
`vllm.general_plugins` entry point of this distribution) for the architecture `GatedQwenForCausalLM`, so where this
package is installed beside vLLM, `LLM(model=folder, trust_remote_code=True)` uses it; `model_impl="transformers"`
still chooses the Transformers backend. Mixture-of-experts folders (`GatedQwenMoeForCausalLM`) are not registered and
go to the Transformers backend, or serve as their `--to qwen3_next` export.

Tensor parallelism follows `GatedQwenConfig.base_model_tp_plan`: q/k/v and per-head gate projections (and the
input-independent gate's logits) split by heads, head-shared and G5 gates replicated, `o_proj` and the MLP as in
vLLM's Qwen3. Refused with the reason (serve those with `model_impl="transformers"`): sliding-window layers, and a
key/value gate when there are fewer key/value heads than ranks (vLLM then replicates the heads the gate would split).

Importing this module imports vLLM; nothing else in the package does.
"""

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.models.qwen2 import Qwen2MLP, Qwen2Model
from vllm.model_executor.models.qwen3 import Qwen3Attention
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    PPMissingLayer,
    extract_layer_index,
    maybe_prefix,
)
from vllm.model_executor.utils import set_weight_attrs
from vllm.sequence import IntermediateTensors

from ..model.gating import POSITIONS, GatedQwenGate


def _vllm_gate(config, layer_idx: int, prefix: str, quant_config: QuantizationConfig | None) -> GatedQwenGate:
    """`GatedQwenGate(config, layer_idx)` with its projection a vLLM linear layer (split by heads where the gate is
    per head, else replicated) and its input-independent logits loaded split by heads the same way."""
    gate = GatedQwenGate(config, layer_idx)
    if gate.position is None:
        return gate
    heads = POSITIONS[gate.position].heads
    per_head = heads is not None and gate.heads > 1
    ranks = get_tensor_model_parallel_world_size()
    if per_head and heads == "key_value" and config.num_key_value_heads % ranks:
        raise ValueError(
            f"a per-head {gate.position} gate needs the {config.num_key_value_heads} key/value heads split over the "
            f"{ranks} tensor-parallel ranks; vLLM replicates them instead. Serve this model with fewer ranks or with "
            "model_impl='transformers'."
        )
    if hasattr(gate, "g_proj"):
        linear = ColumnParallelLinear if per_head else ReplicatedLinear
        gate.g_proj = linear(config.hidden_size, gate.heads * gate.width, bias=config.gate_bias,
                             quant_config=quant_config, prefix=f"{prefix}.g_proj", return_bias=False)
    else:
        gate.logits = nn.Parameter(torch.empty(gate.heads // ranks if per_head else gate.heads, gate.width),
                                   requires_grad=False)
        if per_head:
            set_weight_attrs(gate.logits, {"weight_loader": sharded_weight_loader(0)})
    return gate


def refuse_sliding_windows(config) -> None:
    """Refuses a config with a layer that is not full attention (sliding windows in some layers or all), naming the
    Transformers backend, which serves it: vLLM's Qwen2Model, this model's base, would otherwise stop a folder where
    only some layers slide with an assertion that asks to open an issue."""
    sliding = [i for i, kind in enumerate(config.layer_types) if kind != "full_attention"]
    if sliding:
        raise ValueError(
            f"layers {sliding} of this folder are {config.layer_types[sliding[0]]}; gated_qwen's vLLM model has full "
            "attention only. Serve this folder with model_impl='transformers'."
        )


class GatedQwenVllmAttention(Qwen3Attention):
    """vLLM's Qwen3 attention with the gate (`self.gate`) at its position: on q, k or v after the fused QKV
    projection (G4, G3, G2), on the attention output per head (G1) or on `o_proj`'s output (G5); the non-gate
    controls on the attention output; `use_qk_norm=False` without QK-norm; an `o_proj` bias with `attention_bias`.
    forward(`positions: [T]`, `hidden_states: [T, hidden]`) -> `[T, hidden]`."""

    def __init__(self, config, layer_idx: int, cache_config: CacheConfig | None,
                 quant_config: QuantizationConfig | None, prefix: str):
        super().__init__(
            hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, rope_parameters=config.rope_parameters,
            max_position=config.max_position_embeddings, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
            qkv_bias=config.attention_bias, cache_config=cache_config, quant_config=quant_config, prefix=prefix)
        if config.attention_bias:
            self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                            bias=True, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        if not config.use_qk_norm:
            self.q_norm = self.k_norm = nn.Identity()
        self.gate = _vllm_gate(config, layer_idx, f"{prefix}.gate", quant_config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens, gate = hidden_states.shape[0], self.gate
        logits = gate(hidden_states)  # [T, heads, width], [heads, width] or None
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = (x.view(tokens, -1, self.head_dim)
                   for x in qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1))
        q = self.q_norm(gate.apply_at("query", q, logits)).reshape(tokens, -1)
        k = self.k_norm(gate.apply_at("key", k, logits)).reshape(tokens, -1)
        v = gate.apply_at("value", v, logits).reshape(tokens, -1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v).view(tokens, -1, self.head_dim)
        output, _ = self.o_proj(gate.apply_at("sdpa", attn_output, logits).reshape(tokens, -1))
        return gate.apply_at("dense", output, logits)


class GatedQwenVllmDecoderLayer(nn.Module):
    """Pre-norm residual block of vLLM's Qwen3 (fused residual-add RMSNorm, fused SwiGLU) with the gated attention."""

    def __init__(self, config, cache_config: CacheConfig | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        layer_idx = extract_layer_index(prefix)
        self.self_attn = GatedQwenVllmAttention(config, layer_idx, cache_config, quant_config, f"{prefix}.self_attn")
        self.mlp = Qwen2MLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                            hidden_act=config.hidden_act, quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden_states: [T, hidden]` and the running residual -> the same after this layer (its norm deferred)."""
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0,
                                         "inputs_embeds": 0})
class GatedQwenVllmModel(Qwen2Model):
    # The gate's tensors have the same names on disk as in memory (`self_attn.gate.*`): Qwen2's mapping suffices.
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        refuse_sliding_windows(vllm_config.model_config.hf_config.get_text_config())  # before Qwen2Model's own assertion on them
        super().__init__(vllm_config=vllm_config, prefix=prefix, decoder_layer_type=GatedQwenVllmDecoderLayer)


class GatedQwenForCausalLM(nn.Module):
    """vLLM's causal LM interface over `GatedQwenVllmModel`: the (tied or not) LM head and the logits processor."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    hf_to_vllm_mapper = GatedQwenVllmModel.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = GatedQwenVllmModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights)  # the model maps q/k/v and gate/up to the fused layers
