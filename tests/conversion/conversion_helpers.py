"""What the conversion tests share: the tiny sizes, the release layout written from its documented index formulas
and a forward that reads it (`write_release`, `release_forward`: independent of the package), loading, and
`refuse` (convert() raises and leaves nothing behind)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from gated_qwen import GatedQwenForCausalLM
from gated_qwen.conversion import ConversionError, convert
from tests.helpers import TINY, assert_nothing_written
from tests.helpers import randomize_ as randomize_weights_

VOCAB = TINY["vocab_size"]
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def randomize_(model: torch.nn.Module, seed: int = 0, norm_center: float = 1.0) -> torch.nn.Module:
    """The shared randomiser with weights large enough that conversions move logits visibly; norm weights around
    `norm_center` (1 for Qwen3, 0 for zero-centred). Eager attention, as `load` uses."""
    model.set_attn_implementation("eager")
    return randomize_weights_(model, seed, scale=0.15, norm_center=norm_center).eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def gated_logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """The float32 logits of the GatedQwen folder on `input_ids` (what an engine's own forward is held against)."""
    model = GatedQwenForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


def load(cls, folder: Path):
    """`cls.from_pretrained` in float32 / eager, asserting that no key is missing, unexpected or mismatched."""
    model, info = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                      output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    out = {}
    for file in files:
        with safe_open(folder / file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def refuse(match: str, src: Path, dst: Path, **kwargs) -> None:
    with pytest.raises(ConversionError, match=match):
        convert(src, dst, verify=False, **kwargs)
    assert_nothing_written(dst)


# ------------------------------------------------------------------------------------------------ release layout
def write_release(folder: Path, variant: str, kv_heads: int, qkv_bias: bool = False, dtype=torch.float32,
                  seed: int = 0) -> dict:
    """A checkpoint in the layout of the paper's release, built from per-head weights with the documented index
    formulas: for head h = k·G + j, query rows k·(G·D + S) + j·D + [0, D), gate rows k·(G·D + S) + G·D + j·W + [0, W)
    (S = G·W, W = 1 headwise / D elementwise). Returns the per-head ("logical") weights."""
    g = torch.Generator().manual_seed(seed)
    hidden, heads, head_dim, layers = TINY["hidden_size"], TINY["num_attention_heads"], TINY["head_dim"], 2
    mlp = TINY["intermediate_size"]
    groups, width = heads // kv_heads, {"baseline": 0, "headwise": 1, "elementwise": head_dim}[variant]

    def rnd(*shape, center=0.0, scale=0.15):
        return center + scale * torch.randn(*shape, generator=g)

    logical = {"embed": rnd(VOCAB, hidden), "norm": rnd(hidden, center=1.0, scale=0.3), "layers": []}
    out = {"model.embed_tokens.weight": logical["embed"], "model.norm.weight": logical["norm"]}
    for layer in range(layers):
        w = dict(wq=rnd(heads, head_dim, hidden), wg=rnd(heads, width, hidden), wk=rnd(kv_heads, head_dim, hidden),
                 wv=rnd(kv_heads, head_dim, hidden), wo=rnd(hidden, heads * head_dim),
                 bq=rnd(heads, head_dim), bg=rnd(heads, width), bk=rnd(kv_heads, head_dim),
                 bv=rnd(kv_heads, head_dim), bo=rnd(hidden), qn=rnd(head_dim, center=1.0, scale=0.3),
                 kn=rnd(head_dim, center=1.0, scale=0.3), ln1=rnd(hidden, center=1.0, scale=0.3),
                 ln2=rnd(hidden, center=1.0, scale=0.3), up=rnd(mlp, hidden), gate=rnd(mlp, hidden), down=rnd(hidden, mlp))
        logical["layers"].append(w)
        rows = heads * head_dim + heads * width
        q_proj, q_bias = torch.empty(rows, hidden), torch.empty(rows)
        stride = groups * head_dim + groups * width
        for h in range(heads):
            k, j = divmod(h, groups)
            start = k * stride + j * head_dim
            q_proj[start:start + head_dim], q_bias[start:start + head_dim] = w["wq"][h], w["bq"][h]
            if width:
                start = k * stride + groups * head_dim + j * width
                q_proj[start:start + width], q_bias[start:start + width] = w["wg"][h], w["bg"][h]
        p = f"model.layers.{layer}."
        out.update({
            p + "self_attn.q_proj.weight": q_proj, p + "self_attn.k_proj.weight": w["wk"].reshape(-1, hidden),
            p + "self_attn.v_proj.weight": w["wv"].reshape(-1, hidden), p + "self_attn.o_proj.weight": w["wo"],
            p + "self_attn.q_norm.weight": w["qn"], p + "self_attn.k_norm.weight": w["kn"],
            p + "input_layernorm.weight": w["ln1"], p + "post_attention_layernorm.weight": w["ln2"],
            p + "mlp.gate_proj.weight": w["gate"], p + "mlp.up_proj.weight": w["up"],
            p + "mlp.down_proj.weight": w["down"],
        })
        if qkv_bias:
            out.update({p + "self_attn.q_proj.bias": q_bias, p + "self_attn.k_proj.bias": w["bk"].reshape(-1),
                        p + "self_attn.v_proj.bias": w["bv"].reshape(-1), p + "self_attn.o_proj.bias": w["bo"]})
    folder.mkdir()
    save_file({k: v.to(dtype).contiguous() for k, v in out.items()}, folder / "model.safetensors")
    config = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", auto_map={
            "AutoConfig": "configuration_qwen3.Qwen3Config", "AutoModelForCausalLM": "modeling_qwen3.Qwen3ForCausalLM"},
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, hidden_act="silu",
        max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0,
        rope_scaling=None, use_sliding_window=False, qkv_bias=qkv_bias, use_qk_norm=True,
        headwise_attn_output_gate=variant == "headwise", elementwise_attn_output_gate=variant == "elementwise",
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text('{"model": "tiny"}')
    (folder / "generation_config.json").write_text('{"do_sample": false}')
    return logical


def release_forward(logical: dict, kv_heads: int, variant: str, qkv_bias: bool, input_ids: torch.Tensor):
    """The official model's computation from per-head weights (not the conversion code): `[B, S] -> [B, S, V]`."""
    heads, head_dim = TINY["num_attention_heads"], TINY["head_dim"]
    batch, seq = input_ids.shape
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(seq).float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rms(x, w):
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def rope(x):  # [B, heads, S, D]
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    h = logical["embed"][input_ids]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for w in logical["layers"]:
        x = rms(h, w["ln1"])
        zero = dict(bq=torch.zeros(heads, head_dim), bg=torch.zeros(heads, w["wg"].shape[1]), bo=torch.zeros(
            h.shape[-1]), bk=torch.zeros(kv_heads, head_dim), bv=torch.zeros(kv_heads, head_dim))
        b = (lambda name: w[name]) if qkv_bias else zero.get  # noqa: B023 (called within this iteration)
        q = torch.einsum("bsi,hdi->bhsd", x, w["wq"]) + b("bq")[None, :, None]
        k = torch.einsum("bsi,hdi->bhsd", x, w["wk"]) + b("bk")[None, :, None]
        v = torch.einsum("bsi,hdi->bhsd", x, w["wv"]) + b("bv")[None, :, None]
        q, k = rope(rms(q, w["qn"])), rope(rms(k, w["kn"]))
        outs = []
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = q[:, head] @ k[:, kv].transpose(-1, -2) / math.sqrt(head_dim)
            out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, kv]  # [B, S, D]
            if variant != "baseline":
                out = out * torch.sigmoid(x @ w["wg"][head].T + b("bg")[head])  # [B, S, W] broadcasts over D
            outs.append(out)
        h = h + torch.cat(outs, -1) @ w["wo"].T + b("bo")
        x = rms(h, w["ln2"])
        h = h + (F.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T
    return rms(h, logical["norm"]) @ logical["embed"].T


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def copy_source(qwen3_sources, tmp_path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(qwen3_sources[False][0], src)
    return src


