"""Checkpoint conversion against independent references: a forward written here from the release layout's documented
index formulas, stock Transformers Qwen3 / Qwen3.5 / Qwen3-Next with the same weights, and byte equality of tensors.
Every refusal is checked for its message and for leaving nothing behind."""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import math
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import randomize_ as randomize_weights_
from helpers import sizes
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

import gated_qwen
from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.cli import main
from gated_qwen.conversion import ConversionError, VerificationError, convert, plans
from gated_qwen.conversion import qwen3 as qwen3_module

TINY = sizes(vocab_size=100, intermediate_size=48)  # the sizes write_release's checkpoints (and their tests) use
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


def assert_nothing_written(dst: Path) -> None:
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")], "temporary folder left behind"


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


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.parametrize("variant", ["baseline", "headwise", "elementwise"])
def test_release_import_matches_independent_forward(tmp_path, variant, kv_heads):
    logical = write_release(tmp_path / "release", variant, kv_heads)
    convert(tmp_path / "release", tmp_path / "gated", from_format="release", verify=False)
    model = load(GatedQwenForCausalLM, tmp_path / "gated")
    config = model.config
    assert config.gate_position == (None if variant == "baseline" else "sdpa")
    assert variant == "baseline" or config.gate_granularity == variant
    assert config.tie_word_embeddings and "lm_head.weight" not in tensors(tmp_path / "gated")
    torch.testing.assert_close(logits(model), release_forward(logical, kv_heads, variant, False, IDS),
                               rtol=1e-5, atol=1e-5)


def test_release_with_qkv_bias_verifies_and_carries_files(tmp_path):
    logical = write_release(tmp_path / "release", "elementwise", 2, qkv_bias=True)
    convert(tmp_path / "release", tmp_path / "gated", from_format="release", verify=True)  # release_logits reference
    model = load(GatedQwenForCausalLM, tmp_path / "gated")
    assert model.config.attention_bias and model.config.gate_bias
    torch.testing.assert_close(logits(model), release_forward(logical, 2, "elementwise", True, IDS),
                               rtol=1e-5, atol=1e-5)
    assert (tmp_path / "gated" / "tokenizer.json").read_text() == '{"model": "tiny"}'
    assert json.loads((tmp_path / "gated" / "generation_config.json").read_text()) == {"do_sample": False}


# The official configuration's default (qiuzh20/gated_attention, configuration_qwen3.py at 49645df, line 167:
# `rope_theta=10000.0`), which a release config.json without the field means: not Qwen3's 1,000,000.
OFFICIAL_ROPE_THETA = 10000.0


def test_a_release_config_without_rope_theta_means_the_official_default(tmp_path):
    """A config.json that leaves rope_theta out is read, by convert and by from_pretrained, with the official code's
    default, checked against the independent forward (which rotates with that theta) and on the config."""
    logical = write_release(tmp_path / "release", "headwise", 2)
    edited = json.loads((tmp_path / "release" / "config.json").read_text())
    del edited["rope_theta"]
    (tmp_path / "release" / "config.json").write_text(json.dumps(edited))
    convert(tmp_path / "release", tmp_path / "gated", from_format="release", verify=False)
    expected = release_forward(logical, 2, "headwise", False, IDS)
    for model in (load(GatedQwenForCausalLM, tmp_path / "gated"), load(GatedQwenForCausalLM, tmp_path / "release")):
        assert model.config.rope_parameters["rope_theta"] == OFFICIAL_ROPE_THETA
        torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant,kv_heads,qkv_bias", [("headwise", 2, False), ("elementwise", 1, True),
                                                       ("baseline", 4, True)])
def test_release_round_trip_is_byte_identical(tmp_path, variant, kv_heads, qkv_bias):
    write_release(tmp_path / "release", variant, kv_heads, qkv_bias=qkv_bias, dtype=torch.bfloat16)
    convert(tmp_path / "release", tmp_path / "gated", from_format="release", verify=False)
    convert(tmp_path / "gated", tmp_path / "back", to_format="release", verify=False)
    before, after = tensors(tmp_path / "release"), tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and before[name].shape == after[name].shape, name
        assert torch.equal(before[name].view(torch.uint8), after[name].view(torch.uint8)), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["headwise_attn_output_gate"], config["elementwise_attn_output_gate"], config["qkv_bias"]) == (
        variant == "headwise", variant == "elementwise", qkv_bias)


def test_release_export_of_other_g1_sigmoid_gates_is_exact(tmp_path):
    """Head-shared, input-independent and partly-gated models have exact release equivalents (rows repeated, or
    zero rows with o_proj columns scaled); checked against the independent forward of the release layout."""
    for i, fields in enumerate([dict(gate_granularity="headwise", gate_shared_across_heads=True),
                                dict(gate_input_dependent=False, gate_layers=[1])]):
        model = randomize_(GatedQwenForCausalLM(GatedQwenConfig(**TINY, tie_word_embeddings=True, **fields)))
        model.save_pretrained(tmp_path / f"gated{i}")
        convert(tmp_path / f"gated{i}", tmp_path / f"release{i}", to_format="release", verify=True)
        w = tensors(tmp_path / f"release{i}")
        heads, kv, d, hidden = 4, 2, 8, 32
        width = 1 if fields.get("gate_granularity") == "headwise" else d
        logical = {"embed": w["model.embed_tokens.weight"], "norm": w["model.norm.weight"], "layers": []}
        for layer in range(2):
            p = f"model.layers.{layer}."
            rows = w[p + "self_attn.q_proj.weight"].view(kv, -1, hidden)  # per kv group: [G*D queries | G*W gates]
            logical["layers"].append(dict(
                wq=rows[:, : 2 * d].reshape(heads, d, hidden), wg=rows[:, 2 * d:].reshape(heads, width, hidden),
                wk=w[p + "self_attn.k_proj.weight"].view(kv, d, hidden), wv=w[p + "self_attn.v_proj.weight"].view(
                    kv, d, hidden), wo=w[p + "self_attn.o_proj.weight"], qn=w[p + "self_attn.q_norm.weight"],
                kn=w[p + "self_attn.k_norm.weight"], ln1=w[p + "input_layernorm.weight"],
                ln2=w[p + "post_attention_layernorm.weight"], gate=w[p + "mlp.gate_proj.weight"],
                up=w[p + "mlp.up_proj.weight"], down=w[p + "mlp.down_proj.weight"]))
        variant = "headwise" if width == 1 else "elementwise"
        torch.testing.assert_close(release_forward(logical, kv, variant, False, IDS), logits(model),
                                   rtol=1e-5, atol=1e-5)


def test_release_refusals(tmp_path):
    write_release(tmp_path / "hw", "headwise", 2)
    config = json.loads((tmp_path / "hw" / "config.json").read_text())
    config.update(headwise_attn_output_gate=False, elementwise_attn_output_gate=True)
    (tmp_path / "hw" / "config.json").write_text(json.dumps(config))
    refuse(r"elementwise variant .*elementwise_attn_output_gate=True.* 64 rows .* has 36 rows, the headwise layout",
           tmp_path / "hw", tmp_path / "out", from_format="release")
    config.update(elementwise_attn_output_gate=False, headwise_attn_output_gate=True, qkv_bias=True)
    (tmp_path / "hw" / "config.json").write_text(json.dumps(config))
    refuse(r"qkv_bias=True, but model.layers.0.self_attn.q_proj.bias is absent", tmp_path / "hw",
           tmp_path / "out", from_format="release")
    refuse(r"--add-gate applies to `--from qwen3`", tmp_path / "hw", tmp_path / "out", from_format="release",
           add_gate="headwise")
    model = GatedQwenForCausalLM(GatedQwenConfig(**TINY, gate_position="value"))
    model.save_pretrained(tmp_path / "g2")
    refuse(r"release format cannot express this gate \(gate_position='value'", tmp_path / "g2", tmp_path / "out",
           to_format="release")


# -------------------------------------------------------------------------------------------- qwen3 -> gated_qwen
@pytest.fixture(scope="module")
def qwen3_sources(tmp_path_factory):
    """Stock Qwen3 checkpoints (without and with attention_bias; the first saved in several shards) and their
    logits."""
    root = tmp_path_factory.mktemp("qwen3")
    out = {}
    for bias in (False, True):
        model = randomize_(Qwen3ForCausalLM(Qwen3Config(**TINY, attention_bias=bias, tie_word_embeddings=False)))
        model.save_pretrained(root / f"bias{bias}", max_shard_size="40KB")
        out[bias] = (root / f"bias{bias}", logits(model))
    return out


def test_qwen3_without_gate_is_exact_and_sharded(qwen3_sources, tmp_path):
    src, reference = qwen3_sources[False]
    assert (src / "model.safetensors.index.json").exists()
    convert(src, tmp_path / "gated", from_format="qwen3", verify=False)
    index = json.loads((tmp_path / "gated" / "model.safetensors.index.json").read_text())
    shard_bytes = [(tmp_path / "gated" / f).stat().st_size for f in set(index["weight_map"].values())]
    largest_in = max(f.stat().st_size for f in src.glob("*.safetensors"))
    assert len(shard_bytes) > 1 and max(shard_bytes) <= largest_in // 2 + 1024  # default: half; 1 KB header slack
    model = load(GatedQwenForCausalLM, tmp_path / "gated")
    assert model.config.gate_position is None
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=1e-6)


ADD_GATE_VARIANTS = [  # (gate fields, source with attention_bias)
    *[(dict(gate_granularity=g, gate_shared_across_heads=s, gate_activation=a), False)
      for g in ("elementwise", "headwise") for s in (False, True) for a in ("sigmoid", "ns_sigmoid")],
    (dict(gate_activation="silu", gate_bias=True), False),
    (dict(gate_activation="identity", gate_bias=True), False),
    (dict(gate_activation="silu", gate_input_dependent=False), False),
    (dict(gate_activation="sigmoid", gate_input_dependent=False, gate_granularity="headwise"), False),
    (dict(gate_combine="add", gate_activation="silu"), False),
    (dict(gate_combine="add", gate_activation="identity", gate_granularity="headwise"), False),
    (dict(gate_combine="add", gate_activation="sigmoid"), True),
    (dict(gate_combine="add", gate_activation="ns_sigmoid", gate_shared_across_heads=True), True),
    (dict(gate_bias=True, gate_layers=[1]), True),
    *[(dict(gate_position=p), True) for p in ("value", "key", "query", "dense")],
    (dict(gate_position="key", gate_combine="add", gate_activation="sigmoid"), True),
]


@pytest.mark.parametrize("fields,bias", ADD_GATE_VARIANTS, ids=lambda v: json.dumps(v) if isinstance(v, dict) else "")
def test_qwen3_add_gate_preserves_logits(qwen3_sources, tmp_path, fields, bias):
    src, reference = qwen3_sources[bias]
    convert(src, tmp_path / "gated", from_format="qwen3", add_gate=json.dumps(fields), verify=False)
    model = load(GatedQwenForCausalLM, tmp_path / "gated")
    assert model.config.gate_position == fields.get("gate_position", "sdpa")
    assert all(getattr(model.config, k) == v for k, v in fields.items())
    torch.testing.assert_close(logits(model), reference, rtol=1e-5, atol=1e-5)


def test_qwen3_add_gate_refusals(qwen3_sources, tmp_path, capsys):
    src = qwen3_sources[False][0]
    refuse(r"multiplicative silu gate with zero weights and no bias outputs silu\(0\) = 0", src, tmp_path / "o",
           from_format="qwen3", add_gate='{"gate_activation": "silu"}')
    refuse(r"multiplicative identity gate", src, tmp_path / "o", from_format="qwen3",
           add_gate='{"gate_activation": "identity", "gate_granularity": "headwise"}')
    refuse(r"additive sigmoid gate adds sigmoid\(x\) > 0 .* bias of v_proj; the source has attention_bias=false",
           src, tmp_path / "o", from_format="qwen3", add_gate='{"gate_combine": "add"}')
    refuse(r"not a variant", src, tmp_path / "o", from_format="qwen3", add_gate="elementwize")
    refuse(r"gate_granularity' expected one of \('elementwise', 'headwise'\), got rowwise", src, tmp_path / "o", from_format="qwen3",
           add_gate='{"gate_granularity": "rowwise"}')
    convert(src, tmp_path / "ok", from_format="qwen3", add_gate="headwise", verify=False)
    assert "appendix A.7" in capsys.readouterr().err


def test_verify_catches_a_wrong_conversion(qwen3_sources, tmp_path, monkeypatch):
    """With the constant gate value not folded into o_proj the logits change; --verify must refuse to publish."""
    src = qwen3_sources[False][0]
    monkeypatch.setattr(qwen3_module, "added_gate_init", lambda config: (0.0, "none", 1.0))
    with pytest.raises(VerificationError, match="logits differ"):
        convert(src, tmp_path / "gated", from_format="qwen3", add_gate="elementwise", verify=True)
    assert_nothing_written(tmp_path / "gated")


# --------------------------------------------------------------------------------------- gated_qwen <-> Qwen3.5
QWEN3_5_EXPORTS = [
    dict(),
    dict(gate_granularity="headwise", attention_bias=True),
    dict(gate_shared_across_heads=True, gate_bias=True),
    dict(gate_input_dependent=False, gate_layers=[0]),
    dict(gate_position=None, num_key_value_heads=1),
]


@pytest.mark.parametrize("fields", QWEN3_5_EXPORTS, ids=lambda v: json.dumps(v))
def test_gated_to_qwen3_5_loads_in_stock_class_and_back(tmp_path, fields):
    config = GatedQwenConfig(**{**TINY, **fields}, tie_word_embeddings=False)
    model = randomize_(GatedQwenForCausalLM(config))
    model.save_pretrained(tmp_path / "gated")
    reference = logits(model)
    convert(tmp_path / "gated", tmp_path / "q35", to_format="qwen3_5", verify=False,
            allow_o_proj_bias=config.attention_bias)
    stock = load(Qwen3_5ForCausalLM, tmp_path / "q35")
    assert set(stock.config.layer_types) == {"full_attention"}
    # vLLM reads the q/k/v bias flag from qkv_bias (tests/serving serves these exports with vLLM)
    assert json.loads((tmp_path / "q35" / "config.json").read_text()).get("qkv_bias", False) == stock.config.attention_bias
    assert stock.config.rope_parameters["partial_rotary_factor"] == 1.0
    torch.testing.assert_close(logits(stock), reference, rtol=1e-5, atol=1e-5)
    convert(tmp_path / "q35", tmp_path / "back", from_format="qwen3_5", verify=False)
    back = load(GatedQwenForCausalLM, tmp_path / "back")
    assert (back.config.gate_position, back.config.gate_granularity) == ("sdpa", "elementwise")
    torch.testing.assert_close(logits(back), reference, rtol=1e-5, atol=1e-5)


def test_stock_qwen3_5_and_dense_qwen3_next_import(tmp_path):
    layers = ["full_attention"] * 2
    q35 = randomize_(Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        **TINY, layer_types=layers, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0})), norm_center=0)
    nxt = randomize_(Qwen3NextForCausalLM(Qwen3NextConfig(
        **TINY, layer_types=layers, mlp_only_layers=[0, 1], num_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0})), norm_center=0)
    for name, model in (("q35", q35), ("next", nxt)):
        model.save_pretrained(tmp_path / name)
        convert(tmp_path / name, tmp_path / f"{name}-gated", from_format="qwen3_5", verify=name == "next")
        gated = load(GatedQwenForCausalLM, tmp_path / f"{name}-gated")
        torch.testing.assert_close(logits(gated), logits(model), rtol=1e-5, atol=1e-5)
        norm = tensors(tmp_path / f"{name}-gated")["model.layers.0.self_attn.q_norm.weight"]
        torch.testing.assert_close(norm, 1 + model.model.layers[0].self_attn.q_norm.weight.detach())


def _config_only(folder: Path, config) -> Path:
    folder.mkdir()
    config.save_pretrained(folder)
    save_file({"model.embed_tokens.weight": torch.zeros(VOCAB, 32)}, folder / "model.safetensors")
    return folder


def test_qwen3_5_refusals(tmp_path):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    refuse(r"layers \[0, 1, 2\] are 'linear_attention'",
           _config_only(tmp_path / "hybrid", Qwen3_5TextConfig(**{**TINY, "num_hidden_layers": 4},
                                                               rope_parameters=rope)),
           tmp_path / "o", from_format="qwen3_5")
    refuse(r"partial_rotary_factor=0.25", _config_only(tmp_path / "partial", Qwen3_5TextConfig(
        **TINY, layer_types=["full_attention"] * 2)), tmp_path / "o", from_format="qwen3_5")
    refuse(r"layers \[1\] of SRC are mixture-of-experts", _config_only(tmp_path / "moe", Qwen3NextConfig(
        **TINY, layer_types=["full_attention"] * 2, mlp_only_layers=[0], num_experts=4, rope_parameters=rope)),
        tmp_path / "o", from_format="qwen3_5")
    refuse(r"model_type='qwen3'; `--from qwen3_5` reads", _config_only(tmp_path / "q3", Qwen3Config(**TINY)),
           tmp_path / "o", from_format="qwen3_5")
    for i, (fields, match) in enumerate([
        (dict(gate_position="query"), r"gates only the attention output"),
        (dict(gate_combine="add", gate_activation="silu"), r"multiplies by the gate, it cannot add it"),
        (dict(gate_activation="ns_sigmoid"), r"ns_sigmoid of a linear map is not the sigmoid"),
        (dict(gate_position=None, sdpa_output_transform="rmsnorm"), r"no equivalent of sdpa_output_transform"),
        (dict(use_qk_norm=False), r"always normalises queries and keys"),
        (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), r"no sliding-window attention"),
    ]):
        GatedQwenForCausalLM(GatedQwenConfig(**TINY, **fields)).save_pretrained(tmp_path / f"g{i}")
        refuse(match, tmp_path / f"g{i}", tmp_path / "o", to_format="qwen3_5")


# ---------------------------------------------------------------------------------- destination, pickle and CLI
def test_destination_overwrite_and_pickle(qwen3_sources, tmp_path, capsys):
    src, reference = qwen3_sources[False]
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    with pytest.raises(ConversionError, match="already exists; pass --overwrite"):
        convert(src, dst, from_format="qwen3", verify=False)
    with pytest.raises(ConversionError, match="gate_granularity"):  # a failing overwrite keeps the old folder
        convert(src, dst, from_format="qwen3", add_gate='{"gate_granularity": "x"}', overwrite=True, verify=False)
    assert (dst / "old.txt").read_text() == "old"
    convert(src, dst, from_format="qwen3", overwrite=True, verify=False)
    assert not (dst / "old.txt").exists()
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in dst.iterdir()} == {0o666 & ~umask}
    assert dst.stat().st_mode & 0o777 == 0o777 & ~umask
    torch.testing.assert_close(logits(load(GatedQwenForCausalLM, dst)), reference, rtol=0, atol=1e-6)
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]  # no temporary or replaced folders left

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((src / "config.json").read_text())
    torch.save(tensors(src), pickled / "pytorch_model.bin")
    refuse(r"pickled PyTorch weights \(pytorch_model.bin\).*--allow-pickle", pickled, tmp_path / "p",
           from_format="qwen3")
    assert main(["convert", str(pickled), str(tmp_path / "p"), "--from", "qwen3", "--no-verify"]) == 2
    assert "--allow-pickle" in capsys.readouterr().err
    assert main(["convert", str(pickled), str(tmp_path / "p"), "--from", "qwen3", "--allow-pickle",
                 "--max-shard-size", "1GB", "--no-verify"]) == 0
    assert (tmp_path / "p" / "model.safetensors").exists()  # one shard: 1 GB holds it all
    torch.testing.assert_close(logits(load(GatedQwenForCausalLM, tmp_path / "p")), reference, rtol=0, atol=1e-6)
    refuse(r"exactly one of --from", src, tmp_path / "x")


# ------------------------------------------------------------------------- bad input: exit 2, one line, nothing written
def cli_refuses(capsys, args: list[str], message: str, dst: Path, code: int = 2) -> str:
    """`gated-qwen ARGS` exits with `code` and one line `gated-qwen: error: ...` that contains `message`, with no
    traceback, and leaves nothing at or beside `dst`. Returns the line."""
    assert main(args) == code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("gated-qwen: error: ")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err
    if dst is not None:
        assert_nothing_written(dst)
    return lines[0]


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def gated_source(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gated") / "g"
    randomize_(GatedQwenForCausalLM(GatedQwenConfig(**TINY))).save_pretrained(folder)
    return folder


def _damage_shard(src: Path, how: str) -> str:
    shard = sorted(src.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if how == "truncate" else b"not a safetensors file at all")
    return shard.name


def _index(src: Path, content) -> None:
    (src / "model.safetensors.index.json").write_text(content if isinstance(content, str) else json.dumps(content))


BAD_SOURCES = {  # name: (damage(src) -> the expected message, format flags)
    "truncated shard": (lambda src: f"{_damage_shard(src, 'truncate')} in SRC is not a readable safetensors file",
                        ["--from", "qwen3"]),
    "corrupt shard": (lambda src: f"{_damage_shard(src, 'garbage')} in SRC is not a readable safetensors file",
                      ["--from", "qwen3"]),
    "index not JSON": (lambda src: _index(src, "{nope") or "model.safetensors.index.json (", ["--from", "qwen3"]),
    "index without weight_map": (lambda src: _index(src, {"metadata": {}}) or "has no `weight_map`",
                                 ["--from", "qwen3"]),
    "index entry absolute": (lambda src: _index(src, {"weight_map": {"x": "/etc/hostname"}})
                             or "names weight files outside the folder (['/etc/hostname'])", ["--from", "qwen3"]),
    "index entry ..": (lambda src: _index(src, {"weight_map": {"x": "../bias=True/model.safetensors"}})
                       or "names weight files outside the folder", ["--from", "qwen3"]),
    "index entry not in its file": (lambda src: edit_json(src / "model.safetensors.index.json", weight_map={
        **json.loads((src / "model.safetensors.index.json").read_text())["weight_map"],
        "model.extra.weight": "model-00001-of-00003.safetensors"})
        or "the index of SRC names tensors that its files do not hold: ['model.extra.weight']", ["--from", "qwen3"]),
    "config not JSON": (lambda src: (src / "config.json").write_text("{") and "config.json (", ["--from", "qwen3"]),
    "config not an object": (lambda src: (src / "config.json").write_text("[1, 2]")
                             and "must hold a JSON object, not a list", ["--from", "qwen3"]),
    "config field type": (lambda src: edit_json(src / "config.json", hidden_size="32")
                          or "Field 'hidden_size' expected int, got str", ["--from", "qwen3"]),
    "shapes vs config (from qwen3)": (lambda src: edit_json(src / "config.json", intermediate_size=40)
                                      or "mlp.gate_proj.weight is [48, 32] where the config implies [40, 32]",
                                      ["--from", "qwen3"]),
    "tensors missing (from qwen3)": (lambda src: edit_json(src / "config.json", num_hidden_layers=3,
                                                               layer_types=["full_attention"] * 3)
                                     or "missing (model.layers.2.", ["--from", "qwen3"]),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_bad_source_is_refused_with_one_line(qwen3_sources, tmp_path, capsys, case):
    damage, flags = BAD_SOURCES[case]
    src = tmp_path / "src"
    shutil.copytree(qwen3_sources[False][0], src)
    message = damage(src)
    for verify in ("--verify", "--no-verify"):
        cli_refuses(capsys, ["convert", str(src), str(tmp_path / "dst"), *flags, verify], message, tmp_path / "dst")


@pytest.mark.parametrize("target", ["qwen3_5", "release"])
def test_export_of_weights_that_do_not_match_their_config_is_refused(gated_source, tmp_path, capsys, target):
    src = tmp_path / "src"
    shutil.copytree(gated_source, src)
    edit_json(src / "config.json", num_key_value_heads=1)
    cli_refuses(capsys, ["convert", str(src), str(tmp_path / "dst"), "--to", target, "--no-verify"],
                "k_proj.weight is [16, 32] where the config implies [8, 32]", tmp_path / "dst")


def test_exports_that_vllm_would_compute_wrongly_are_refused(tmp_path, capsys):
    """An o_proj bias (Qwen3's attention_bias), which vLLM's Qwen3.5 / Qwen3-Next drop without a word, is refused
    naming the native folder and the flag (with the flag: written for stock Transformers, with a warning); a dense
    model to Qwen3-Next, which vLLM refuses, names --to qwen3_5. tests/serving checks vLLM's side."""
    randomize_(GatedQwenForCausalLM(GatedQwenConfig(**TINY, attention_bias=True))).save_pretrained(tmp_path / "bias")
    randomize_(GatedQwenForCausalLM(GatedQwenConfig(**TINY))).save_pretrained(tmp_path / "dense")
    for target in ("qwen3_5", "qwen3_next"):
        cli_refuses(capsys, ["convert", str(tmp_path / "bias"), str(tmp_path / "dst"), "--to", target],
                    "attention_bias=True, an o_proj bias" if target == "qwen3_5" else "--to qwen3_5", tmp_path / "dst")
    line = cli_refuses(capsys, ["convert", str(tmp_path / "dense"), str(tmp_path / "dst"), "--to", "qwen3_next"],
                       "this model is dense", tmp_path / "dst")
    assert "use --to qwen3_5" in line
    cli_refuses(capsys, ["convert", str(tmp_path / "dense"), str(tmp_path / "dst"), "--to", "release",
                         "--allow-o-proj-bias"], "--allow-o-proj-bias applies to --to qwen3_5", tmp_path / "dst")
    assert main(["convert", str(tmp_path / "bias"), str(tmp_path / "q35"), "--to", "qwen3_5", "--allow-o-proj-bias"]) == 0
    assert "warning: Qwen3.5's o_proj bias is written as asked" in capsys.readouterr().err
    assert json.loads((tmp_path / "q35" / "config.json").read_text())["qkv_bias"] is True


def test_bad_destination_is_refused_before_any_work(qwen3_sources, tmp_path, capsys, monkeypatch):
    src = qwen3_sources[False][0]
    args = ["--from", "qwen3", "--no-verify"]
    monkeypatch.setattr(plans, "plan_import", None)  # the work: never reached
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "nowhere")
    cli_refuses(capsys, ["convert", str(src), str(dangling), *args], "is a symlink to", dangling)
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()
    cli_refuses(capsys, ["convert", str(src), str(tmp_path / "no" / "dst"), *args],
                f"The folder {str(tmp_path / 'no')!r} that would hold DST", tmp_path / "x")
    assert not (tmp_path / "no").exists()
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root may write anywhere; answer as the permission bits do for everyone else
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: real_access(path, mode) and Path(path) != read_only)
    cli_refuses(capsys, ["convert", str(src), str(read_only / "dst"), *args],
                f"Cannot write in {str(read_only)!r}", read_only / "dst")
    for size in ("inf", "infGB", "nan", "0", "-2GB", "lots"):
        cli_refuses(capsys, ["convert", str(src), str(tmp_path / "dst"), *args, f"--max-shard-size={size}"],
                    f"--max-shard-size {size!r} is not a size", tmp_path / "dst")


def test_disk_full_removes_the_partial_output_and_keeps_the_old_one(qwen3_sources, tmp_path, capsys, monkeypatch):
    from gated_qwen.conversion import io

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # a partial shard
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    monkeypatch.setattr(io, "save_file", full_disk)
    src, dst = qwen3_sources[False][0], tmp_path / "dst"
    cli_refuses(capsys, ["convert", str(src), str(dst), "--from", "qwen3"],
                f"No space left on the device that holds {str(tmp_path)!r} while writing DST {str(dst)!r}; the "
                "partial output", dst)
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    assert main(["convert", str(src), str(dst), "--from", "qwen3", "--overwrite"]) == 2
    assert "No space left" in capsys.readouterr().err
    assert [p.name for p in dst.iterdir()] == ["old.txt"] and [p.name for p in tmp_path.iterdir()] == ["dst"]


def test_pickled_sources_legacy_format_and_unsafe_content(qwen3_sources, tmp_path, capsys):
    src, reference = qwen3_sources[False]
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(src / "config.json", legacy)
    torch.save(tensors(src), legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert not zipfile.is_zipfile(legacy / "pytorch_model.bin")  # cannot be memory-mapped: read whole instead
    assert main(["convert", str(legacy), str(tmp_path / "out"), "--from", "qwen3", "--allow-pickle"]) == 0
    torch.testing.assert_close(logits(load(GatedQwenForCausalLM, tmp_path / "out")), reference, rtol=0, atol=1e-6)

    unsafe = tmp_path / "unsafe"
    unsafe.mkdir()
    shutil.copy(src / "config.json", unsafe)
    torch.save({**tensors(src), "extra": collections.OrderedDict(a=Path("x"))}, unsafe / "pytorch_model.bin")
    line = cli_refuses(capsys, ["convert", str(unsafe), str(tmp_path / "u"), "--from", "qwen3", "--allow-pickle"],
                       "pytorch_model.bin in SRC cannot be read with torch.load(weights_only=True) (Unsupported "
                       "global: GLOBAL pathlib", tmp_path / "u")
    assert "weights_only=False" not in line


def test_non_finite_source_is_named_as_such(qwen3_sources, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(qwen3_sources[True][0], src)
    weights = tensors(src)
    weights["model.norm.weight"][3] = float("inf")
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    cli_refuses(capsys, ["convert", str(src), str(tmp_path / "dst"), "--from", "qwen3"],
                "the source produces non-finite logits", tmp_path / "dst")


def test_verification_failure_exits_with_1(qwen3_sources, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(qwen3_module, "added_gate_init", lambda config: (0.0, "none", 1.0))
    cli_refuses(capsys, ["convert", str(qwen3_sources[False][0]), str(tmp_path / "dst"), "--from", "qwen3",
                         "--add-gate", "elementwise"], "verification failed", tmp_path / "dst", code=1)


# `--verify`'s tolerance as docs/conversion.md states it: max |logit difference| <= 1e-3 x max(1, max |logit|).
DOCUMENTED_VERIFY_TOLERANCE = 1e-3


@pytest.mark.parametrize("times, verified", [(1.5, False), (0.5, True)], ids=["above", "below"])
def test_verify_holds_a_small_real_error_to_the_documented_tolerance(qwen3_sources, tmp_path, capsys, monkeypatch,
                                                                      times, verified):
    """A converted model whose final norm weight is `1 + eps` times too large (applied as GatedQwenForCausalLM loads
    it): every logit is `1 + eps` times too large (lm_head has no bias), a relative error of eps on any input whose
    max |logit| is at least 1. eps is `times` the documented tolerance, and the error is measured here, on the
    stock Qwen3 source and the perturbed model. 1.5x: refused with exit status 1, nothing written; 0.5x: written."""
    src, reference = qwen3_sources[False]
    eps = times * DOCUMENTED_VERIFY_TOLERANCE
    load_gated = GatedQwenForCausalLM.from_pretrained.__func__

    def load_perturbed(cls, *args, **kwargs):
        loaded = load_gated(cls, *args, **kwargs)
        with torch.no_grad():
            (loaded[0] if isinstance(loaded, tuple) else loaded).model.norm.weight.mul_(1 + eps)
        return loaded

    monkeypatch.setattr(GatedQwenForCausalLM, "from_pretrained", classmethod(load_perturbed))
    assert reference.abs().max() > 1
    error = (logits(load(GatedQwenForCausalLM, src)) - reference).abs().max() / reference.abs().max()
    assert error.item() == pytest.approx(eps, rel=0.02)

    dst = tmp_path / "gated"
    args = ["convert", str(src), str(dst), "--from", "qwen3", "--verify"]
    if verified:
        assert main(args) == 0
        assert f"verified: logits agree to {eps:.2g}" in capsys.readouterr().err
        assert (dst / "config.json").exists()
    else:
        line = cli_refuses(capsys, args, "verification failed", dst, code=1)
        assert f"differ from the source's by {eps:.3g}" in line and "the tolerance is 0.001" in line


# ----------------------------------------------------------------- structure: checked whatever --verify says
def _patched_import(monkeypatch, edit):
    """Every import plan (`plans.plan_import`, what `--from` writes) edited by `edit(plan)` before it is written."""
    original = plans.plan_import

    def planner(*args):
        plan = original(*args)
        edit(plan)
        return plan

    monkeypatch.setattr(plans, "plan_import", planner)


def _patched_export(monkeypatch, name, edit):
    """The export of format `name` (its `Format` in the registry) edited by `edit(plan)` before it is written."""
    from gated_qwen.conversion.formats import FORMATS

    fmt = FORMATS[name]

    def export(ckpt, **options):
        config, plan = fmt.export(ckpt, **options)
        edit(plan)
        return config, plan

    monkeypatch.setitem(FORMATS, name, dataclasses.replace(fmt, export=export))


STRUCTURE_FAULTS = {  # what the fault does to the plan -> the message
    "a tensor missing": (lambda plan: plan.pop("model.layers.1.mlp.down_proj.weight"),
                         "missing (model.layers.1.mlp.down_proj.weight)"),
    "an unexpected tensor": (lambda plan: plan.update(extra=plan["model.norm.weight"]),
                             "1 that the model does not have (extra)"),
    "a wrong shape": (lambda plan: plan.update({"model.norm.weight": plan["model.layers.0.input_layernorm.weight"]
                                               .__class__((16,), torch.float32, lambda: torch.ones(16))}),
                      "model.norm.weight is [16] where the config implies [32]"),
}


@pytest.mark.parametrize("fault", list(STRUCTURE_FAULTS))
def test_incomplete_plans_are_refused_even_without_verification(qwen3_sources, tmp_path, capsys, monkeypatch, fault):
    import gated_qwen.conversion as conversion

    edit, message = STRUCTURE_FAULTS[fault]
    _patched_import(monkeypatch, edit)
    src, dst = qwen3_sources[False][0], tmp_path / "dst"
    cli_refuses(capsys, ["convert", str(src), str(dst), "--from", "qwen3", "--no-verify"], message, dst)
    monkeypatch.setattr(conversion, "VERIFY_MAX_PARAMETERS", 1000)  # default flags, a model above the verify limit
    line = cli_refuses(capsys, ["convert", str(src), str(dst), "--from", "qwen3"], message, dst)
    assert "the converted checkpoint would not match the model its config.json describes" in line


def test_export_plans_are_checked_against_the_stock_class(gated_source, tmp_path, capsys, monkeypatch):
    _patched_export(monkeypatch, "qwen3_5", lambda plan: plan.pop("model.layers.0.self_attn.q_proj.weight"))
    cli_refuses(capsys, ["convert", str(gated_source), str(tmp_path / "dst"), "--to", "qwen3_5", "--no-verify"],
                "missing (model.layers.0.self_attn.q_proj.weight)", tmp_path / "dst")


def test_written_files_and_config_are_checked(qwen3_sources, tmp_path, capsys, monkeypatch):
    import gated_qwen.conversion as conversion
    from gated_qwen.conversion import io

    src, dst = qwen3_sources[False][0], tmp_path / "dst"
    write_json = io.write_json

    def index_without_an_entry(path, data):
        data["weight_map"].pop("model.layers.0.mlp.up_proj.weight")
        write_json(path, data)

    with monkeypatch.context() as patch:
        patch.setattr(io, "write_json", index_without_an_entry)
        cli_refuses(capsys, ["convert", str(src), str(dst), "--from", "qwen3", "--no-verify"],
                    "the written weights differ from the plan at model.layers.0.mlp.up_proj.weight", dst)
    write_config = conversion._write_config

    def config_without_vocab_size(config, folder, result):
        write_config(config, folder, result)
        data = json.loads((folder / "config.json").read_text())
        del data["vocab_size"]
        (folder / "config.json").write_text(json.dumps(data))

    monkeypatch.setattr(conversion, "_write_config", config_without_vocab_size)
    cli_refuses(capsys, ["convert", str(src), str(dst), "--from", "qwen3", "--no-verify"],
                f"model.embed_tokens.weight is [{VOCAB}, 32] where the config implies [151936, 32]", dst)


# ------------------------------------------------------------------------- what convert reads and carries from SRC
def copy_source(qwen3_sources, tmp_path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(qwen3_sources[False][0], src)
    return src


def test_only_regular_files_inside_src_are_read_or_carried(qwen3_sources, tmp_path, capsys):
    """A tokenizer.json that links outside SRC, a pipe named like a tokenizer file, a folder of shards that links
    outside SRC: each refused by name before anything is written. A link that stays inside SRC is carried as a
    regular file with its content."""
    src = copy_source(qwen3_sources, tmp_path)
    (tmp_path / "secret.txt").write_text("someone else's file")
    (src / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    cli_refuses(capsys, ["convert", str(src), str(tmp_path / "dst"), "--from", "qwen3", "--no-verify"],
                f"SRC's file to carry 'tokenizer.json' is '{tmp_path}/secret.txt', outside SRC (through the link "
                "'tokenizer.json')", tmp_path / "dst")
    (src / "tokenizer.json").unlink()
    os.mkfifo(src / "tokenizer_extra.json")
    cli_refuses(capsys, ["convert", str(src), str(tmp_path / "dst"), "--from", "qwen3", "--no-verify"],
                "SRC's file to carry 'tokenizer_extra.json' in SRC is not a regular file (a pipe, socket or device)",
                tmp_path / "dst")
    (src / "tokenizer_extra.json").unlink()

    (src / "originals").mkdir()
    (src / "originals" / "tokenizer.json").write_text('{"model": "tiny"}')
    (src / "tokenizer.json").symlink_to(Path("originals") / "tokenizer.json")
    assert main(["convert", str(src), str(tmp_path / "dst"), "--from", "qwen3", "--no-verify"]) == 0
    assert not (tmp_path / "dst" / "tokenizer.json").is_symlink()
    assert (tmp_path / "dst" / "tokenizer.json").read_text() == '{"model": "tiny"}'

    shards = sorted(p.name for p in src.glob("model-*.safetensors"))
    (tmp_path / "elsewhere").mkdir()
    for name in shards:
        os.rename(src / name, tmp_path / "elsewhere" / name)
    (src / "shards").symlink_to(tmp_path / "elsewhere")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name: f"shards/{file}" for name, file in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    cli_refuses(capsys, ["convert", str(src), str(tmp_path / "dst2"), "--from", "qwen3", "--no-verify"],
                f"the weight file (named by model.safetensors.index.json) 'shards/{shards[0]}' is "
                f"'{tmp_path}/elsewhere/{shards[0]}', outside SRC (through the link 'shards')", tmp_path / "dst2")


def test_a_hugging_face_cache_snapshot_is_read_through_its_links(qwen3_sources, tmp_path, capsys):
    """A snapshot's files are links into its repository's blobs/: those are SRC's own files."""
    repo = tmp_path / "hub" / "models--me--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(qwen3_sources[False][0], snapshot)
    (snapshot / "tokenizer.json").write_text('{"model": "tiny"}')
    (repo / "blobs").mkdir()
    for i, path in enumerate(sorted(snapshot.iterdir())):
        os.rename(path, repo / "blobs" / f"blob{i}")
        path.symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    assert main(["convert", str(snapshot), str(tmp_path / "dst"), "--from", "qwen3"]) == 0
    assert (tmp_path / "dst" / "tokenizer.json").read_text() == '{"model": "tiny"}'


def test_srcs_own_code_is_carried_only_when_asked(qwen3_sources, tmp_path, capsys):
    src = copy_source(qwen3_sources, tmp_path)
    (src / "tokenizer_custom.py").write_text("import os  # someone else's code\n")
    (src / "tokenizer_config.json").write_text('{"auto_map": {"AutoTokenizer": ["tokenizer_custom.Tok", null]}}')
    assert main(["convert", str(src), str(tmp_path / "plain"), "--from", "qwen3", "--no-verify"]) == 0
    assert "not carried: SRC's code files ['tokenizer_custom.py'] (someone else's code; pass --carry-code" in (
        capsys.readouterr().err)
    assert (tmp_path / "plain" / "tokenizer_config.json").exists() and not list((tmp_path / "plain").glob("tok*.py"))
    assert main(["convert", str(src), str(tmp_path / "code"), "--from", "qwen3", "--no-verify", "--carry-code"]) == 0
    assert "carried SRC's code files ['tokenizer_custom.py'] (--carry-code)" in capsys.readouterr().err
    assert (tmp_path / "code" / "tokenizer_custom.py").read_text() == "import os  # someone else's code\n"
    # A gated_qwen SRC's modeling files are this package's own: exported without a word about them.
    assert main(["convert", str(tmp_path / "code"), str(tmp_path / "back"), "--to", "qwen3_5", "--no-verify"]) == 0
    err = capsys.readouterr().err
    assert "not carried: SRC's code files ['tokenizer_custom.py']" in err and "modeling_gated" not in err
    # A file named like one of them in a stock SRC is never carried over the one the conversion writes.
    (src / "modeling_gated.py").write_text("raise SystemExit('not the package')\n")
    assert main(["convert", str(src), str(tmp_path / "named"), "--from", "qwen3", "--no-verify", "--carry-code"]) == 0
    package = Path(gated_qwen.__file__).parent / "modeling_gated.py"
    assert (tmp_path / "named" / "modeling_gated.py").read_text() == package.read_text()


# ------------------------------------------------------------------------- files swapped while convert runs (races)
def swapping_when(monkeypatch, moment: str, swap) -> None:
    """Calls `swap()` while the conversion runs: when the weights start being written (`"start"`: after SRC's
    files were checked and listed, before any tensor is read) or once every shard is written (`"end"`: the weights
    are staged, the carried files not yet copied), at the progress bar the conversion draws (tqdm's, patched: not
    the code under test)."""
    from gated_qwen.conversion import io

    class Bar(io.tqdm):
        def __init__(self, *args, **kwargs):
            if moment == "start":
                swap()
            super().__init__(*args, **kwargs)

        def close(self):
            if moment == "end":
                swap()
            super().close()

    monkeypatch.setattr(io, "tqdm", Bar)


def test_a_weight_file_swapped_for_a_link_mid_run_is_not_read(tmp_path, monkeypatch, capsys):
    """SRC's model.safetensors swapped, while the conversion runs, for a link to another checkpoint of the same shape
    outside SRC: every tensor is read from the file that was checked (opened once), never from the outside one."""
    src, outside = tmp_path / "src", tmp_path / "outside"
    randomize_(Qwen3ForCausalLM(Qwen3Config(**TINY)), seed=1).save_pretrained(src)
    randomize_(Qwen3ForCausalLM(Qwen3Config(**TINY)), seed=2).save_pretrained(outside)
    original = tensors(src)

    def swap():
        os.rename(src / "model.safetensors", tmp_path / "moved.safetensors")
        (src / "model.safetensors").symlink_to(outside / "model.safetensors")

    swapping_when(monkeypatch, "start", swap)
    assert main(["convert", str(src), str(tmp_path / "dst"), "--from", "qwen3", "--no-verify"]) == 0
    assert (src / "model.safetensors").is_symlink()  # the swap happened during the run
    written = tensors(tmp_path / "dst")
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name


def test_a_carried_file_swapped_for_a_link_after_the_weights_is_not_copied(tmp_path, monkeypatch, capsys):
    """tokenizer.json swapped for a link to a secret outside SRC once the weights are staged: DST gets the
    tokenizer.json that was checked (copied through the file it opened then), never the secret."""
    src = tmp_path / "src"
    randomize_(Qwen3ForCausalLM(Qwen3Config(**TINY))).save_pretrained(src)
    (src / "tokenizer.json").write_text('{"model": "tiny"}')
    (tmp_path / "secret.txt").write_text("hf_secret_token")

    def swap():
        (src / "tokenizer.json").unlink()
        (src / "tokenizer.json").symlink_to(tmp_path / "secret.txt")

    swapping_when(monkeypatch, "end", swap)
    assert main(["convert", str(src), str(tmp_path / "dst"), "--from", "qwen3", "--no-verify"]) == 0
    assert (src / "tokenizer.json").is_symlink()
    assert (tmp_path / "dst" / "tokenizer.json").read_text() == '{"model": "tiny"}'


def test_a_model_in_a_sub_folder_of_a_cache_snapshot_is_read_through_its_links(qwen3_sources, tmp_path, capsys):
    """A snapshot that holds several models in sub-folders (as the paper's release is laid out): each sub-folder's
    files link into the repository's blobs/ and are SRC's own, as docs/cli.md says of snapshot links; a link that
    leaves the repository is still refused by name."""
    repo = tmp_path / "hub" / "models--QwQZh--gated_attention"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    for sub in ("1B_baseline", "1B_gate_elementwise"):
        shutil.copytree(qwen3_sources[False][0], snapshot / sub)
        (snapshot / sub / "tokenizer.json").write_text(f'{{"model": "{sub}"}}')
        for i, path in enumerate(sorted((snapshot / sub).iterdir())):
            os.rename(path, repo / "blobs" / f"{sub}-{i}")
            path.symlink_to(Path("..", "..", "..", "blobs", f"{sub}-{i}"))
    assert main(["convert", str(snapshot / "1B_baseline"), str(tmp_path / "dst"), "--from", "qwen3"]) == 0
    assert (tmp_path / "dst" / "tokenizer.json").read_text() == '{"model": "1B_baseline"}'
    (tmp_path / "secret.txt").write_text("someone else's file")
    (snapshot / "1B_baseline" / "tokenizer.json").unlink()
    (snapshot / "1B_baseline" / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    cli_refuses(capsys, ["convert", str(snapshot / "1B_baseline"), str(tmp_path / "dst2"), "--from", "qwen3"],
                f"SRC's file to carry 'tokenizer.json' is '{tmp_path}/secret.txt', outside SRC (through the link "
                "'tokenizer.json')", tmp_path / "dst2")


def test_srcs_code_named_like_a_module_of_this_package_is_srcs_own(qwen3_sources, tmp_path, capsys):
    """SRC's hub.py or cli.py (named like modules of this package that a saved folder does not ship) is SRC's code:
    carried with --carry-code, said to be left behind without it."""
    src = copy_source(qwen3_sources, tmp_path)
    (src / "hub.py").write_text("# someone else's code\n")
    assert main(["convert", str(src), str(tmp_path / "plain"), "--from", "qwen3", "--no-verify"]) == 0
    assert "not carried: SRC's code files ['hub.py'] (someone else's code" in capsys.readouterr().err
    assert not (tmp_path / "plain" / "hub.py").exists()
    assert main(["convert", str(src), str(tmp_path / "code"), "--from", "qwen3", "--no-verify", "--carry-code"]) == 0
    assert "carried SRC's code files ['hub.py'] (--carry-code)" in capsys.readouterr().err
    assert (tmp_path / "code" / "hub.py").read_text() == "# someone else's code\n"


# ------------------------------------------------------------------------------- a missing tensor that holds the gate
def without(folder: Path, name: str) -> None:
    from safetensors.torch import load_file

    weights = load_file(folder / "model.safetensors")
    del weights[name]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_missing_q_proj_that_holds_the_gate_is_named_as_such(tmp_path, capsys):
    """In the release's and Qwen3.5's layouts a layer's gate rows live in its q_proj: without it, convert and
    from_pretrained say that the gate cannot be read (as a missing g_proj of a gated_qwen folder does), not only
    that a tensor is missing; the release's baseline, whose q_proj holds no gate, says it is missing."""
    name = "model.layers.1.self_attn.q_proj.weight"
    gate = f"{name} (which holds layer 1's gate as well as its queries: without it the gate cannot be read)"
    write_release(tmp_path / "release", "elementwise", 2)
    without(tmp_path / "release", name)
    config = Qwen3_5TextConfig(**sizes(TINY, layer_types=["full_attention"] * 2), partial_rotary_factor=1.0)
    Qwen3_5ForCausalLM(config).save_pretrained(tmp_path / "qwen3_5")
    without(tmp_path / "qwen3_5", name)
    write_release(tmp_path / "baseline", "baseline", 2)
    without(tmp_path / "baseline", name)
    for folder, fmt, said in (("release", "release", gate), ("qwen3_5", "qwen3_5", gate),
                              ("baseline", "release", f"1 missing ({name})")):
        cli_refuses(capsys, ["convert", str(tmp_path / folder), str(tmp_path / "dst"), "--from", fmt, "--no-verify"],
                    said, tmp_path / "dst")
        with pytest.raises(ValueError) as refusal:
            GatedQwenForCausalLM.from_pretrained(tmp_path / folder)
        assert said in str(refusal.value)
