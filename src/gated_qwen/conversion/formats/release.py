"""The paper's released checkpoints (`QwQZh/gated_attention`: `1B_baseline`, `1B_gate_headwise`,
`1B_gate_elementwise`) and their official code (`qiuzh20/gated_attention`, `modeling_qwen3.py`).

Layout. `config.json` has `model_type="qwen3"`, `headwise_attn_output_gate` / `elementwise_attn_output_gate`,
`qkv_bias` (a bias on q, k, v and o; `attention_bias` is not read by that code), `use_qk_norm` (default true) and the
legacy `rope_theta` / `rope_scaling`. Weight names are Qwen3's; there is no gate tensor: the gate is extra output rows
of `q_proj`, packed per kv group. With H query heads, K kv heads, G = H / K, head_dim D and gate width W (1 headwise,
D elementwise), `q_proj` has K·(G·D + G·W) rows, and the rows of kv group k are
`[queries of its G heads (G·D rows) | gates of the same G heads (G·W rows)]`; i.e. for head h = k·G + j:
query rows `k·(G·D + G·W) + j·D + [0, D)`, gate rows `k·(G·D + G·W) + G·D + j·W + [0, W)`.
The official code applies `attn_output[B, L, H, D] * sigmoid(gate[B, L, H, W])` before `o_proj`. When both flags are
true it uses headwise (its `if headwise ... elif elementwise`), and so does this reader.

GatedQwen keeps the same weights with the gate rows moved to `self_attn.gate.g_proj` (rows per query head), so the
import is a permutation of rows (`split_release_q_proj`) and the export its inverse (`export_steps.interleave_rows`,
a group per kv head): release -> gated_qwen -> release gives byte-identical tensors.
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.activations import ACT2FN
from transformers.modeling_utils import remove_tied_weights_from_state_dict
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from ..errors import CheckpointFormatError, ConversionError
from ..export_steps import check_g1_sigmoid, exported_bias, gate_rows_into_q_proj, load_gated_config, zero_biases
from ..format_types import Context, FolderWriting, Format, OwnModel, Reading, TensorRule
from ..io import Checkpoint, TensorPlan
from ..plans import TensorMap, copy_rest
from ..shared import QWEN3_FIELDS, source_dtype

# The official configuration's defaults (`configuration_qwen3.py` of qiuzh20/gated_attention).
RELEASE_DEFAULTS = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, head_dim=128, hidden_act="silu", max_position_embeddings=32768, initializer_range=0.02,
    rms_norm_eps=1e-6, use_cache=True, tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None,
    attention_dropout=0.0, use_qk_norm=True, pad_token_id=None, bos_token_id=None, eos_token_id=None,
)
RELEASE_VARIANTS = ("baseline", "headwise", "elementwise")
OFFICIAL_AUTO_MAP = {
    "AutoConfig": "configuration_qwen3.Qwen3Config",
    "AutoModelForCausalLM": "modeling_qwen3.Qwen3ForCausalLM",
}
# Keys of config.json that only the paper's released checkpoints have (a stock Qwen3 config has none of them).
RELEASE_KEYS = ("headwise_attn_output_gate", "elementwise_attn_output_gate", "qkv_bias")


def is_release(config: dict) -> bool:
    """Whether a Qwen3 config.json is the release's: its official code in `auto_map`, or a key only the release
    has."""
    official = any(str(ref).startswith(("configuration_qwen3.", "modeling_qwen3."))
                   for ref in (config.get("auto_map") or {}).values())
    return official or any(k in config for k in RELEASE_KEYS)


def release_variant(config: dict) -> str:
    """`"headwise"`, `"elementwise"` or `"baseline"`, as the official code reads the two flags (headwise first)."""
    if config.get("headwise_attn_output_gate", False):
        return "headwise"
    if config.get("elementwise_attn_output_gate", False):
        return "elementwise"
    return "baseline"


def release_q_rows(heads: int, head_dim: int, variant: str) -> int:
    """Rows of a release `q_proj`: H·D queries plus H (headwise) or H·D (elementwise) gate rows."""
    return heads * head_dim + {"baseline": 0, "headwise": heads, "elementwise": heads * head_dim}[variant]


def release_q_rows_error(name: str, rows: int, heads: int, head_dim: int, variant: str) -> CheckpointFormatError:
    """The error for a release `q_proj` tensor `name` with `rows` rows where the config's `variant` has
    `release_q_rows`: it names the flags, both row counts and the variant whose layout the rows are, if any."""
    flags = {"baseline": "headwise_attn_output_gate and elementwise_attn_output_gate false",
             "headwise": "headwise_attn_output_gate=True", "elementwise": "elementwise_attn_output_gate=True"}
    seen = {release_q_rows(heads, head_dim, v): v for v in RELEASE_VARIANTS}.get(rows)
    return CheckpointFormatError(
        f"config.json describes the release's {variant} variant ({flags[variant]}), whose q_proj has "
        f"{release_q_rows(heads, head_dim, variant)} rows (H={heads}, D={head_dim}), but {name} has {rows} rows"
        + (f", the {seen} layout: fix the gate flags in config.json." if seen else ", which is no release layout.")
    )


def split_release_q_proj(packed: torch.Tensor, kv_heads: int, group_q_rows: int, part: int) -> torch.Tensor:
    """Release `q_proj` rows `packed: [K * (G*D + G*W), ...]` -> the queries `[H*D, ...]` (`part=0`) or the gates
    `[H*W, ...]` (`part=1`), rows per query head."""
    grouped = packed.view(kv_heads, -1, *packed.shape[1:])
    rows = slice(None, group_q_rows) if part == 0 else slice(group_q_rows, None)
    return grouped[:, rows].reshape(-1, *packed.shape[1:])


# ------------------------------------------------------------------------------------------------------ import
def release_config_fields(cfg: dict, gate: dict | None = None) -> dict:
    """GatedQwenConfig fields of a release config.json: the official defaults for what it leaves out, `qkv_bias` as
    the bias of q, k, v, o (and of the gate rows), G1 sigmoid gate of its variant (none for the baseline)."""
    if cfg.get("use_sliding_window", False):
        raise CheckpointFormatError(
            "the release config has use_sliding_window=true; the official code applies the window only with "
            "flash-attention 2 and ignores it otherwise, so which model it describes depends on the backend. "
            "Set use_sliding_window to false in config.json if the model was trained without it."
        )
    fields = {k: cfg.get(k, default) for k, default in RELEASE_DEFAULTS.items()}
    heads, kv_heads = fields["num_attention_heads"], fields["num_key_value_heads"]
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads == 0):
        raise CheckpointFormatError(
            f"num_key_value_heads={kv_heads!r} must divide num_attention_heads={heads!r} in the release config.")
    bias = bool(cfg["qkv_bias"] if "qkv_bias" in cfg else cfg.get("attention_bias", False))
    variant = release_variant(cfg)
    gate = (dict(gate_position=None) if variant == "baseline"
            else dict(gate_position="sdpa", gate_granularity=variant, gate_bias=bias))
    return dict({k: fields[k] for k in QWEN3_FIELDS if k in fields}, rope_theta=fields["rope_theta"],
                rope_scaling=fields["rope_scaling"], attention_bias=bias, use_qk_norm=fields["use_qk_norm"], **gate)


def check_release(cfg: dict, config, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuses release tensors that disagree with the config.json they come with: `q_proj`'s rows against the gate
    flags, biases against `qkv_bias`, q/k norms against `use_qk_norm`."""
    variant = release_variant(cfg)
    heads, head_dim = config.num_attention_heads, config.head_dim
    bias_key = "qkv_bias" if "qkv_bias" in cfg else "attention_bias"
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.self_attn."
        name = prefix + "q_proj.weight"
        if name not in shapes:
            continue  # a missing tensor: the structural check names it
        if shapes[name][0] != release_q_rows(heads, head_dim, variant):
            raise release_q_rows_error(name, shapes[name][0], heads, head_dim, variant)
        if (prefix + "q_proj.bias" in shapes) != config.attention_bias:
            raise CheckpointFormatError(
                f"config.json says {bias_key}={config.attention_bias}, but {prefix}q_proj.bias is "
                f"{'absent from' if config.attention_bias else 'present in'} the weights."
            )
        if (prefix + "q_norm.weight" in shapes) != config.use_qk_norm:
            raise CheckpointFormatError(
                f"config.json says use_qk_norm={config.use_qk_norm} (the official default is true), but "
                f"{prefix}q_norm.weight is {'absent from' if config.use_qk_norm else 'present in'} the weights."
            )


def split_gate_rows(context: Context, packed: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """A gated release's `q_proj` weight or bias -> the queries and the gate rows (the baseline's: unchanged)."""
    if context.config.gate_position is None:
        return {f"self_attn.q_proj.{kind}": packed}
    group_q_rows = context.config.num_attention_heads // context.config.num_key_value_heads * context.config.head_dim
    queries, gates = (split_release_q_proj(packed, context.shard.kv_heads, group_q_rows, part).contiguous()
                      for part in (0, 1))
    return {f"self_attn.q_proj.{kind}": queries, f"self_attn.gate.g_proj.{kind}": gates}


RELEASE_RULES = tuple(TensorRule(f"self_attn.q_proj.{kind}", (f"self_attn.q_proj.{kind}", f"self_attn.gate.g_proj.{kind}"),
                                 lambda context, packed, kind=kind: split_gate_rows(context, packed, kind))
                      for kind in ("weight", "bias"))


def release_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """`{name: shape}` of the weights a release checkpoint with this config.json holds: stock Qwen3's (built on the
    meta device, biases on q, k, v and o with `qkv_bias`), `q_proj` with the gate rows of its variant, and no
    q/k norms with `use_qk_norm=false`."""
    fields = release_config_fields(config)
    shapes = {k: fields[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")}
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**shapes, attention_bias=fields["attention_bias"]))
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    out = {name: tuple(tensor.shape) for name, tensor in state.items()
           if fields["use_qk_norm"] or not name.endswith(("q_norm.weight", "k_norm.weight"))}
    rows = release_q_rows(fields["num_attention_heads"], fields["head_dim"], release_variant(config))
    for name in out:
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            out[name] = (rows, *out[name][1:])
    return out


# ------------------------------------------------------------------------------------------------------ export
def plan_gated_to_release(ckpt: Checkpoint) -> tuple[dict, dict[str, TensorPlan]]:
    config = load_gated_config(ckpt)
    target = "The release format"
    check_g1_sigmoid(config, target)
    if "sliding_attention" in config.layer_types:
        raise ConversionError(
            f"{target} applies a sliding window only under flash-attention 2 (the official code ignores it "
            "otherwise); this model has sliding_attention layers, so no release checkpoint computes it everywhere."
        )
    gated = config.gate_position is not None
    variant = config.gate_granularity if gated else "baseline"
    bias = exported_bias(config)

    tmap = TensorMap(ckpt)
    for layer in range(config.num_hidden_layers):
        if bias and not config.attention_bias:  # the release's qkv_bias puts a bias on q, k, v and o together
            zero_biases(tmap, layer, ("k_proj", "v_proj", "o_proj"))
        if gated:  # the gate rows of each kv group after its queries (`split_release_q_proj` reads them back)
            gate_rows_into_q_proj(tmap, config, layer, width=1 if variant == "headwise" else config.head_dim,
                                  groups=config.num_key_value_heads, bias=bias)
    copy_rest(tmap, config)

    rope = dict(config.rope_parameters)
    rope_theta = rope.pop("rope_theta")
    rope_scaling = None if rope.get("rope_type", "default") == "default" else rope
    out = {k: getattr(config, k) for k in QWEN3_FIELDS if k not in ("rope_parameters", "attention_bias")}
    out.update(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", auto_map=dict(OFFICIAL_AUTO_MAP),
        rope_theta=rope_theta, rope_scaling=rope_scaling, qkv_bias=bias, attention_bias=bias,
        use_qk_norm=config.use_qk_norm, headwise_attn_output_gate=variant == "headwise",
        elementwise_attn_output_gate=variant == "elementwise", use_sliding_window=False, sliding_window=None,
        max_window_layers=config.num_hidden_layers, torch_dtype=source_dtype(ckpt.config),
    )
    return out, tmap.finish()


# ------------------------------------------------------------------------------------------------ reference forward
def release_logits(ckpt: Checkpoint, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a release checkpoint computed as the official code does, in float32 (a reference for `--verify`).

    `input_ids: [B, S]` -> `[B, S, vocab]`. Eager causal attention, no padding, default or scaled RoPE.
    """
    cfg = {**RELEASE_DEFAULTS, **ckpt.config}
    variant = release_variant(cfg)
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    groups = heads // kv_heads
    eps = cfg["rms_norm_eps"]
    w = {name: ckpt.get(name).float() for name in ckpt.tensors}
    rope_config = Qwen3Config(head_dim=head_dim, num_attention_heads=heads, hidden_size=cfg["hidden_size"],
                              max_position_embeddings=cfg["max_position_embeddings"], rope_theta=cfg["rope_theta"],
                              rope_scaling=cfg["rope_scaling"])
    batch, seq = input_ids.shape
    cos, sin = Qwen3RotaryEmbedding(rope_config)(torch.zeros(1), torch.arange(seq)[None])  # [1, S, D]
    cos, sin = cos[:, None], sin[:, None]

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin + x * cos

    def linear(x, name):
        return torch.nn.functional.linear(x, w[name + ".weight"], w.get(name + ".bias"))

    mask = torch.full((seq, seq), float("-inf")).triu(1)
    h = w["model.embed_tokens.weight"][input_ids]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = linear(x, p + "self_attn.q_proj")
        if variant != "baseline":  # view per kv group, split [queries of the group | their gates]
            q = q.view(batch, seq, kv_heads, -1)
            q, gate = q.split([groups * head_dim, q.shape[-1] - groups * head_dim], dim=-1)
            gate = gate.reshape(batch, seq, heads, -1)
        q = q.reshape(batch, seq, heads, head_dim).transpose(1, 2)
        k = linear(x, p + "self_attn.k_proj").view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        v = linear(x, p + "self_attn.v_proj").view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        if cfg["use_qk_norm"]:
            q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rotate(q), rotate(k)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(2, 3)) / head_dim**0.5 + mask
        attn = (scores.softmax(-1) @ v).transpose(1, 2)  # [B, S, H, D]
        if variant != "baseline":
            attn = attn * torch.sigmoid(gate)
        h = h + linear(attn.reshape(batch, seq, -1), p + "self_attn.o_proj")
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        mlp = ACT2FN[cfg["hidden_act"]](linear(x, p + "mlp.gate_proj")) * linear(x, p + "mlp.up_proj")
        h = h + linear(mlp, p + "mlp.down_proj")
    h = rms(h, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return h @ head.T


RELEASE = Format(
    "release", "the paper's released checkpoints (QwQZh/gated_attention); byte-identical round trip",
    reading=Reading(("qwen3",), release_config_fields, detect=is_release, check=check_release, rules=RELEASE_RULES),
    writing=FolderWriting(plan_gated_to_release), model=OwnModel(release_tensor_shapes, release_logits))
