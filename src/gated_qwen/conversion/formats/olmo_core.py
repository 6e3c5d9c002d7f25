"""OLMo-core's model checkpoint: torch DCP as its trainer saves it (`stepN/model_and_optim/`, keys `model.blocks.{i}.
attention.w_q.weight`, ...; the model's `TransformerConfig` in `stepN/config.json` under `model`, as its
`ConfigSaverCallback` writes it, or the config dict itself), read and written with `torch.distributed.checkpoint`
alone (`dcp.py`), no OLMo-core installed.

OLMo-core's default (pre-norm) block with per-head QK norm (`use_head_qk_norm`) and an attention gate
(`AttentionConfig.gate = GateConfig(granularity=...)`: `attn * sigmoid(w_g(x))` on the normed input, before
`w_out`) is GatedQwen's G1 gate: `w_g` is `gate.g_proj` (`[heads, hidden]` headwise, `[heads·head_dim, hidden]`
elementwise), `w_q/w_k/w_v/w_out` are `q/k/v/o_proj`, `feed_forward.w1/w3/w2` the gate/up/down projections,
`attention_norm`/`feed_forward_norm` the input/post-attention norms, `lm_head.norm`/`lm_head.w_out` the final norm and
the output layer. Both granularities are read and written natively; `--to olmo_core` writes every other G1 sigmoid
gate exactly (head-shared and input-independent gates, ungated layers: `export_steps.g1_gate_rows`).

Refused, naming the field: a block other than `default` (`reordered_norm`, OLMo 2/3's: its gate reads the un-normed
residual, another function), a mixture of experts, biases, norms other than RMSNorm or with differing epsilons,
QK norm over all heads at once (`use_head_qk_norm=False`), RoPE other than `default`/`fused` without scaling on the
whole head, sliding windows, and what OLMo-core adds to attention (sinks, scalable softmax, clipping, a softmax
scale, per-head norm gains, block overrides).
"""

from __future__ import annotations

import json
import math
from contextlib import closing
from pathlib import Path

import torch

from ...files import read_json_object
from ..dcp import DcpCheckpoint, dcp_files, write_dcp
from ..errors import CheckpointFormatError, ConversionError
from ..export_steps import check_g1_sigmoid, g1_gate_rows, load_gated_config
from ..format_types import FileWriting, Format, OwnModel, Reading
from ..io import Checkpoint, TensorPlan, source_file
from ..plans import TensorMap

NAME = "olmo_core"
MODEL_DIR, PREFIX = "model_and_optim", "model."
# GatedQwen's name of each OLMo-core tensor of a block (`blocks.{i}.`) and outside the blocks.
BLOCK = {"attention.w_q.weight": "self_attn.q_proj.weight", "attention.w_k.weight": "self_attn.k_proj.weight",
         "attention.w_v.weight": "self_attn.v_proj.weight", "attention.w_out.weight": "self_attn.o_proj.weight",
         "attention.w_g.weight": "self_attn.gate.g_proj.weight", "attention.q_norm.weight": "self_attn.q_norm.weight",
         "attention.k_norm.weight": "self_attn.k_norm.weight", "attention_norm.weight": "input_layernorm.weight",
         "feed_forward_norm.weight": "post_attention_layernorm.weight", "feed_forward.w1.weight": "mlp.gate_proj.weight",
         "feed_forward.w3.weight": "mlp.up_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight"}
TOP = {"embeddings.weight": "model.embed_tokens.weight", "lm_head.norm.weight": "model.norm.weight",
       "lm_head.w_out.weight": "lm_head.weight"}
NORMS = ("rms", "fused_rms")
ROPES = ("default", "fused")  # both rotate halves of the head in float32, as GatedQwen does


# ------------------------------------------------------------------------------------------------------ reading
def open_olmo(src: Path, allow_pickle: bool = False) -> DcpCheckpoint:
    """`Reading.open`: SRC's model state (SRC, or its `model_and_optim/`), its `config` OLMo-core's
    `TransformerConfig` dict from SRC's config.json (the trainer's, under `model`, or the dict itself)."""
    folder = src if dcp_files(src) or not dcp_files(src / MODEL_DIR) else src / MODEL_DIR
    for where in (src, folder):
        if (where / "config.json").exists():
            with closing(source_file(where, "config.json", "SRC's")) as file:
                saved = read_json_object(file, "SRC's config.json", ConversionError)
            break
    else:
        raise ConversionError(f"SRC {str(src)!r} has no config.json: OLMo-core's trainer writes the experiment's "
                              "config (its `model`, a TransformerConfig) into each checkpoint folder; give that folder, "
                              "or put TransformerConfig.as_config_dict() as config.json beside the checkpoint.")
    model = saved.get("model", saved)
    if not isinstance(model, dict) or "d_model" not in model:
        raise ConversionError("SRC's config.json holds no OLMo-core TransformerConfig (a `model` object with "
                              "`d_model`, `n_layers`, `block`, ...).")
    if not dcp_files(folder):
        raise ConversionError(f"SRC {str(src)!r} holds no torch distributed checkpoint (.metadata) in it or in "
                              f"{MODEL_DIR}/.")
    ckpt = DcpCheckpoint(folder, {})
    ckpt.config = {"model_type": NAME, **model}
    return ckpt


def _fields(cfg: dict) -> dict:
    """The parts of OLMo-core's TransformerConfig dict that say the model: `(block, attention, norm, mlp, head)`."""
    block = cfg.get("block") or {}
    attention = block.get("sequence_mixer") or block.get("attention") or {}
    return block, attention, block.get("layer_norm") or {}, block.get("feed_forward") or {}, cfg.get("lm_head") or {}


def check_config(cfg: dict) -> None:
    """Refuses, naming the field, what GatedQwen cannot compute."""
    block, attention, norm, mlp, head = _fields(cfg)
    qk_norm, gate, rope = attention.get("qk_norm"), attention.get("gate"), attention.get("rope") or {}
    norms = [n for n in (norm, head.get("layer_norm") or {}, qk_norm or {}) if n]
    refusals = [
        ("block.name", block.get("name", "default"), lambda v: v != "default",
         "GatedQwen is OLMo-core's default pre-norm block (reordered_norm, OLMo 2/3's, gates the un-normed residual)"),
        ("block.feed_forward_moe", block.get("feed_forward_moe"), bool, "mixtures of experts are not mapped"),
        ("block.sequence_mixer.name", attention.get("name", "default"), lambda v: v != "default",
         "GatedQwen's attention is OLMo-core's default one"),
        ("bias", [attention.get("bias"), mlp.get("bias"), head.get("bias")], any, "GatedQwen has no biases here"),
        ("block.feed_forward.activation", mlp.get("activation", "silu"), lambda v: v != "silu", "SwiGLU is silu"),
        ("layer_norm.name", [n.get("name") for n in norms], lambda v: set(v) - set(NORMS), "GatedQwen's norm is RMSNorm"),
        ("layer_norm.eps", [n.get("eps") for n in norms], lambda v: len(set(v)) > 1,
         "GatedQwen has one rms_norm_eps for every norm"),
        ("layer_norm.bias", [n.get("bias") for n in norms], any, "GatedQwen's norms have no bias"),
        ("use_head_qk_norm", attention.get("use_head_qk_norm"), lambda v: qk_norm and not v,
         "QK norm over all heads at once; GatedQwen normalises each head"),
        ("rope.name", rope.get("name"), lambda v: v not in ROPES, f"GatedQwen's RoPE is {ROPES}"),
        ("rope.scaling", rope.get("scaling"), bool, "scaled RoPE is not mapped"),
        ("rope.partial_rotary_factor", rope.get("partial_rotary_factor", 1.0), lambda v: v != 1.0,
         "GatedQwen rotates the whole head"),
        ("gate.full_precision", (gate or {}).get("full_precision", True), lambda v: not v,
         "a gate in 16 bits; GatedQwen's computes it as the attention does"),
        ("block_overrides", cfg.get("block_overrides"), bool, "GatedQwen's layers are alike"),
    ]
    refusals += [(key, attention.get(key), bool, "GatedQwen's attention has no such part") for key in (
        "sliding_window", "attention_sinks", "scalable_softmax", "clip_qkv", "softmax_scale", "qk_norm_per_head_gains")]
    for field, value, refused, why in refusals:
        if refused(value):
            raise CheckpointFormatError(f"{field}={value!r} in SRC's config.json: {why}; nothing was written.")


def config_fields(cfg: dict, gate: dict | None = None) -> dict:
    """GatedQwen's config fields of OLMo-core's TransformerConfig dict (`Reading.config_fields`)."""
    check_config(cfg)
    block, attention, norm, mlp, head = _fields(cfg)
    heads = attention["n_heads"]
    granularity = (attention.get("gate") or {}).get("granularity", "headwise")
    return dict(vocab_size=cfg["vocab_size"], hidden_size=cfg["d_model"], intermediate_size=mlp["hidden_size"],
                num_hidden_layers=cfg["n_layers"], num_attention_heads=heads,
                num_key_value_heads=attention.get("n_kv_heads") or heads,
                head_dim=attention.get("head_dim") or cfg["d_model"] // heads, hidden_act="silu",
                rms_norm_eps=norm.get("eps", 1e-5), tie_word_embeddings=bool(cfg.get("tie_word_embeddings")),
                rope_parameters={"rope_type": "default", "rope_theta": float((attention.get("rope") or {}).get(
                    "theta", 500_000))}, use_qk_norm=attention.get("qk_norm") is not None, attention_bias=False,
                gate_position="sdpa" if attention.get("gate") else None, gate_granularity=granularity,
                dtype=cfg.get("dtype", "float32"))


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """`{name: shape}` of the model state of OLMo-core's model that its TransformerConfig dict `cfg` describes
    (under the trainer's `model.` prefix)."""
    fields = config_fields(cfg)
    hidden, heads, kv, d = (fields[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                 "head_dim"))
    ffn, vocab = fields["intermediate_size"], fields["vocab_size"]
    block = {"attention.w_q.weight": (heads * d, hidden), "attention.w_k.weight": (kv * d, hidden),
             "attention.w_v.weight": (kv * d, hidden), "attention.w_out.weight": (hidden, heads * d),
             "attention_norm.weight": (hidden,), "feed_forward_norm.weight": (hidden,),
             "feed_forward.w1.weight": (ffn, hidden), "feed_forward.w3.weight": (ffn, hidden),
             "feed_forward.w2.weight": (hidden, ffn)}
    if fields["gate_position"]:
        block["attention.w_g.weight"] = (heads * (d if fields["gate_granularity"] == "elementwise" else 1), hidden)
    if fields["use_qk_norm"]:
        block.update({"attention.q_norm.weight": (d,), "attention.k_norm.weight": (d,)})
    out = {"embeddings.weight": (vocab, hidden), "lm_head.norm.weight": (hidden,)}
    if not fields["tie_word_embeddings"]:
        out["lm_head.w_out.weight"] = (vocab, hidden)
    out.update({f"blocks.{i}.{name}": shape for i in range(fields["num_hidden_layers"]) for name, shape in block.items()})
    return {PREFIX + name: shape for name, shape in out.items()}


def gated_name(name: str) -> str | None:
    """GatedQwen's name of an OLMo-core model-state tensor (`model.blocks.3.attention.w_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`), or None for one it does not know."""
    name = name.removeprefix(PREFIX)
    if name in TOP:
        return TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] in BLOCK:
        return f"model.layers.{parts[1]}.{BLOCK[parts[2]]}"
    return None


def plan_import(ckpt: DcpCheckpoint, config) -> dict[str, TensorPlan]:
    """`Reading.plan`: every model tensor renamed (the optimizer's state left out); refuses tensors that the model of
    SRC's config does not have."""
    expected = shapes(ckpt.config)
    plan, unknown = {}, []
    for name, info in ckpt.tensors.items():
        if name.startswith("optim."):
            continue
        if name not in expected:
            unknown.append(name)
            continue
        plan[gated_name(name)] = TensorPlan(info.shape, info.dtype, lambda name=name: ckpt.get(name))
    if unknown:
        raise ConversionError(f"SRC has tensors the OLMo-core model of its config.json does not have: {unknown[:6]}; "
                              "nothing was written.")
    return plan


# ------------------------------------------------------------------------------------------------------ the model
def olmo_logits(ckpt: DcpCheckpoint, input_ids: torch.Tensor) -> torch.Tensor:
    """`input_ids: [B, S]` -> float32 logits `[B, S, vocab]` as OLMo-core's default block computes them, written
    from its layout (the reference of `--verify`; OLMo-core's own forward: `make test-engines`)."""
    fields = config_fields(ckpt.config)
    heads, kv, d, eps = (fields[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps"))
    w = {name.removeprefix(PREFIX): ckpt.get(name).float() for name in shapes(ckpt.config)}
    batch, seq = input_ids.shape
    inv = 1.0 / fields["rope_parameters"]["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x):  # [B, S, N, D]
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    mask = torch.full((seq, seq), float("-inf")).triu(1)
    h = w["embeddings.weight"][input_ids]
    for i in range(fields["num_hidden_layers"]):
        b = f"blocks.{i}."
        x = rms(h, w[b + "attention_norm.weight"])
        q = (x @ w[b + "attention.w_q.weight"].T).view(batch, seq, heads, d)
        k = (x @ w[b + "attention.w_k.weight"].T).view(batch, seq, kv, d)
        v = (x @ w[b + "attention.w_v.weight"].T).view(batch, seq, kv, d)
        if fields["use_qk_norm"]:
            q, k = rms(q, w[b + "attention.q_norm.weight"]), rms(k, w[b + "attention.k_norm.weight"])
        q, k = rope(q).transpose(1, 2), rope(k).repeat_interleave(heads // kv, 2).transpose(1, 2)
        v = v.repeat_interleave(heads // kv, 2).transpose(1, 2)
        att = (((q @ k.transpose(2, 3)) / math.sqrt(d) + mask).softmax(-1) @ v).transpose(1, 2)  # [B, S, H, D]
        if b + "attention.w_g.weight" in w:
            gate = torch.sigmoid(x @ w[b + "attention.w_g.weight"].T).view(batch, seq, heads, -1)
            att = att * gate  # headwise: [B, S, H, 1] broadcast over the head
        h = h + att.reshape(batch, seq, -1) @ w[b + "attention.w_out.weight"].T
        x = rms(h, w[b + "feed_forward_norm.weight"])
        mlp = torch.nn.functional.silu(x @ w[b + "feed_forward.w1.weight"].T) * (x @ w[b + "feed_forward.w3.weight"].T)
        h = h + mlp @ w[b + "feed_forward.w2.weight"].T
    head = w["embeddings.weight"] if fields["tie_word_embeddings"] else w["lm_head.w_out.weight"]
    return rms(h, w["lm_head.norm.weight"]) @ head.T


# ------------------------------------------------------------------------------------------------------ export
def _norm(eps: float) -> dict:
    return {"name": "rms", "eps": eps, "bias": False, "dtype": "float32",
            "_CLASS_": "olmo_core.nn.layer_norm.LayerNormConfig"}


def transformer_config(config) -> dict:
    """OLMo-core's `TransformerConfig.as_config_dict()` of a GatedQwen config (default block)."""
    headwise = config.gate_granularity == "headwise" and not config.gate_shared_across_heads
    attention = {"name": "default", "n_heads": config.num_attention_heads, "n_kv_heads": config.num_key_value_heads,
                 "head_dim": config.head_dim, "bias": False, "dtype": "float32", "use_head_qk_norm": True,
                 "rope": {"name": "default", "theta": config.rope_parameters["rope_theta"], "full_precision": True,
                          "partial_rotary_factor": 1.0, "_CLASS_": "olmo_core.nn.rope.RoPEConfig"},
                 "qk_norm": _norm(config.rms_norm_eps) if config.use_qk_norm else None,
                 "_CLASS_": "olmo_core.nn.attention.AttentionConfig"}
    if config.gate_position is not None:
        attention["gate"] = {"granularity": "headwise" if headwise else "elementwise", "full_precision": True,
                             "_CLASS_": "olmo_core.nn.attention.GateConfig"}
    return {"d_model": config.hidden_size, "vocab_size": config.vocab_size, "n_layers": config.num_hidden_layers,
            "block": {"name": "default", "sequence_mixer": attention, "layer_norm": _norm(config.rms_norm_eps),
                      "feed_forward": {"hidden_size": config.intermediate_size, "name": "default", "bias": False,
                                       "activation": "silu", "_CLASS_": "olmo_core.nn.feed_forward.FeedForwardConfig"},
                      "_CLASS_": "olmo_core.nn.transformer.config.TransformerBlockConfig"},
            "lm_head": {"name": "default", "layer_norm": _norm(config.rms_norm_eps), "bias": False,
                        "dtype": "float32", "_CLASS_": "olmo_core.nn.lm_head.LMHeadConfig"},
            "name": "default", "dtype": "float32", "tie_word_embeddings": config.tie_word_embeddings,
            "_CLASS_": "olmo_core.nn.transformer.config.TransformerConfig"}


def check_exportable(config) -> None:
    check_g1_sigmoid(config, "OLMo-core's attention gate")
    rope = {k: v for k, v in config.rope_parameters.items() if v is not None and k != "partial_rotary_factor"}
    problems = [(config.attention_bias or config.gate_bias, "biases (attention_bias or gate_bias)"),
                (rope.get("rope_type", "default") != "default", f"rope_parameters={config.rope_parameters}"),
                (config.hidden_act != "silu", f"hidden_act={config.hidden_act!r}"),
                (any(t != "full_attention" for t in config.layer_types), "sliding-window layers")]
    for refused, why in problems:
        if refused:
            raise ConversionError(f"--to olmo_core writes OLMo-core's default block, which has no {why}; nothing was "
                                  "written.")


def write(ckpt: Checkpoint, path: Path) -> tuple[int, str]:
    """`FileWriting.write`: the gated_qwen checkpoint as OLMo-core's trainer saves a model: `path/config.json`
    (`{"model": TransformerConfig}`) and `path/model_and_optim/` (torch DCP, `model.` keys, no optimizer state)."""
    config = load_gated_config(ckpt)
    check_exportable(config)
    fields = transformer_config(config)
    width = 1 if fields["block"]["sequence_mixer"].get("gate", {}).get("granularity") == "headwise" else config.head_dim
    tmap, inverse = TensorMap(ckpt), {gated: olmo for olmo, gated in TOP.items()}
    entries = {}
    for i in range(config.num_hidden_layers):
        inverse.update({f"model.layers.{i}.{gated}": f"blocks.{i}.{olmo}" for olmo, gated in BLOCK.items()})
        if config.gate_position is not None:
            gate, _, o_proj = g1_gate_rows(tmap, config, i, width=width, with_bias=False)
            entries[f"{PREFIX}blocks.{i}.attention.w_g.weight"] = gate
            entries[f"{PREFIX}blocks.{i}.attention.w_out.weight"] = o_proj
    for name in tmap.rest():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            tmap.drop(name)
        elif name in inverse:
            entries[PREFIX + inverse[name]] = tmap.take(name)
    tmap.finish()
    (path / MODEL_DIR).mkdir()
    write_dcp(path / MODEL_DIR, entries)
    (path / "config.json").write_text(json.dumps({"model": fields}, indent=1) + "\n")
    return config.vocab_size, f"OLMo-core model state ({len(entries)} tensors) in {MODEL_DIR}/, its config in config.json"


OLMO_CORE = Format(
    NAME, "OLMo-core's model checkpoint (torch DCP, the trainer's model_and_optim/ with its config.json), default "
    "block, headwise or elementwise gate",
    reading=Reading((NAME,), config_fields, detect=lambda config: False, open=open_olmo, plan=plan_import),
    writing=FileWriting(write, lambda path, ids: olmo_logits(open_olmo(path), ids), folder=True),
    model=OwnModel(shapes, olmo_logits))
