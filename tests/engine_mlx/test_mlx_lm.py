"""GatedQwen models in mlx-lm 0.32.2 (mlx 0.32.4, CPU backend), held against Transformers (docs/local.md).

- `gated-qwen convert --to mlx` of tiny models of every variant mlx-lm expresses, loaded with `mlx_lm.load`: every
  position's logits of three prompts within 1e-3 of Transformers' (float32, relative to max(1, max |logit|), the
  tolerance llama.cpp meets in tests/engine_llama) and the greedy tokens of `mlx_lm.stream_generate` (its KV cache) equal
  to Transformers' `generate`; each gated model farther than that from the same weights without the gate.
- `mlx_lm.convert -q` (4-bit) and `--dtype bfloat16` of a briefly trained model: perplexity on held-out text with
  mlx-lm's own `eval_ppl`, beside the float32 folder's, which equals Transformers' perplexity.
- The Transformers exports as they are: mlx-lm reads neither (why `--to mlx` exists).
"""

import json
import subprocess
import sys

import numpy as np
import pytest

mlx_lm = pytest.importorskip("mlx_lm", reason="needs mlx-lm: make test-mlx (.venv-mlx)")

import mlx.core as mx  # noqa: E402

from gated_qwen.conversion import convert  # noqa: E402
from gated_qwen.conversion.export_steps import check_qwen3_5_attention  # noqa: E402
from tests.helpers import text_file, tiny_tokenizer, written_gates  # noqa: E402
from tests.local_models import (  # noqa: E402
    MOE,
    NEW_TOKENS,
    PROMPTS,
    build,
    parity_test,
    train,
    transformers_perplexity,
    windows,
)

# name -> config fields besides local_models.SIZES: every gate `--to mlx` writes (the G1 sigmoid gates and none; it
# refuses the others with check_qwen3_5_attention), then what else mlx-lm's architectures hold
CASES = written_gates(check_qwen3_5_attention) | {
    "g1_gate_layers": dict(gate_layers=[1]),
    "attention_bias": dict(attention_bias=True),  # Qwen3's q/k/v/o biases: mlx-lm's attention has all four
    "g1_head_dim_16_tied_yarn": dict(head_dim=16, tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}),
    "moe_g1": dict(MOE),
    "moe_g1_headwise": dict(MOE, gate_granularity="headwise"),
    "moe_no_shared_expert": dict(MOE, shared_expert_intermediate_size=0, norm_topk_prob=False),  # Qwen3-MoE's kind
    "moe_dense_layer_linear_rope": dict(MOE, mlp_only_layers=[0], rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "moe_yarn": dict(MOE, rope_parameters={  # Qwen3-Next reads rope_scaling, not rope_parameters: see it written
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}),
}


def mlx_answer(folder, prompts=PROMPTS, new_tokens=NEW_TOKENS) -> dict:
    """mlx-lm's logits `[positions, vocab]` per prompt (one call on the whole prompt) and greedy tokens from
    `stream_generate` (prefill, then one token at a time with its KV cache; it stops before an EOS token)."""
    model, tokenizer = mlx_lm.load(str(folder), trust_remote_code=True)  # the folder's model file
    logits, greedy = [], []
    for prompt in prompts:
        logits.append(np.array(model(mx.array([prompt])).astype(mx.float32))[0])
        greedy.append([r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=new_tokens)])
    return {"logits": logits, "greedy": greedy, "eos": tokenizer.eos_token_ids}


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return next((tokens[:i] for i, token in enumerate(tokens) if token in eos), tokens)


def not_stopped_at_once_by_an_eos(case, ran):
    assert sum(map(len, ran["greedy"])) > NEW_TOKENS


# mlx_lm.load reads the tokenizer beside the weights; stream_generate stops before an EOS token.
cases, test_mlx_lm_computes_transformers_logits_and_greedy_tokens = parity_test(
    "mlx-lm", "mlx", CASES, mlx_answer, tokenizer=True,
    expected_greedy=lambda ran, reference: [until_eos(tokens, ran["eos"]) for tokens in reference["greedy"]],
    also=not_stopped_at_once_by_an_eos)


def test_the_folder_has_mlx_lms_architecture_and_layout(cases):
    """mlx-lm builds its Qwen3.5 for a dense model and its Qwen3-Next for a mixture of experts, every layer
    attention, and the folder's tensors are exactly its parameters (mlx_lm.load is strict)."""
    from mlx_lm.models import qwen3_5, qwen3_next
    from mlx_lm.utils import load_model

    for name, module, layer_type in [("G1-elementwise", qwen3_5, qwen3_5.DecoderLayer),
                                     ("moe_g1", qwen3_next, qwen3_next.Qwen3NextDecoderLayer)]:
        model, config = load_model(cases[name]["converted"], trust_remote_code=True)
        assert type(model).__bases__ == (module.Model,) and config["full_attention_interval"] == 1
        assert all(type(layer) is layer_type and not layer.is_linear for layer in model.layers)


class MlxLmFailed(Exception):
    """mlx-lm's Qwen3.5 / Qwen3-Next failed as the model file's docstring describes."""


@pytest.mark.xfail(strict=True, raises=MlxLmFailed, reason=(
    "mlx-lm 0.32.2's Qwen3.5 and Qwen3-Next build a linear-attention mask from the first layer's cache whatever that "
    "layer is (ssm_idx = 0): with no linear layer, create_ssm_mask calls a KVCache's make_mask and the first "
    "generation step fails (TypeError in create_attention_mask). `--to mlx` ships a model file that sets the index "
    "to None; this passes the day mlx-lm generates without it (then drop the file: conversion/formats/mlx.py)."))
@pytest.mark.parametrize("name", ["G1-elementwise", "moe_g1"])
def test_mlx_lm_generates_without_the_model_file(cases, tmp_path, name):
    import shutil

    folder = shutil.copytree(cases[name]["converted"], tmp_path / "plain")
    config = json.loads((folder / "config.json").read_text())
    del config["model_file"]
    (folder / "config.json").write_text(json.dumps(config))
    model, tokenizer = mlx_lm.load(str(folder))
    try:
        tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPTS[0], max_tokens=NEW_TOKENS)]
    except TypeError as error:
        if "create_attention_mask()" in str(error):
            raise MlxLmFailed(str(error)) from None
        raise
    assert tokens == until_eos(cases[name]["transformers"]["greedy"][0], tokenizer.eos_token_ids)


def test_the_exports_for_transformers_are_not_read_by_mlx_lm(tmp_path):
    """Why `--to mlx`: mlx-lm 0.32.2 has no `qwen3_5_text` (the `--to qwen3_5` folder), and reads Qwen3-Next's
    `rope_theta` and `partial_rotary_factor` from the top level, where Transformers 5 writes `rope_parameters`."""
    dense, moe = build(tmp_path / "dense", {}), build(tmp_path / "moe", MOE)
    for folder in (dense, moe):
        tiny_tokenizer(folder, vocab_size=320)
    convert(dense, tmp_path / "q35", to_format="qwen3_5")
    convert(moe, tmp_path / "next", to_format="qwen3_next")
    with pytest.raises(ValueError, match="Model type qwen3_5_text not supported"):
        mlx_lm.load(str(tmp_path / "q35"))
    with pytest.raises(TypeError, match="missing 2 required positional arguments: 'rope_theta' and "
                                        "'partial_rotary_factor'"):
        mlx_lm.load(str(tmp_path / "next"))


# ---------------------------------------------------------------------------------------- quantization
def mlx_convert(*args: str) -> None:
    """mlx-lm's converter as its command line `mlx_lm.convert ARGS` runs it."""
    subprocess.run([sys.executable, "-m", "mlx_lm", "convert", *args, "--trust-remote-code"], check=True,
                   capture_output=True, timeout=600)


def mlx_perplexity(folder, data: np.ndarray) -> float:
    from mlx_lm.perplexity import eval_ppl

    model, _ = mlx_lm.load(str(folder), trust_remote_code=True)
    return eval_ppl(model, mx.array(data), batch_size=8)[0]


def test_4_bit_quantization_by_mlx_lm_and_its_perplexity(tmp_path):
    """A tiny GatedQwen trained 150 steps on text is exported and quantized by `mlx_lm.convert` to 4 bits (groups of
    64) and to bfloat16; perplexity on held-out text of the same kind: float32 in mlx-lm equals Transformers', and
    the 4-bit model's is reported beside the 16-bit one (docs/local.md)."""
    folder = tmp_path / "trained"
    tiny_tokenizer(folder, vocab_size=320)
    train(folder, text_file(tmp_path / "train.txt", words=6000).read_text(), dict(intermediate_size=128))
    data = windows(folder, text_file(tmp_path / "heldout.txt", words=3000, seed=1).read_text())
    convert(folder, tmp_path / "mlx", to_format="mlx")
    mlx_convert("--hf-path", str(tmp_path / "mlx"), "--mlx-path", str(tmp_path / "bf16"), "--dtype", "bfloat16")
    mlx_convert("--hf-path", str(tmp_path / "mlx"), "--mlx-path", str(tmp_path / "q4"), "-q", "--q-bits", "4",
                "--q-group-size", "64")
    quantization = json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]
    assert quantization["bits"] == 4 and quantization["group_size"] == 64
    result = {"transformers": transformers_perplexity(folder, data)}
    result.update({kind: mlx_perplexity(tmp_path / kind, data) for kind in ("mlx", "bf16", "q4")})
    print("perplexity on held-out text:", json.dumps(result))
    assert abs(result["mlx"] - result["transformers"]) <= 1e-4 * result["transformers"]
    assert result["transformers"] < 320 / 4  # trained: far below the uniform guess (the vocabulary, 320)
    assert result["q4"] != result["bf16"] != result["mlx"]  # each conversion changed the weights
    assert result["q4"] < 1.25 * result["mlx"]
