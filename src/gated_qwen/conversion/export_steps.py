"""The steps an export is made of. Each export (`formats/qwen3_5.py`, `release.py`, `gguf.py`, `mlx.py`,
`megatron.py`, `olmo_core.py`) reads the gated_qwen checkpoint's config (`load_gated_config`), refuses what its
target cannot hold (the `check_*` steps), and builds its plan on a `plans.TensorMap` (`take` a source tensor, as it is
or transformed when written; `put` an output; `drop`; `finish`) layer by layer with the steps below; what no step
puts passes through (`plans.copy_rest`). Which target takes which step:

| step                    | qwen3_5, qwen3_next | gguf              | mlx               | release                |
|-------------------------|---------------------|-------------------|-------------------|------------------------|
| `qwen3_5_attention`     | zero-centred norms  | norms as stored   | norms as stored   |                        |
| `gate_rows_into_q_proj` | a group per head    | a group per head  | a group per head  | a group per kv head    |
| `zero_biases`           | k, v, o             | k, v              | k, v, o           | k, v, o                |
| `stacked_experts`       | (pass through)      | `ffn_*_exps`      | `switch_mlp`      | (dense only)           |

`qwen3_5_attention` is `gate_rows_into_q_proj`, `zero_biases` and `norms` on every layer. Megatron-core and OLMo-core
take `g1_gate_rows` (the gate as rows per head) and place them in their own layouts. A tensor step takes the
`TensorMap` (or, for `stacked_experts`, the finished plan) and puts `TensorPlan`s: nothing is read until the plan is
written. `interleave_rows` and `to_zero_centred` are the tensor math they apply.
"""

from __future__ import annotations

import torch

from ..model.configuration_gated import GatedQwenConfig
from ..model.configuration_gated_moe import GatedQwenMoeConfig
from ..model.gating import gate_shape, gated_layers
from .errors import ConversionError
from .io import Checkpoint, TensorPlan
from .plans import TensorMap

# RMSNorm weights of a decoder layer, relative to `model.layers.N.`, and the final norm.
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
FINAL_NORM = "model.norm.weight"
CONFIG_CLASSES = {c.model_type: c for c in (GatedQwenConfig, GatedQwenMoeConfig)}


# ------------------------------------------------------------------------------------------------------ the source
def load_gated_config(ckpt: Checkpoint, moe: bool = False) -> GatedQwenConfig:
    """The config of a gated_qwen folder (with `moe`, also of a gated_qwen_moe one); refuses other model types."""
    model_type = ckpt.config.get("model_type")
    if model_type == GatedQwenMoeConfig.model_type and not moe:
        raise ConversionError(
            f"SRC is a mixture-of-experts GatedQwen (num_experts={ckpt.config.get('num_experts')!r}); this converter "
            "handles dense models only."
        )
    if model_type not in CONFIG_CLASSES:
        kinds = "a gated_qwen or gated_qwen_moe" if moe else "a gated_qwen"
        raise ConversionError(
            f"SRC {str(ckpt.folder)!r} has model_type={model_type!r}; `--to` converts {kinds} checkpoint. To import "
            "this one use `--from` with its format."
        )
    return CONFIG_CLASSES[model_type].from_dict(ckpt.config)


# ------------------------------------------------------------------------------------------------------ refusals
def check_g1_sigmoid(config: GatedQwenConfig, target: str) -> None:
    """Refuses gates that a target with a per-head `attn * sigmoid(x W)` gate (Qwen3.5 and the formats that read its
    attention, the release) cannot hold."""
    if config.sdpa_output_transform is not None:
        raise ConversionError(
            f"{target} has no equivalent of sdpa_output_transform={config.sdpa_output_transform!r} (the paper's "
            "non-gate control); only models without it can be exported."
        )
    if config.gate_position is None:
        return
    what = None
    if config.gate_position != "sdpa":
        what = f"gate_position={config.gate_position!r}: {target} gates only the attention output (G1, 'sdpa')"
    elif config.gate_combine != "multiply":
        what = f"gate_combine={config.gate_combine!r}: {target} multiplies by the gate, it cannot add it"
    elif config.gate_activation != "sigmoid":
        what = (f"gate_activation={config.gate_activation!r}: {target} applies a sigmoid, and "
                f"{config.gate_activation} of a linear map is not the sigmoid of any linear map")
    if what:
        raise ConversionError(f"{target} cannot express this gate ({what}); nothing was written.")


def check_qwen3_5_attention(config: GatedQwenConfig, target: str = "Qwen3.5") -> None:
    """Refuses what Qwen3.5's full-attention layer cannot compute (the attention of Qwen3.5, Qwen3-Next, and
    llama.cpp's and mlx-lm's architectures of the same names): gates other than G1 sigmoid (`check_g1_sigmoid`),
    no q/k norm, sliding-window layers."""
    check_g1_sigmoid(config, target)
    if not config.use_qk_norm:
        raise ConversionError(f"{target} always normalises queries and keys; this model has use_qk_norm=False.")
    sliding = [i for i, t in enumerate(config.layer_types) if t != "full_attention"]
    if sliding:
        raise ConversionError(
            f"{target} has no sliding-window attention; layers {sliding} of this model are "
            f"{config.layer_types[sliding[0]]}."
        )


def check_shared_expert(config: GatedQwenMoeConfig) -> None:
    """Refuses a mixture of experts without a shared expert where the target is Qwen3-Next's (Transformers, vLLM,
    llama.cpp), whose sparse layers always have one."""
    if config.shared_expert_intermediate_size == 0:
        raise ConversionError(
            "Qwen3-Next's sparse layers always have a shared expert; this model has none "
            "(shared_expert_intermediate_size=0), so it has no Qwen3-Next equivalent. Nothing was written."
        )


def exported_bias(config: GatedQwenConfig) -> bool:
    """Whether the export writes q/k/v/o biases: the model's own (`attention_bias`) or a gate bias, whose gate rows
    go into `q_proj` (a target's attention has one bias flag for q, its gate rows, k, v and o)."""
    return bool(config.attention_bias or (config.gate_position is not None and config.gate_bias))


# ------------------------------------------------------------------------------------------------------ the gate
def interleave_rows(queries: torch.Tensor, gates: torch.Tensor, groups: int) -> torch.Tensor:
    """`queries: [H*D, ...]`, `gates: [H*W, ...]` (rows per query head) -> `[groups * (H*D + H*W) / groups, ...]`:
    per group of consecutive heads, its query rows then its gate rows. Qwen3.5 / Qwen3-Next: a group per head
    (`groups=H`, `[q_h | gate_h]`); the release: a group per kv head (`groups=K`)."""
    rest = queries.shape[1:]
    return torch.cat([queries.view(groups, -1, *rest), gates.view(groups, -1, *rest)], dim=1).reshape(-1, *rest)


def g1_gate_rows(tmap: TensorMap, config: GatedQwenConfig, layer: int, width: int, with_bias: bool):
    """The G1 sigmoid gate of `layer` as per-query-head rows: `(weight [H*width, hidden] plan, bias [H*width] plan
    or None, o_proj weight [hidden, H*D] plan)`, for targets that compute `attn * sigmoid(x W)` per head.

    Exact for every G1 sigmoid multiplicative gate: head-shared gates are repeated over the heads and headwise gates
    over the `width` elements of a head when `width` is `head_dim`; an input-independent gate (logits `c`) and an
    ungated layer become zero rows (sigmoid 0.5) with o_proj's columns multiplied by `2·sigmoid(c)` and by 2.
    """
    prefix = f"model.layers.{layer}.self_attn."
    heads, head_dim, hidden = config.num_attention_heads, config.head_dim, config.hidden_size
    rows = heads * width
    gated = layer in gated_layers(config)
    if gated and config.gate_input_dependent:
        g_heads, g_width = gate_shape(config)
        if g_width > width:
            raise ConversionError("an elementwise gate cannot be written as one score per head")  # checked earlier
        weight = tmap.take(prefix + "gate.g_proj.weight", lambda w: w.view(g_heads, g_width, hidden).expand(
            heads, width, hidden).reshape(rows, hidden), shape=(rows, hidden))
        bias = None
        if with_bias and config.gate_bias:
            bias = tmap.take(prefix + "gate.g_proj.bias", lambda b: b.view(g_heads, g_width).expand(
                heads, width).reshape(rows), shape=(rows,))
        elif with_bias:
            bias = zeros((rows,), weight.dtype)
        return weight, bias, tmap.take(prefix + "o_proj.weight")

    # A constant gate: zero rows give sigmoid(0) = 0.5; o_proj's columns absorb 2 * (the constant gate value).
    logits = tmap.take(prefix + "gate.logits") if gated else None  # input-independent: learned [g_heads, g_width]

    def scaled(weight: torch.Tensor) -> torch.Tensor:
        if logits is None:
            return weight * 2  # exact: a power of two
        scale = (2 * torch.sigmoid(logits.make().double())).expand(heads, head_dim).reshape(1, heads * head_dim)
        return (weight.double() * scale).to(weight.dtype)

    o_proj = tmap.take(prefix + "o_proj.weight", scaled)
    return zeros((rows, hidden), o_proj.dtype), zeros((rows,), o_proj.dtype) if with_bias else None, o_proj


def gate_rows_into_q_proj(tmap: TensorMap, config: GatedQwenConfig, layer: int, width: int, groups: int,
                          bias: bool) -> None:
    """Puts `layer`'s G1 gate into `q_proj`: `q_proj.weight [H*D, hidden]` and the gate rows of `g1_gate_rows`
    (`width` a head) -> `interleave_rows` `[H*D + H*width, hidden]` in `groups`, and `o_proj.weight` as
    `g1_gate_rows` gives it; with `bias`, `q_proj.bias` the same way (zeros for a model without one)."""
    attn = f"model.layers.{layer}.self_attn."
    gate_w, gate_b, o_proj = g1_gate_rows(tmap, config, layer, width, with_bias=bias)
    tmap.put(attn + "o_proj.weight", o_proj)
    q_w = tmap.take(attn + "q_proj.weight")
    tmap.put(attn + "q_proj.weight", _interleaved(q_w, gate_w, groups))
    if bias:
        q_b = (tmap.take(attn + "q_proj.bias") if config.attention_bias
               else zeros((config.num_attention_heads * config.head_dim,), q_w.dtype))
        tmap.put(attn + "q_proj.bias", _interleaved(q_b, gate_b, groups))


def _interleaved(queries: TensorPlan, gates: TensorPlan, groups: int) -> TensorPlan:
    return TensorPlan((queries.shape[0] + gates.shape[0], *queries.shape[1:]), queries.dtype,
                      lambda: interleave_rows(queries.make(), gates.make().to(queries.dtype), groups))


def zero_biases(tmap: TensorMap, layer: int, projections: tuple[str, ...]) -> None:
    """Puts a zero bias `[out features]` on each of `layer`'s attention `projections` (e.g. `("k_proj", "v_proj")`):
    where a target's one bias flag covers projections the model has no bias on."""
    attn = f"model.layers.{layer}.self_attn."
    for proj in projections:
        info = tmap.info(attn + f"{proj}.weight")
        tmap.put(attn + f"{proj}.bias", zeros((info.shape[0],), info.dtype))


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> TensorPlan:
    return TensorPlan(shape, dtype, lambda: torch.zeros(shape, dtype=dtype))


# ------------------------------------------------------------------------------------------------------ the norms
def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where a norm weight is shifted by 1, 16-bit weights are stored in float32 so the shift loses nothing."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def to_zero_centred(weight: torch.Tensor) -> torch.Tensor:
    """GatedQwen's RMSNorm weight `[dim]` (the norm computes `x̂·w`) -> Qwen3.5's / Qwen3-Next's zero-centred one
    (`x̂·(1 + w)`): `w - 1`."""
    return weight - 1


def norms(tmap: TensorMap, layer: int | None, zero_centred: bool) -> None:
    """Puts the RMSNorm weights `[dim]` of decoder layer `layer` (None: the final norm), `zero_centred` (Qwen3.5,
    Qwen3-Next: `to_zero_centred`, computed in float32 and kept there for 16-bit weights) or as GatedQwen stores
    them (llama.cpp and mlx-lm compute `x̂·w`)."""
    names = [FINAL_NORM] if layer is None else [f"model.layers.{layer}.{norm}.weight" for norm in LAYER_NORMS]
    for name in names:
        if not zero_centred:
            tmap.put(name, tmap.take(name))
            continue
        dtype = norm_dtype(tmap.info(name).dtype)
        tmap.put(name, tmap.take(name, lambda weight, dtype=dtype: to_zero_centred(weight.float()).to(dtype),
                                 dtype=dtype))


# ------------------------------------------------------------------------------------------------------ the experts
def qwen3_5_attention(tmap: TensorMap, config: GatedQwenConfig, zero_centred: bool,
                      biased: tuple[str, ...] = ("k_proj", "v_proj", "o_proj")) -> None:
    """Every layer's attention as Qwen3.5's reads it (Qwen3.5, Qwen3-Next, mlx-lm, llama.cpp): the G1 gate rows
    interleaved into `q_proj` per head, zero biases on the `biased` projections (llama.cpp's attention has no o_proj
    bias) where only the gate has one (`exported_bias`), and the norms, every layer's and the final one, zero-centred
    or kept (`norms`)."""
    bias = exported_bias(config)
    for layer in range(config.num_hidden_layers):
        gate_rows_into_q_proj(tmap, config, layer, width=config.head_dim, groups=config.num_attention_heads,
                              bias=bias)
        if bias and not config.attention_bias:
            zero_biases(tmap, layer, biased)
        norms(tmap, layer, zero_centred=zero_centred)
    norms(tmap, None, zero_centred=zero_centred)


def stacked_experts(plan: dict[str, TensorPlan], layer: int, num_experts: int) -> dict[str, TensorPlan]:
    """Takes the experts of `layer` out of `plan` (one tensor per expert, `mlp.experts.{e}.{proj}.weight`, as
    `save_pretrained` writes them, or Transformers' stacked `mlp.experts.gate_up_proj [E, 2I, hidden]` and
    `down_proj`) and returns them stacked per projection, as llama.cpp and mlx-lm read them: `{"gate_proj": [E, I,
    hidden], "up_proj": [E, I, hidden], "down_proj": [E, hidden, I]}`."""
    prefix = f"model.layers.{layer}.mlp.experts."
    if prefix + "gate_up_proj" in plan:
        gate_up, down = plan.pop(prefix + "gate_up_proj"), plan.pop(prefix + "down_proj")
        experts, rows, hidden = gate_up.shape
        half = (experts, rows // 2, hidden)
        return {"gate_proj": _rows(gate_up, slice(0, rows // 2), half),
                "up_proj": _rows(gate_up, slice(rows // 2, rows), half), "down_proj": down}
    return {proj: _stacked([plan.pop(f"{prefix}{e}.{proj}.weight") for e in range(num_experts)])
            for proj in ("gate_proj", "up_proj", "down_proj")}


def _stacked(plans: list[TensorPlan]) -> TensorPlan:
    return TensorPlan((len(plans), *plans[0].shape), plans[0].dtype,
                      lambda: torch.stack([plan.make() for plan in plans]))


def _rows(plan: TensorPlan, rows: slice, shape: tuple[int, ...]) -> TensorPlan:
    return TensorPlan(shape, plan.dtype, lambda: plan.make()[:, rows].contiguous())
