"""The streaming adapter of `gated-qwen convert`: a format (`format.py`) -> a plan, `{output tensor name:
TensorPlan}` that `io.write_weights` computes shard by shard.

An import plan (`plan_import`) applies the format's tensor rules to the source's tensors: each output's shape and
dtype come from running its rule on a `meta` tensor (no data read), its value from running the same rule on the real
tensor when its shard is written; tensors no rule names pass through. An export is planned by the format itself
(`Format.export`), with the bookkeeping and the G1 gate-row helpers below.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..model.configuration_gated import GatedQwenConfig
from ..model.configuration_gated_moe import GatedQwenMoeConfig
from ..model.gating import gate_shape, gated_layers
from ..model.modeling_gated import GatedQwenForCausalLM
from ..model.modeling_gated_moe import GatedQwenMoeForCausalLM
from .errors import ConversionError
from .format import Context, Format, Shard, layer_of, rule_for
from .io import Checkpoint, TensorPlan

# RMSNorm weights of a Qwen3 decoder, relative to `model.` (Qwen3.5 / Qwen3-Next store all of them zero-centred).
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
FINAL_NORM = "model.norm.weight"
CONFIG_CLASSES = {c.model_type: c for c in (GatedQwenConfig, GatedQwenMoeConfig)}


def gated_config(fields: dict):
    """The GatedQwenConfig (or GatedQwenMoeConfig, when `fields` have experts) of an import's config fields."""
    return (GatedQwenMoeConfig if "num_experts" in fields else GatedQwenConfig)(**fields)


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


def plan_import(fmt: Format, ckpt: Checkpoint, config) -> dict[str, TensorPlan]:
    """The tensors of `ckpt` read as the GatedQwen model `config` through the format's rules: each rule's outputs
    (names, shapes and dtypes from the rule run on a meta tensor), the other tensors unchanged, the `ignored` ones
    and a tied `lm_head.weight` left out."""
    with torch.device("meta"):
        model = (GatedQwenMoeForCausalLM if isinstance(config, GatedQwenMoeConfig) else GatedQwenForCausalLM)(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    shard = Shard(config.num_attention_heads, config.num_key_value_heads)
    tmap = TensorMap(ckpt)
    for name in ckpt.tensors:
        rule = rule_for(fmt.rules, name)
        if name.startswith(fmt.ignored):
            tmap.drop(name)
        elif rule is not None:
            prefix = name.removesuffix(rule.source)
            context = Context(config, layer_of(name), shard, lambda target, prefix=prefix: shapes[prefix + target])
            info = tmap.info(name)
            outputs = rule.convert(context, torch.empty(info.shape, dtype=info.dtype, device="meta"))
            tmap.used.add(name)
            for target, output in outputs.items():
                tmap.put(prefix + target, TensorPlan(
                    tuple(output.shape), output.dtype,
                    lambda name=name, rule=rule, context=context, target=target: rule.convert(
                        context, ckpt.get(name))[target]))
    copy_rest(tmap, config)
    return tmap.finish()


class TensorMap:
    """Builds an output plan from a source checkpoint and checks that every source tensor is used exactly once."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.used: set[str] = set()
        self.plan: dict[str, TensorPlan] = {}

    def info(self, name: str):
        if name not in self.ckpt.tensors:
            raise ConversionError(f"SRC has no tensor {name!r}, which this format needs.")
        return self.ckpt.tensors[name]

    def take(self, name: str) -> TensorPlan:
        """The source tensor `name`, unchanged."""
        info = self.info(name)
        self.used.add(name)
        return TensorPlan(info.shape, info.dtype, lambda: self.ckpt.get(name))

    def has(self, name: str) -> bool:
        return name in self.ckpt.tensors

    def get(self, name: str) -> torch.Tensor:
        self.info(name)
        self.used.add(name)
        return self.ckpt.get(name)

    def drop(self, name: str) -> None:
        self.used.add(name)

    def put(self, name: str, plan: TensorPlan) -> None:
        self.plan[name] = plan

    def finish(self) -> dict[str, TensorPlan]:
        unused = sorted(set(self.ckpt.tensors) - self.used)
        if unused:
            more = f" and {len(unused) - 8} more" if len(unused) > 8 else ""
            raise ConversionError(f"SRC has tensors this format does not define: {unused[:8]}{more}.")
        return self.plan


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where a norm weight is shifted by 1, 16-bit weights are stored in float32 so the shift loses nothing."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def shifted_norm(tmap: TensorMap, name: str, shift: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Puts `shift(w)` for the norm weight `name` (`[dim]`), computed in float32 (`qwen3_5.to_zero_centred`)."""
    info = tmap.info(name)
    tmap.used.add(name)
    dtype = norm_dtype(info.dtype)
    tmap.put(name, TensorPlan(info.shape, dtype, lambda: shift(tmap.ckpt.get(name).float()).to(dtype)))


def copy_rest(tmap: TensorMap, config, rename=lambda name: name) -> None:
    """Passes every not yet used tensor through (renamed); a tied `lm_head.weight` is dropped (the model ties it)."""
    for name in tmap.ckpt.tensors:
        if name in tmap.used:
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            tmap.drop(name)  # tied models read the embedding matrix, whatever a saved lm_head holds
            continue
        if name.startswith("model.") or name == "lm_head.weight":
            tmap.put(rename(name), tmap.take(name))
    if not config.tie_word_embeddings and "lm_head.weight" not in tmap.plan:
        raise ConversionError(
            "SRC has no lm_head.weight and tie_word_embeddings is false: the output layer is missing."
        )


def g1_gate_rows(tmap: TensorMap, config: GatedQwenConfig, layer: int, width: int, with_bias: bool):
    """The G1 sigmoid gate of `layer` as per-query-head rows: `(weight [H*width, hidden] plan, bias [H*width] plan
    or None, o_proj weight [hidden, H*D] plan)`, for formats that compute `attn * sigmoid(x W)` per head.

    Exact for every G1 sigmoid multiplicative gate: head-shared gates are repeated over the heads and headwise gates
    over the `width` elements of a head when `width` is `head_dim`; an input-independent gate (logits `c`) and an
    ungated layer become zero rows (sigmoid 0.5) with o_proj's columns multiplied by `2·sigmoid(c)` and by 2.
    """
    prefix = f"model.layers.{layer}.self_attn."
    heads, head_dim, hidden = config.num_attention_heads, config.head_dim, config.hidden_size
    rows = heads * width
    o_info = tmap.info(prefix + "o_proj.weight")
    gated = layer in gated_layers(config)
    if gated and config.gate_input_dependent:
        g_heads, g_width = gate_shape(config)
        if g_width > width:
            raise ConversionError("an elementwise gate cannot be written as one score per head")  # checked earlier
        w_info = tmap.info(prefix + "gate.g_proj.weight")
        tmap.used.add(prefix + "gate.g_proj.weight")
        weight = TensorPlan((rows, hidden), w_info.dtype, lambda: tmap.ckpt.get(prefix + "gate.g_proj.weight").view(
            g_heads, g_width, hidden).expand(heads, width, hidden).reshape(rows, hidden))
        bias = None
        if with_bias and config.gate_bias:
            b_info = tmap.info(prefix + "gate.g_proj.bias")
            tmap.used.add(prefix + "gate.g_proj.bias")
            bias = TensorPlan((rows,), b_info.dtype, lambda: tmap.ckpt.get(prefix + "gate.g_proj.bias").view(
                g_heads, g_width).expand(heads, width).reshape(rows))
        elif with_bias:
            bias = zeros((rows,), w_info.dtype)
        return weight, bias, tmap.take(prefix + "o_proj.weight")

    # A constant gate: zero rows give sigmoid(0) = 0.5; o_proj's columns absorb 2 * (the constant gate value).
    logits_name = prefix + "gate.logits" if gated else None  # input-independent: learned logits [g_heads, g_width]
    if logits_name:
        tmap.info(logits_name)
        tmap.used.add(logits_name)
    tmap.used.add(prefix + "o_proj.weight")

    def o_proj() -> torch.Tensor:
        weight = tmap.ckpt.get(prefix + "o_proj.weight")
        if logits_name is None:
            return weight * 2  # exact: a power of two
        logits = tmap.ckpt.get(logits_name).double()
        scale = (2 * torch.sigmoid(logits)).expand(heads, head_dim).reshape(1, heads * head_dim)
        return (weight.double() * scale).to(weight.dtype)

    dtype = o_info.dtype
    return zeros((rows, hidden), dtype), zeros((rows,), dtype) if with_bias else None, TensorPlan(
        o_info.shape, dtype, o_proj)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> TensorPlan:
    return TensorPlan(shape, dtype, lambda: torch.zeros(shape, dtype=dtype))


def check_g1_sigmoid(config: GatedQwenConfig, target: str) -> None:
    """Refuses gates that a format with a per-head `attn * sigmoid(x W)` gate (Qwen3.5, the release) cannot hold
    (`config`: a dense one, from `load_gated_config`)."""
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
