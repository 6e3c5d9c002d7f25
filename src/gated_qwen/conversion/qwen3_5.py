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
`num_experts=0`) imports the same way; its MoE layers are refused. The layouts (`split_heads` / `interleave_heads`,
`from_zero_centred` / `to_zero_centred`) and the import's config (`qwen3_5_config_fields`, with its refusals) are
those of `checkpoint_formats`, which `from_pretrained` reads such folders with.
"""

from __future__ import annotations

from ..checkpoint_formats import (
    QWEN3_FIELDS,
    from_zero_centred,
    interleave_heads,
    moe_layers,
    qwen3_5_config_fields,
    qwen3_5_q_rows_error,
    source_dtype,
    split_heads,
    to_zero_centred,
)
from ..configuration_gated import GatedQwenConfig
from .common import (
    FINAL_NORM,
    LAYER_NORMS,
    TensorMap,
    check_g1_sigmoid,
    copy_rest,
    g1_gate_rows,
    load_gated_config,
    shifted_norm,
    zeros,
)
from .io import Checkpoint, ConversionError, TensorPlan

IMPORT_MODEL_TYPES = ("qwen3_5_text", "qwen3_next")
IGNORED_PREFIXES = ("mtp.",)  # multi-token-prediction heads: not part of the causal LM (stock classes skip them too)


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
            shifted_norm(tmap, prefix + norm + ".weight", to_zero_centred)
    shifted_norm(tmap, FINAL_NORM, to_zero_centred)
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


def plan_qwen3_5_to_gated(ckpt: Checkpoint):
    cfg = ckpt.config
    if cfg.get("model_type") not in ("qwen3_5", *IMPORT_MODEL_TYPES):  # qwen3_5: refused with the reason below
        raise ConversionError(
            f"SRC has model_type={cfg.get('model_type')!r}; `--from qwen3_5` reads {' or '.join(IMPORT_MODEL_TYPES)}."
        )
    fields = qwen3_5_config_fields(cfg)  # refuses linear attention and partial RoPE
    sparse = moe_layers(fields["num_hidden_layers"], fields.get("num_experts", 0), fields.get("mlp_only_layers"),
                        fields.get("decoder_sparse_step", 1))
    if sparse:
        raise ConversionError(
            f"layers {sparse} of SRC are mixture-of-experts (num_experts={fields['num_experts']}); `--from qwen3_5` "
            "imports dense models (every layer in mlp_only_layers, or num_experts=0). Use `--from qwen3_next` "
            "for a Qwen3-Next mixture-of-experts checkpoint."
        )
    config = GatedQwenConfig(**fields)
    config.dtype = source_dtype(cfg)
    return config, plan_qwen3_5_tensors(ckpt, config)


def plan_qwen3_5_tensors(ckpt: Checkpoint, config: GatedQwenConfig) -> dict[str, TensorPlan]:
    """The tensors of a Qwen3.5 text / Qwen3-Next checkpoint read as the GatedQwen model `config`: `q_proj` split
    into queries and gate rows (`checkpoint_formats.split_heads`), the zero-centred norms shifted
    (`from_zero_centred`), the rest (MLP, experts, router) unchanged, multi-token-prediction heads left out."""
    heads, head_dim = config.num_attention_heads, config.head_dim
    tmap = TensorMap(ckpt)
    for name in ckpt.tensors:
        if name.startswith(IGNORED_PREFIXES):
            tmap.drop(name)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            name = prefix + f"self_attn.q_proj.{kind}"
            info = tmap.info(name)
            tmap.drop(name)
            if info.shape[0] != 2 * heads * head_dim:
                raise qwen3_5_q_rows_error(name, info.shape[0], heads, head_dim)
            for part, out in ((0, "q_proj"), (1, "g_proj")):
                tmap.put(prefix + f"self_attn.{out}.{kind}", TensorPlan(
                    (heads * head_dim, *info.shape[1:]), info.dtype,
                    lambda name=name, part=part: split_heads(ckpt.get(name), heads, part)))
        for norm in LAYER_NORMS:
            shifted_norm(tmap, prefix + norm + ".weight", from_zero_centred)
    shifted_norm(tmap, FINAL_NORM, from_zero_centred)
    copy_rest(tmap, config)
    return tmap.finish()
