"""GatedQwen <-> Transformers' Qwen3.5 text model (`Qwen3_5ForCausalLM`, model_type `qwen3_5_text`), and import
from Qwen3-Next (`qwen3_next`).

Qwen3.5's full-attention layer is a Qwen3 attention with the G1 elementwise sigmoid gate: `q_proj` has 2·H·D rows,
viewed per head as `[q_h (D rows) | gate_h (D rows)]`, and `attn * sigmoid(gate)` is applied before `o_proj`. Its
differences from GatedQwen are in the format, not the function:

- Every RMSNorm (input_layernorm, post_attention_layernorm, the final norm, q_norm and k_norm) computes
  `x̂ · (1 + w)`: weights are stored zero-centred, so export subtracts 1 and import adds 1. 16-bit norm weights are
  written in float32 so that the shift loses nothing.
- RoPE covers `partial_rotary_factor` of each head (stored in `rope_parameters`, default 0.25): export writes 1.0,
  import requires 1.0.
- `layer_types` may mix `linear_attention` (Gated DeltaNet) and `full_attention`: export writes all
  `full_attention`, import requires that.
- `attention_bias` puts a bias on q (gate rows included), k, v and o together; missing biases are written as zeros.

Export covers every G1 sigmoid multiplicative gate exactly: headwise and head-shared gates are repeated over the
elements / heads they share; layers without a gate and input-independent gates become zero gate rows (sigmoid 0.5)
with o_proj's columns multiplied by 2·(gate value). Other gates are refused with the reason. Import gives a G1
elementwise sigmoid GatedQwen. Qwen3-Next differs from Qwen3.5 only by its mixture-of-experts MLP; a Qwen3-Next
checkpoint whose layers are all full attention with the dense MLP (`mlp_only_layers` covering every layer, or
`num_experts=0`) imports the same way; its MoE layers are refused.
"""

from __future__ import annotations

import torch

from ..configuration_gated import GatedQwenConfig
from .common import (
    FINAL_NORM,
    LAYER_NORMS,
    QWEN3_FIELDS,
    TensorMap,
    check_g1_sigmoid,
    copy_rest,
    g1_gate_rows,
    load_gated_config,
    shifted_norm,
    source_dtype,
    zeros,
)
from .io import Checkpoint, ConversionError, TensorPlan

IMPORT_MODEL_TYPES = ("qwen3_5_text", "qwen3_next")
IGNORED_PREFIXES = ("mtp.",)  # multi-token-prediction heads: not part of the causal LM (stock classes skip them too)


def interleave_heads(queries: torch.Tensor, gates: torch.Tensor, heads: int) -> torch.Tensor:
    """`queries, gates: [H*D, ...]` -> Qwen3.5 `q_proj` rows `[H*2D, ...]`, per head `[q_h | gate_h]`."""
    rest = queries.shape[1:]
    return torch.cat([queries.view(heads, -1, *rest), gates.view(heads, -1, *rest)], dim=1).reshape(-1, *rest)


def split_heads(packed: torch.Tensor, heads: int, part: int) -> torch.Tensor:
    """Qwen3.5 `q_proj` rows `[H*2D, ...]` -> the queries `[H*D, ...]` (`part=0`) or the gates `[H*D, ...]`
    (`part=1`); only that part is copied."""
    return packed.view(heads, 2, -1, *packed.shape[1:])[:, part].reshape(-1, *packed.shape[1:])


def plan_gated_to_qwen3_5(ckpt: Checkpoint):
    from transformers import Qwen3_5TextConfig

    config = load_gated_config(ckpt)
    target = "Qwen3.5"
    check_g1_sigmoid(config, target)
    if not config.use_qk_norm:
        raise ConversionError(f"{target} always normalises queries and keys; this model has use_qk_norm=False.")
    sliding = [i for i, t in enumerate(config.layer_types) if t != "full_attention"]
    if sliding:
        raise ConversionError(
            f"{target} has no sliding-window attention; layers {sliding} of this model are "
            f"{config.layer_types[sliding[0]]}."
        )
    gated = config.gate_position is not None
    bias = config.attention_bias or (gated and config.gate_bias)
    heads, head_dim = config.num_attention_heads, config.head_dim

    tmap = TensorMap(ckpt)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        attn = prefix + "self_attn."
        gate_w, gate_b, o_proj = g1_gate_rows(tmap, config, layer, head_dim, with_bias=bias)
        tmap.put(attn + "o_proj.weight", o_proj)
        q_w = tmap.take(attn + "q_proj.weight")
        tmap.put(attn + "q_proj.weight", TensorPlan(
            (2 * q_w.shape[0], q_w.shape[1]), q_w.dtype,
            lambda q_w=q_w, gate_w=gate_w: interleave_heads(q_w.make(), gate_w.make().to(q_w.dtype), heads)))
        if bias:
            q_b = tmap.take(attn + "q_proj.bias") if config.attention_bias else zeros((heads * head_dim,), q_w.dtype)
            tmap.put(attn + "q_proj.bias", TensorPlan(
                (2 * q_b.shape[0],), q_b.dtype,
                lambda q_b=q_b, gate_b=gate_b: interleave_heads(q_b.make(), gate_b.make().to(q_b.dtype), heads)))
            if not config.attention_bias:
                for proj in ("k_proj", "v_proj", "o_proj"):
                    info = tmap.info(attn + f"{proj}.weight")
                    tmap.put(attn + f"{proj}.bias", zeros((info.shape[0],), info.dtype))
        for norm in LAYER_NORMS:
            shifted_norm(tmap, prefix + norm + ".weight", -1.0)
    shifted_norm(tmap, FINAL_NORM, -1.0)
    copy_rest(tmap, config)

    fields = {k: getattr(config, k) for k in QWEN3_FIELDS}
    fields.update(
        rope_parameters={**config.rope_parameters, "partial_rotary_factor": 1.0}, attention_bias=bias,
        layer_types=["full_attention"] * config.num_hidden_layers,
    )
    out = Qwen3_5TextConfig(**fields)
    out.architectures = ["Qwen3_5ForCausalLM"]
    out.dtype = source_dtype(ckpt.config)
    return out, tmap.finish()


def stock_import_config(cfg: dict):
    """The stock config object of a Qwen3.5 text / Qwen3-Next config.json (so defaults are read as Transformers
    reads them), after checking that it is attention-only with full rotary and a dense MLP."""
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig

    model_type = cfg.get("model_type")
    if model_type == "qwen3_5":
        raise ConversionError(
            "SRC is a Qwen3.5 vision-language checkpoint (model_type 'qwen3_5'); convert its text model "
            "(model_type 'qwen3_5_text', e.g. saved from Qwen3_5ForCausalLM)."
        )
    if model_type not in IMPORT_MODEL_TYPES:
        raise ConversionError(
            f"SRC has model_type={model_type!r}; `--from qwen3_5` reads {' or '.join(IMPORT_MODEL_TYPES)}."
        )
    cls = Qwen3_5TextConfig if model_type == "qwen3_5_text" else Qwen3NextConfig
    stock = cls(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")})
    linear = [i for i, t in enumerate(stock.layer_types) if t != "full_attention"]
    if linear:
        raise ConversionError(
            f"layers {linear} of SRC are {stock.layer_types[linear[0]]!r} (Gated DeltaNet linear attention), which "
            "GatedQwen does not have; only checkpoints whose layer_types are all 'full_attention' convert."
        )
    factor = stock.rope_parameters.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise ConversionError(
            f"SRC rotates only part of each head (partial_rotary_factor={factor}); GatedQwen applies RoPE to the "
            "whole head, so only checkpoints with partial_rotary_factor 1.0 convert exactly."
        )
    if model_type == "qwen3_next":
        sparse = [i for i in range(stock.num_hidden_layers) if i not in stock.mlp_only_layers and
                  stock.num_experts > 0 and (i + 1) % stock.decoder_sparse_step == 0]
        if sparse:
            raise ConversionError(
                f"layers {sparse} of SRC are mixture-of-experts (num_experts={stock.num_experts}); `--from qwen3_5` "
                "imports dense models (every layer in mlp_only_layers, or num_experts=0). Use `--from qwen3_next` "
                "for a Qwen3-Next mixture-of-experts checkpoint."
            )
    return stock


def plan_qwen3_5_to_gated(ckpt: Checkpoint):
    stock = stock_import_config(ckpt.config)
    rope = {k: v for k, v in stock.rope_parameters.items()
            if k not in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")}  # text: one position per token
    fields = {k: getattr(stock, k) for k in QWEN3_FIELDS}
    fields.update(rope_parameters=rope)
    config = GatedQwenConfig(**fields, use_qk_norm=True, gate_position="sdpa", gate_granularity="elementwise",
                             gate_bias=stock.attention_bias)
    config.dtype = source_dtype(ckpt.config)
    heads, head_dim = config.num_attention_heads, config.head_dim

    tmap = TensorMap(ckpt)
    for name in ckpt.tensors:
        if name.startswith(IGNORED_PREFIXES):
            tmap.drop(name)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for kind in ("weight", "bias") if stock.attention_bias else ("weight",):
            name = prefix + f"self_attn.q_proj.{kind}"
            info = tmap.info(name)
            tmap.drop(name)
            if info.shape[0] != 2 * heads * head_dim:
                raise ConversionError(f"{name} has {info.shape[0]} rows; Qwen3.5 attention has 2·H·D = "
                                      f"{2 * heads * head_dim} (H={heads}, D={head_dim}).")
            for part, out in ((0, "q_proj"), (1, "g_proj")):
                tmap.put(prefix + f"self_attn.{out}.{kind}", TensorPlan(
                    (heads * head_dim, *info.shape[1:]), info.dtype,
                    lambda name=name, part=part: split_heads(ckpt.get(name), heads, part)))
        for norm in LAYER_NORMS:
            shifted_norm(tmap, prefix + norm + ".weight", +1.0)
    shifted_norm(tmap, FINAL_NORM, +1.0)
    copy_rest(tmap, config)
    return config, tmap.finish()
