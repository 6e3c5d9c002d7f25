"""Transformers' Qwen3.5 text model (`Qwen3_5ForCausalLM`, model_type `qwen3_5_text`) and Qwen3-Next
(`Qwen3NextForCausalLM`, `qwen3_next`) with every layer full attention.

Qwen3.5's full-attention layer is a Qwen3 attention with the G1 elementwise sigmoid gate: `q_proj` has 2·H·D rows,
viewed per head as `[q_h (D rows) | gate_h (D rows)]`, and `attn * sigmoid(gate)` is applied before `o_proj`.
Qwen3-Next is the same attention with Qwen3-MoE's router and experts plus a shared expert scaled by
`sigmoid(shared_expert_gate(x))`: with `shared_expert_intermediate_size` set, GatedQwen-MoE computes it exactly, and
its MLP tensors have the same names and on-disk layout, so they pass through. The differences are in the format, not
the function:

- Every RMSNorm (input_layernorm, post_attention_layernorm, the final norm, q_norm and k_norm) computes
  `x̂ · (1 + w)`: weights are stored zero-centred, so import adds 1 and export subtracts 1, in float32 (16-bit norm
  weights are written in float32 so that the shift loses nothing).
- RoPE covers `partial_rotary_factor` of each head (stored in `rope_parameters`, default 0.25): export writes 1.0,
  import requires 1.0.
- `layer_types` may mix `linear_attention` (Gated DeltaNet) and `full_attention`: export writes all
  `full_attention`, and `full_attention_interval` 1, which says the same to readers that go by the interval
  (llama.cpp's converter; Transformers when `layer_types` is absent; absent, it means 4); import requires that.
- `attention_bias` puts a bias on q (gate rows included), k, v and o together; missing biases are written as zeros.
  Serving engines read it otherwise: vLLM's Qwen3.5 / Qwen3-Next attention takes the q/k/v bias from `qkv_bias`, has
  no o_proj bias, and skips bias tensors it does not expect without a word. The export therefore also writes
  `qkv_bias` (a gate bias, whose o_proj bias is zeros, is then exact in vLLM too) and refuses a model with Qwen3's
  `attention_bias` (an o_proj bias those engines drop), naming the native folder, unless `allow_o_proj_bias` (the
  command line's `--allow-o-proj-bias`) asks for it anyway, for stock Transformers, with a warning.
- Multi-token-prediction heads (`mtp.*`) are not part of the causal LM: left out, as the stock classes do.

Export covers every G1 sigmoid multiplicative gate exactly: headwise and head-shared gates are repeated over the
elements / heads they share; layers without a gate and input-independent gates become zero gate rows (sigmoid 0.5)
with o_proj's columns multiplied by 2·(gate value). Other gates are refused with the reason. Qwen3-Next's sparse
layers always have a shared expert, so a GatedQwen-MoE exports to it only with one; a dense model is refused,
naming `--to qwen3_5` (vLLM's Qwen3-Next needs a sparse layer). Import gives a G1 elementwise
sigmoid GatedQwen (a GatedQwen-MoE for a Qwen3-Next with experts); `--from qwen3_5` refuses mixture-of-experts
layers, naming `--from qwen3_next`. Qwen3-Next has no router z-loss: `router_z_loss_coef` is not carried over.
"""

from __future__ import annotations

import torch
from transformers import Qwen3_5TextConfig, Qwen3NextConfig

from ...files import say
from ...model.configuration_gated_moe import GatedQwenMoeConfig, sparse_layer_indices
from ..errors import CheckpointFormatError, ConversionError
from ..export_steps import (
    check_qwen3_5_attention,
    check_shared_expert,
    exported_bias,
    load_gated_config,
    norm_dtype,
    qwen3_5_attention,
)
from ..format_types import Context, ExportOption, FolderWriting, Format, Reading, TensorRule
from ..io import Checkpoint
from ..plans import TensorMap, copy_rest
from ..shared import QWEN3_FIELDS, STOCK_MOE_FIELDS, source_dtype


def split_heads(packed: torch.Tensor, heads: int, part: int) -> torch.Tensor:
    """Qwen3.5 `q_proj` rows `[H*2D, ...]` -> the queries `[H*D, ...]` (`part=0`) or the gates `[H*D, ...]`
    (`part=1`)."""
    return packed.view(heads, 2, -1, *packed.shape[1:])[:, part].reshape(-1, *packed.shape[1:])


def from_zero_centred(weight: torch.Tensor) -> torch.Tensor:
    """A Qwen3.5 / Qwen3-Next RMSNorm weight `[dim]` (the norm computes `x̂·(1 + w)`) -> GatedQwen's (`x̂·w`):
    `w + 1`, computed in float32 (and kept there for 16-bit weights). `export_steps.to_zero_centred` is its
    inverse."""
    return (weight.float() + 1).to(norm_dtype(weight.dtype))


# ------------------------------------------------------------------------------------------------------ import
def qwen3_5_config_fields(cfg: dict, gate: dict | None = None) -> dict:
    """GatedQwenConfig fields (G1 elementwise sigmoid gate) of a Qwen3.5 text or Qwen3-Next config.json whose
    layers are all full attention with RoPE on the whole head; Qwen3-Next's experts come along."""
    model_type = cfg.get("model_type")
    if model_type == "qwen3_5":
        raise CheckpointFormatError(
            "the folder is a Qwen3.5 vision-language checkpoint (model_type 'qwen3_5'); use its text model "
            "(model_type 'qwen3_5_text', e.g. saved from Qwen3_5ForCausalLM)."
        )
    cls = Qwen3_5TextConfig if model_type == "qwen3_5_text" else Qwen3NextConfig
    stock = cls(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")})
    linear = [i for i, t in enumerate(stock.layer_types) if t != "full_attention"]
    if linear:
        raise CheckpointFormatError(
            f"layers {linear} are {stock.layer_types[linear[0]]!r} (Gated DeltaNet linear attention), which GatedQwen "
            "does not have; only checkpoints whose layer_types are all 'full_attention' are GatedQwen models."
        )
    factor = stock.rope_parameters.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise CheckpointFormatError(
            f"the checkpoint rotates only part of each head (partial_rotary_factor={factor}); GatedQwen applies RoPE "
            "to the whole head, so only checkpoints with partial_rotary_factor 1.0 are GatedQwen models."
        )
    rope = {k: v for k, v in stock.rope_parameters.items()
            if k not in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")}  # text: one position a token
    fields = dict({k: getattr(stock, k) for k in QWEN3_FIELDS}, rope_parameters=rope, use_qk_norm=True,
                  gate_position="sdpa", gate_granularity="elementwise", gate_bias=stock.attention_bias)
    if model_type == "qwen3_next" and sparse_layer_indices(stock.num_hidden_layers, stock.decoder_sparse_step,
                                                           stock.mlp_only_layers, stock.num_experts):
        fields.update({k: getattr(stock, k) for k in STOCK_MOE_FIELDS},
                      shared_expert_intermediate_size=stock.shared_expert_intermediate_size,
                      mlp_only_layers=stock.mlp_only_layers or None)
    return fields


def check_q_proj_rows(cfg: dict, config, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuses a `q_proj` whose rows are not the 2·H·D of `split_heads`."""
    heads, head_dim = config.num_attention_heads, config.head_dim
    for layer in range(config.num_hidden_layers):
        for kind in ("weight", "bias"):
            name = f"model.layers.{layer}.self_attn.q_proj.{kind}"
            if name in shapes and shapes[name][0] != 2 * heads * head_dim:
                raise CheckpointFormatError(
                    f"{name} has {shapes[name][0]} rows; Qwen3.5 attention has 2·H·D = {2 * heads * head_dim} "
                    f"(H={heads}, D={head_dim}): the queries and the gate of each head."
                )


def dense_config_fields(cfg: dict, gate: dict | None = None) -> dict:
    """`qwen3_5_config_fields` of a dense model: `--from qwen3_5` refuses mixture-of-experts layers, naming
    `--from qwen3_next`."""
    fields = qwen3_5_config_fields(cfg)
    sparse = sparse_layer_indices(fields["num_hidden_layers"], fields.get("decoder_sparse_step", 1),
                                  fields.get("mlp_only_layers"), fields.get("num_experts", 0))
    if sparse:
        raise CheckpointFormatError(
            f"layers {sparse} of SRC are mixture-of-experts (num_experts={fields['num_experts']}); `--from qwen3_5` "
            "imports dense models (every layer in mlp_only_layers, or num_experts=0). Use `--from qwen3_next` for a "
            "Qwen3-Next mixture-of-experts checkpoint."
        )
    return fields


def split_q_proj(context: Context, packed: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """`q_proj`'s weight or bias -> the queries and the gate rows of each head."""
    queries, gates = (split_heads(packed, context.shard.heads, part).contiguous() for part in (0, 1))
    return {f"self_attn.q_proj.{kind}": queries, f"self_attn.gate.g_proj.{kind}": gates}


# `q_proj` split per head into the queries and the gate rows; every RMSNorm weight shifted from zero-centred.
QWEN3_5_RULES = (
    *(TensorRule(f"self_attn.q_proj.{kind}", (f"self_attn.q_proj.{kind}", f"self_attn.gate.g_proj.{kind}"),
                 lambda context, packed, kind=kind: split_q_proj(context, packed, kind)) for kind in ("weight", "bias")),
    TensorRule("norm.weight", ("norm.weight",), lambda context, weight: {"norm.weight": from_zero_centred(weight)}),
)


# ------------------------------------------------------------------------------------------------------ export
def all_full_attention(layers: int) -> dict:
    """Every layer full attention, said both ways engines read it: `layer_types` (Transformers, vLLM) and
    `full_attention_interval` 1 (llama.cpp's converter writes it into the GGUF; Transformers derives `layer_types`
    from it, default 4, only where `layer_types` is absent)."""
    return {"layer_types": ["full_attention"] * layers, "full_attention_interval": 1}


ALLOW_O_PROJ_BIAS = ExportOption(
    "allow_o_proj_bias", "export a model with attention_bias (an o_proj bias) anyway, with a warning; stock "
    "Transformers computes it, vLLM drops that bias (refused without this flag)")
O_PROJ_BIAS_REFUSAL = (
    "this model has attention_bias=True, an o_proj bias, which vLLM's Qwen3.5 / Qwen3-Next attention does not have "
    "and drops without a word; serve the native gated_qwen folder instead (docs/serving.md), "
    f"or pass {ALLOW_O_PROJ_BIAS.flag} to write it for stock Transformers, which computes it exactly."
)


def check_o_proj_bias(config, allow_o_proj_bias: bool) -> None:
    """Refuses an o_proj bias (`attention_bias`), which vLLM drops, unless `allow_o_proj_bias`; warns when it is
    written."""
    if config.attention_bias and not allow_o_proj_bias:
        raise ConversionError(O_PROJ_BIAS_REFUSAL)
    if config.attention_bias:
        say("warning: Qwen3.5's o_proj bias is written as asked (--allow-o-proj-bias): stock Transformers computes "
            "this export exactly; vLLM drops that bias and computes something else.")


def qwen3_5_tensors(ckpt: Checkpoint, config) -> dict:
    """The tensors of a Qwen3.5 / Qwen3-Next folder: per layer the G1 gate rows interleaved into `q_proj` per head,
    zero k/v/o biases where only the gate has one, the norms zero-centred; the rest (the MLP or the experts, which
    have the same names and layout) as they are."""
    tmap = TensorMap(ckpt)
    qwen3_5_attention(tmap, config, zero_centred=True)
    copy_rest(tmap, config)
    return tmap.finish()


def attention_fields(config) -> dict:
    """The config fields Qwen3.5 and Qwen3-Next share: Qwen3's, RoPE on the whole head, every layer full
    attention, one bias flag."""
    fields = {k: getattr(config, k) for k in QWEN3_FIELDS}
    fields.update(
        rope_parameters={**config.rope_parameters, "partial_rotary_factor": 1.0}, attention_bias=exported_bias(config),
        **all_full_attention(config.num_hidden_layers),
    )
    return fields


def stock_config(cls, fields: dict, architecture: str, ckpt: Checkpoint):
    """The Transformers config `cls(**fields)` as the folder's config.json: `architectures`, `dtype` and, with a
    bias, `qkv_bias` (where vLLM reads the q/k/v bias flag; Transformers reads `attention_bias`)."""
    out = cls(**fields)
    if fields["attention_bias"]:
        out.qkv_bias = True
    out.architectures = [architecture]
    out.dtype = source_dtype(ckpt.config)
    return out


LANGUAGE_MODEL_PREFIX = ExportOption(
    "language_model_prefix", "name the text model's tensors model.language_model.*, as Qwen3.5's released "
    "checkpoints do (torchtitan's qwen3_5 reads only those; Transformers reads either)")


def plan_gated_to_qwen3_5(ckpt: Checkpoint, allow_o_proj_bias: bool = False, language_model_prefix: bool = False):
    """`--to qwen3_5`: `(Qwen3_5TextConfig, {name: TensorPlan})` of a dense gated_qwen checkpoint; with
    `language_model_prefix`, `model.*` named `model.language_model.*`."""
    config = load_gated_config(ckpt)
    check_qwen3_5_attention(config)
    check_o_proj_bias(config, allow_o_proj_bias)
    plan = qwen3_5_tensors(ckpt, config)
    if language_model_prefix:
        plan = {name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: tensor
                for name, tensor in plan.items()}
    return stock_config(Qwen3_5TextConfig, attention_fields(config), "Qwen3_5ForCausalLM", ckpt), plan


def plan_gated_to_qwen3_next(ckpt: Checkpoint, allow_o_proj_bias: bool = False):
    """`--to qwen3_next`: `(Qwen3NextConfig, {name: TensorPlan})` of a gated_qwen_moe checkpoint with a shared
    expert (a dense one is refused, naming `--to qwen3_5`)."""
    config = load_gated_config(ckpt, moe=True)
    if not isinstance(config, GatedQwenMoeConfig):
        raise ConversionError(
            "this model is dense, and a Qwen3-Next without a mixture-of-experts layer is refused by vLLM (\"No "
            "Qwen3Next layer found\"); use --to qwen3_5, whose model computes the same function in Transformers and "
            "vLLM. Nothing was written."
        )
    check_shared_expert(config)
    check_qwen3_5_attention(config)
    check_o_proj_bias(config, allow_o_proj_bias)
    plan = qwen3_5_tensors(ckpt, config)
    fields = attention_fields(config)
    fields.update({k: getattr(config, k) for k in (*STOCK_MOE_FIELDS, "shared_expert_intermediate_size")},
                  mlp_only_layers=config.mlp_only_layers or [])
    return stock_config(Qwen3NextConfig, fields, "Qwen3NextForCausalLM", ckpt), plan


QWEN3_5 = Format(
    "qwen3_5", "Transformers' Qwen3.5 text model (and dense Qwen3-Next), every layer full attention",
    reading=Reading(("qwen3_5_text", "qwen3_next", "qwen3_5"), dense_config_fields,
                    detect=lambda config: config.get("model_type") != "qwen3_next", check=check_q_proj_rows,
                    rules=QWEN3_5_RULES, ignored=("mtp.",)),
    writing=FolderWriting(plan_gated_to_qwen3_5, options=(ALLOW_O_PROJ_BIAS, LANGUAGE_MODEL_PREFIX)))
# from_pretrained reads every Qwen3-Next folder in this format, dense or not (QWEN3_5 leaves them to it).
QWEN3_NEXT = Format(
    "qwen3_next", "Qwen3-Next, every layer full attention, dense or mixture-of-experts",
    reading=Reading(("qwen3_next",), qwen3_5_config_fields, check=check_q_proj_rows, rules=QWEN3_5_RULES,
                    ignored=("mtp.",)),
    writing=FolderWriting(plan_gated_to_qwen3_next, options=(ALLOW_O_PROJ_BIAS,)))
