"""MLX, Apple silicon's array framework, through mlx-lm (and so LM Studio's MLX engine, which runs what mlx-lm runs):
a GatedQwen model as mlx-lm's Qwen3.5 text model (`model_type` `qwen3_5`), a GatedQwen-MoE as its Qwen3-Next
(`qwen3_next`), in the layout `mlx_lm.convert` itself writes, so that `mlx_lm.load(DST, trust_remote_code=True)`
reads it and `mlx_lm.convert --hf-path DST -q --trust-remote-code` quantizes it.

Both architectures' attention is GatedQwen's G1 gate (`q_proj` holds `[q_h | gate_h]` per head, the attention output
is multiplied by `sigmoid(gate)` before `o_proj`): the export composes the steps of `export_steps.py` as `--to
qwen3_5` does (every G1 sigmoid gate written exactly as elementwise gate rows, and that export's refusals). Neither of
this project's Transformers exports is read by mlx-lm as it is, and `--to mlx` writes what it needs instead:

- `model_type`: mlx-lm 0.32 has no `qwen3_5_text` (the `--to qwen3_5` folder's type); its `qwen3_5` module reads a
  text config without `text_config` as the text model, and its parameter names (`language_model.model.layers...`,
  what `mlx_lm.convert` saves) are written.
- Which layers are attention: mlx-lm goes by `full_attention_interval` alone (`layer_types` is not read): 1.
- The norms: mlx-lm's RMSNorm computes `x̂·w`, and it adds the 1 that Qwen3.5 checkpoints leave out only when it
  meets a Gated DeltaNet convolution to rearrange (Qwen3.5) or per-expert tensors to stack (Qwen3-Next), neither of
  which this layout has: the weights are GatedQwen's, unshifted.
- Qwen3-Next's `rope_theta` and `partial_rotary_factor` are top-level fields there (the `--to qwen3_next` folder keeps
  them in Transformers' `rope_parameters`: mlx-lm refuses it, "missing 2 required positional arguments"); the experts
  are stacked per projection (`mlp.switch_mlp.{gate,up,down}_proj.weight`, `[experts, out, in]`).
- A mixture of experts without a shared expert (Qwen3-MoE's kind, the paper's) gets a zero one of width 1: its
  down projection is zero, so it adds exactly 0 (mlx-lm's Qwen3-Next always has a shared expert).
- The model file (`MODEL_FILE`, named by config.json's `model_file`, mlx-lm's way to run a folder's own code, with
  `trust_remote_code=True`): mlx-lm's own class with one fix. Its Qwen3.5 and Qwen3-Next build a linear-attention
  mask from the first layer's cache whatever that layer is (`ssm_idx = 0`), which fails at the first generation
  step with a KV cache when no layer is linear; the file sets that index to None, as mlx-lm's `pipeline()` does.
  `tests/engine_mlx` holds a strict expected failure that passes the day mlx-lm generates without it.

Refused, besides the export's refusals (other gate positions, additive gates, other activations,
`sdpa_output_transform`, sliding-window layers, `use_qk_norm=False`): RoPE other than the default, linear and YaRN
(`ROPE_FIELDS`: mlx-lm computes those as Transformers does, and ignores YaRN's `attention_factor` and `truncate`), and
an activation other than SiLU (mlx-lm's MLP is SwiGLU). `--verify` reads the written tensors back into stock
Transformers `Qwen3_5ForCausalLM` / `Qwen3NextForCausalLM` (`mlx_logits`); what mlx-lm itself computes is what
`make test-mlx` checks (tests/engine_mlx).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig

from ...model.configuration_gated_moe import GatedQwenMoeConfig
from ..errors import ConversionError, VerificationError
from ..export_steps import (
    check_qwen3_5_attention,
    exported_bias,
    load_gated_config,
    qwen3_5_attention,
    stacked_experts,
    zeros,
)
from ..format_types import FolderWriting, Format, OwnModel
from ..io import Checkpoint, TensorPlan
from ..plans import TensorMap, copy_rest

DENSE, MOE = "qwen3_5", "qwen3_next"  # mlx-lm's model modules
MODEL_FILE = "gated_qwen_mlx.py"  # config.json's `model_file`: the module mlx-lm builds the model from
# The model file: mlx-lm's own class, with the one fix an all-attention model needs (see the module docstring).
MODEL_CODE = '''"""mlx-lm's {title} for a folder whose every layer is full attention, written by `gated-qwen convert
--to mlx` (docs/local.md of gated-qwen). mlx-lm 0.32 builds a linear-attention mask from the first layer's cache
whatever that layer is (`ssm_idx = 0`), which fails at the first step with a KV cache when no layer is linear
(TypeError in create_attention_mask); this sets the index to None, as mlx-lm's own `pipeline()` does for a rank
without linear layers. Everything else is mlx-lm's."""

from mlx_lm.models.{module} import Model as Base
from mlx_lm.models.{module} import ModelArgs  # noqa: F401  (mlx-lm reads ModelArgs from this module)


class Model(Base):
    def __init__(self, args):
        super().__init__(args)
        self.{text_model}.ssm_idx = None
'''
PREFIX = {DENSE: "language_model.", MOE: ""}  # what mlx-lm's Qwen3.5 nests its text model under
# The RoPE mlx-lm computes as Transformers does (`mlx_lm.models.rope_utils.initialize_rope`), by rope_type, with the
# fields it reads: others it ignores (YaRN's `attention_factor`, `truncate`; `mscale` alone means another scale).
ROPE_FIELDS = {"default": ("rope_type", "rope_theta"), "linear": ("rope_type", "rope_theta", "factor"),
               "yarn": ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                        "beta_slow")}


# ------------------------------------------------------------------------------------------------------ config
def check_mlx_can_run(config) -> None:
    """The refusals of mlx-lm's architectures beyond those of the Qwen3.5 export."""
    rope = rope_parameters(config)
    if rope["rope_type"] not in ROPE_FIELDS:
        raise ConversionError(f"rope_parameters has rope_type={rope['rope_type']!r}; --to mlx writes RoPE of the types "
                              f"mlx-lm computes as Transformers does ({', '.join(ROPE_FIELDS)}); nothing was written.")
    extra = sorted(set(rope) - set(ROPE_FIELDS[rope["rope_type"]]))
    if extra:
        raise ConversionError(f"rope_parameters has {extra}, which mlx-lm's {rope['rope_type']} RoPE does not read "
                              "(it would compute another model); nothing was written.")
    if config.hidden_act != "silu":
        raise ConversionError(f"hidden_act={config.hidden_act!r}: mlx-lm's Qwen3.5 / Qwen3-Next MLP is SwiGLU (silu); "
                              "nothing was written.")


def rope_parameters(config) -> dict:
    """The model's RoPE fields, its type named (`default` when none is)."""
    rope = {k: v for k, v in config.rope_parameters.items() if v is not None and k != "partial_rotary_factor"}
    return {"rope_type": "default", **rope}


def mlx_config(config, moe: bool) -> dict:
    """config.json of the mlx-lm folder for the GatedQwen (or GatedQwen-MoE, `moe`) config: the fields mlx-lm's
    `qwen3_5` / `qwen3_next` read, every layer full attention."""
    layers = config.num_hidden_layers
    fields = {k: getattr(config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")}
    rope = {**rope_parameters(config), "partial_rotary_factor": 1.0}
    fields.update(model_type=MOE if moe else DENSE, model_file=MODEL_FILE, attention_bias=exported_bias(config),
                  full_attention_interval=1, layer_types=["full_attention"] * layers, rope_parameters=rope)
    if moe:
        sparse = config.sparse_layers
        fields.update(rope_theta=rope["rope_theta"], partial_rotary_factor=1.0, num_experts=config.num_experts,
                      rope_scaling=rope if rope["rope_type"] != "default" else None,
                      num_experts_per_tok=config.num_experts_per_tok,
                      moe_intermediate_size=config.moe_intermediate_size,
                      shared_expert_intermediate_size=config.shared_expert_intermediate_size or 1,
                      norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(layers) if i not in sparse],
                      # Gated DeltaNet sizes, which mlx-lm requires and no layer uses (Qwen3-Next's own)
                      linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_conv_kernel_dim=4)
    return fields


def model_file(config: dict) -> dict[str, str]:
    """`{MODEL_FILE: its code}` for the folder's config.json (`FolderWriting.files`)."""
    title, text_model = (("Qwen3.5 text model", "language_model.model") if config["model_type"] == DENSE
                         else ("Qwen3-Next", "model"))
    return {MODEL_FILE: MODEL_CODE.format(title=title, module=config["model_type"], text_model=text_model)}


def mlx_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """`{name: shape}` of the parameters mlx-lm's `qwen3_5` / `qwen3_next` model has for this config.json (every
    layer full attention), under the names `mlx_lm.convert` saves."""
    hidden, heads, kv, d = (config[k] for k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    prefix, moe = PREFIX[config["model_type"]], config["model_type"] == MOE
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for layer in range(config["num_hidden_layers"]):
        attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        shapes.update({attn + "q_proj.weight": (2 * heads * d, hidden), attn + "k_proj.weight": (kv * d, hidden),
                       attn + "v_proj.weight": (kv * d, hidden), attn + "o_proj.weight": (hidden, heads * d),
                       attn + "q_norm.weight": (d,), attn + "k_norm.weight": (d,),
                       f"model.layers.{layer}.input_layernorm.weight": (hidden,),
                       f"model.layers.{layer}.post_attention_layernorm.weight": (hidden,)})
        if config["attention_bias"]:
            shapes.update({attn + "q_proj.bias": (2 * heads * d,), attn + "k_proj.bias": (kv * d,),
                           attn + "v_proj.bias": (kv * d,), attn + "o_proj.bias": (hidden,)})
        if moe and layer not in config["mlp_only_layers"]:
            experts, inner, shared = (config[k] for k in ("num_experts", "moe_intermediate_size",
                                                          "shared_expert_intermediate_size"))
            shapes.update({mlp + "gate.weight": (experts, hidden), mlp + "shared_expert_gate.weight": (1, hidden),
                           mlp + "switch_mlp.gate_proj.weight": (experts, inner, hidden),
                           mlp + "switch_mlp.up_proj.weight": (experts, inner, hidden),
                           mlp + "switch_mlp.down_proj.weight": (experts, hidden, inner)})
            shapes.update(_mlp_shapes(mlp + "shared_expert.", hidden, shared))
        else:
            shapes.update(_mlp_shapes(mlp, hidden, config["intermediate_size"]))
    return {prefix + name: shape for name, shape in shapes.items()}


def _mlp_shapes(prefix: str, hidden: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inner, hidden), prefix + "up_proj.weight": (inner, hidden),
            prefix + "down_proj.weight": (hidden, inner)}


# ------------------------------------------------------------------------------------------------------ export
def _stacked_experts(plan: dict[str, TensorPlan], layer: int, num_experts: int) -> dict[str, TensorPlan]:
    """The experts of `layer` in `plan` as mlx-lm's `switch_mlp` projections `[experts, out, in]`."""
    return {f"model.layers.{layer}.mlp.switch_mlp.{proj}.weight": tensor
            for proj, tensor in stacked_experts(plan, layer, num_experts).items()}


def _zero_shared_expert(config, layer: int, dtype: torch.dtype) -> dict[str, TensorPlan]:
    """A shared expert of width 1 whose down projection is zero (it adds exactly 0), with a zero gate."""
    prefix, hidden = f"model.layers.{layer}.mlp.", config.hidden_size
    return {prefix + "shared_expert.gate_proj.weight": zeros((1, hidden), dtype),
            prefix + "shared_expert.up_proj.weight": zeros((1, hidden), dtype),
            prefix + "shared_expert.down_proj.weight": zeros((hidden, 1), dtype),
            prefix + "shared_expert_gate.weight": zeros((1, hidden), dtype)}


def plan_gated_to_mlx(ckpt: Checkpoint) -> tuple[dict, dict[str, TensorPlan]]:
    """`(config.json, {name: TensorPlan})` of the mlx-lm folder of the gated_qwen / gated_qwen_moe checkpoint:
    Qwen3.5's attention (the G1 gate rows interleaved into `q_proj` per head, zero k/v/o biases where only the gate
    has one) with GatedQwen's own norm weights, the experts stacked, under mlx-lm's names."""
    config = load_gated_config(ckpt, moe=True)
    moe = isinstance(config, GatedQwenMoeConfig)
    check_mlx_can_run(config)
    check_qwen3_5_attention(config)
    tmap = TensorMap(ckpt)
    qwen3_5_attention(tmap, config, zero_centred=False)  # mlx-lm computes an o_proj bias too
    copy_rest(tmap, config)
    plan = tmap.finish()
    fields = mlx_config(config, moe)
    if moe:
        dtype = ckpt.tensors["model.embed_tokens.weight"].dtype
        for layer in range(config.num_hidden_layers):
            if layer in fields["mlp_only_layers"]:
                continue
            plan.update(_stacked_experts(plan, layer, config.num_experts))
            if not config.shared_expert_intermediate_size:
                plan.update(_zero_shared_expert(config, layer, dtype))
    prefix = PREFIX[fields["model_type"]]
    return fields, {prefix + name: tensor for name, tensor in plan.items()}


# ------------------------------------------------------------------------------------------------------ --verify
def stock_model(config: dict):
    """The stock Transformers model (float32, eager attention, random weights) that computes what mlx-lm computes
    for this config.json: `Qwen3_5ForCausalLM` or `Qwen3NextForCausalLM`, every layer full attention."""
    common = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                                     "max_position_embeddings", "tie_word_embeddings", "attention_bias",
                                     "layer_types", "rope_parameters")}
    if config["model_type"] == DENSE:
        stock = Qwen3_5TextConfig(**common)
    else:
        stock = Qwen3NextConfig(**common, **{k: config[k] for k in (
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")})
    return AutoModelForCausalLM.from_config(stock, attn_implementation="eager", dtype=torch.float32)


def stock_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The mlx-lm folder's tensors as the state dict of `stock_model`: the prefix dropped, the norms zero-centred
    (Qwen3.5's `x̂·(1 + w)`), the experts as Transformers' `gate_up_proj` / `down_proj`."""
    prefix = PREFIX[ckpt.config["model_type"]]
    data = {name.removeprefix(prefix): ckpt.get(name).float() for name in ckpt.tensors}
    state = {}
    for name, tensor in data.items():
        if ".switch_mlp." in name:
            experts = name.split("switch_mlp.")[0] + "experts."
            if name.endswith("down_proj.weight"):
                state[experts + "down_proj"] = tensor
            elif name.endswith("gate_proj.weight"):
                state[experts + "gate_up_proj"] = torch.cat([tensor, data[name.replace("gate_proj", "up_proj")]], 1)
        elif name.endswith("norm.weight"):
            state[name] = tensor - 1
        else:
            state[name] = tensor
    return state


def mlx_logits(ckpt: Checkpoint, input_ids: torch.Tensor) -> torch.Tensor:
    """`input_ids: [B, S]` -> float32 logits `[B, S, vocab]` of an mlx-lm folder, read as what mlx-lm's Qwen3.5 /
    Qwen3-Next compute (`stock_model` with `stock_state`): the `--verify` of `--to mlx`. What mlx-lm itself computes
    from the folder is checked by `make test-mlx`."""
    model = stock_model(ckpt.config)
    missing, unexpected = model.load_state_dict(stock_state(ckpt), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if ckpt.config["tie_word_embeddings"] else set()):
        raise VerificationError(f"the MLX folder's tensors do not fill {type(model).__name__}: missing {missing[:4]}, "
                                f"unexpected {unexpected[:4]}. Nothing was written.")
    model.tie_weights()
    with torch.no_grad():
        return model.eval()(input_ids).logits.float()


MLX = Format(
    "mlx", "a folder for mlx-lm (and LM Studio's MLX engine): its Qwen3.5 (Qwen3-Next for the mixture of experts), "
    "every layer full attention, G1 sigmoid gates (docs/local.md)",
    writing=FolderWriting(plan_gated_to_mlx, files=model_file), model=OwnModel(mlx_tensor_shapes, mlx_logits))
