"""`gated-qwen convert --to gguf` and the layer types every export declares, without llama.cpp (which
`make test-llama` runs, tests/engine_llama): the GGUF's tensors read back with the gguf package into stock Transformers
`Qwen3_5ForCausalLM` / `Qwen3NextForCausalLM` give the source's logits, their names and shapes are those llama.cpp's
Qwen3.5 / Qwen3-Next loaders create (written out here from llama.cpp's `load_arch_tensors`), the vocabulary is the
tokenizer's, and every refusal is one line with exit status 2 and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="needs the gguf extra: pip install 'gated-qwen[gguf]'")

import gguf
import torch
from transformers import AutoConfig

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, GatedQwenMoeConfig, GatedQwenMoeForCausalLM
from gated_qwen.cli import main
from gated_qwen.conversion import VerificationError, convert
from gated_qwen.conversion.formats import gguf as gguf_format
from tests.helpers import SMALL, TINY_MOE, assert_refused, randomize_, sizes, tiny_tokenizer

DENSE = sizes(SMALL, vocab_size=320)
MOE = sizes(DENSE, **TINY_MOE, shared_expert_intermediate_size=32, norm_topk_prob=True)


def saved(folder: Path, fields: dict, dtype=torch.float32) -> Path:
    moe = "num_experts" in fields
    model = (GatedQwenMoeForCausalLM(GatedQwenMoeConfig(**fields)) if moe
             else GatedQwenForCausalLM(GatedQwenConfig(**fields)))
    randomize_(model).to(dtype).save_pretrained(folder)
    return folder


def fields_of(path: Path) -> dict:
    return {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}


def tensors_of(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape in PyTorch's order, GGML type) of a GGUF's tensors."""
    return {t.name: (tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name)
            for t in gguf.GGUFReader(path).tensors}


def llama_cpp_shapes(cfg: dict, moe: bool) -> dict[str, tuple[int, ...]]:
    """The tensors llama.cpp's `llama_model_qwen35` / `llama_model_qwen3next::load_arch_tensors` create for the
    config `cfg` with one recurrent layer after the attention layers (linear heads of `LINEAR_HEAD_DIM`, one key and
    one value head), in PyTorch's order (llama.cpp writes `{ne0, ne1}`, the reverse)."""
    hidden, heads, kv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    layers, vocab, ff = cfg["num_hidden_layers"], cfg["vocab_size"], cfg["intermediate_size"]
    lin = gguf_format.LINEAR_HEAD_DIM
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}

    def ffn(b: str) -> dict:
        if not moe:
            return {b + "ffn_gate.weight": (ff, hidden), b + "ffn_up.weight": (ff, hidden),
                    b + "ffn_down.weight": (hidden, ff)}
        e, inner, shared = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        return {b + "ffn_gate_inp.weight": (e, hidden), b + "ffn_gate_exps.weight": (e, inner, hidden),
                b + "ffn_up_exps.weight": (e, inner, hidden), b + "ffn_down_exps.weight": (e, hidden, inner),
                b + "ffn_gate_inp_shexp.weight": (1, hidden), b + "ffn_gate_shexp.weight": (shared, hidden),
                b + "ffn_up_shexp.weight": (shared, hidden), b + "ffn_down_shexp.weight": (hidden, shared)}

    for i in range(layers):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (hidden,), b + "post_attention_norm.weight": (hidden,),
                       b + "attn_q.weight": (2 * heads * d, hidden), b + "attn_k.weight": (kv * d, hidden),
                       b + "attn_v.weight": (kv * d, hidden), b + "attn_output.weight": (hidden, heads * d),
                       b + "attn_q_norm.weight": (d,), b + "attn_k_norm.weight": (d,), **ffn(b)})
    b = f"blk.{layers}."
    shapes.update({b + "attn_norm.weight": (hidden,), b + "post_attention_norm.weight": (hidden,),
                   b + "attn_qkv.weight": (3 * lin, hidden), b + "attn_gate.weight": (lin, hidden),
                   b + "ssm_conv1d.weight": (3 * lin, gguf_format.LINEAR_CONV_KERNEL), b + "ssm_dt.bias": (1,),
                   b + "ssm_a": (1,), b + "ssm_norm.weight": (lin,), b + "ssm_out.weight": (hidden, lin), **ffn(b)})
    if moe:
        shapes[b + "ssm_ba.weight"] = (2, hidden)
    else:
        shapes.update({b + "ssm_beta.weight": (1, hidden), b + "ssm_alpha.weight": (1, hidden)})
    return shapes


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_gguf_holds_llama_cpps_tensors_and_the_sources_function(tmp_path, capsys, kind):
    """The tensors are exactly those llama.cpp's loader creates; `--verify` (on by default) read them back into stock
    Transformers and found the source's logits; the metadata says which layer is recurrent (only the added one)."""
    cfg = DENSE if kind == "dense" else MOE
    src = saved(tmp_path / "gated", cfg)
    assert main(["convert", str(src), str(tmp_path / "model.gguf"), "--to", "gguf"]) == 0
    assert "verified: logits agree to" in capsys.readouterr().err
    found = tensors_of(tmp_path / "model.gguf")
    assert {name: shape for name, (shape, _) in found.items()} == llama_cpp_shapes(cfg, kind == "moe")
    float32 = {name for name, (shape, _) in found.items() if len(shape) == 1 or "norm" in name or "gate_inp" in name}
    assert all(found[name][1] == "F32" for name in float32)
    fields = fields_of(tmp_path / "model.gguf")
    arch = {"dense": "qwen35", "moe": "qwen3next"}[kind]
    layers = cfg["num_hidden_layers"]
    assert fields["general.architecture"] == arch and fields[f"{arch}.block_count"] == layers + 1
    assert fields[f"{arch}.attention.recurrent_layers"] == [False] * layers + [True]
    assert f"{arch}.full_attention_interval" not in fields  # no interval says "all but the last"
    assert fields["tokenizer.ggml.model"] == "no_vocab" and fields[f"{arch}.vocab_size"] == cfg["vocab_size"]


def test_the_code_files_left_behind_are_named(tmp_path, capsys):
    """A one-file export carries none of SRC's own `*.py` code and says so by name (docs/cli.md), as a folder
    export without --carry-code does; the package's own modeling files are not counted."""
    src = saved(tmp_path / "gated", DENSE)
    (src / "tokenizer_custom.py").write_text("import os  # someone else's code\n")
    assert main(["convert", str(src), str(tmp_path / "model.gguf"), "--to", "gguf", "--no-verify"]) == 0
    err = capsys.readouterr().err
    assert "not carried: SRC's code files ['tokenizer_custom.py']" in err and "modeling_gated" not in err


def test_gguf_read_back_is_an_independent_check(tmp_path, monkeypatch):
    """A GGUF whose feed-forward gate and up projections were swapped fails `--verify`: exit status 1, nothing
    written (the read-back does not share the writer's name table)."""
    src = saved(tmp_path / "gated", DENSE)
    name = gguf_format.gguf_name
    swap = {"ffn_gate": "ffn_up", "ffn_up": "ffn_gate"}
    monkeypatch.setattr(gguf_format, "gguf_name", lambda n: ".".join(swap.get(p, p) for p in name(n).split(".")))
    with pytest.raises(VerificationError, match="verification failed"):
        convert(src, tmp_path / "model.gguf", to_format="gguf")
    assert not (tmp_path / "model.gguf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model.gguf.")]


def test_bfloat16_source_is_written_in_bfloat16_and_verifies(tmp_path):
    src = saved(tmp_path / "gated", DENSE, dtype=torch.bfloat16)
    convert(src, tmp_path / "model.gguf", to_format="gguf")  # --verify on: read back from BF16
    found = tensors_of(tmp_path / "model.gguf")
    assert found["blk.0.attn_q.weight"][1] == "BF16" and found["blk.0.attn_norm.weight"][1] == "F32"
    assert fields_of(tmp_path / "model.gguf")["general.file_type"] == gguf.LlamaFileType.MOSTLY_BF16


def test_vocabulary_is_the_tokenizers(tmp_path):
    src = saved(tmp_path / "gated", DENSE)
    tokenizer = tiny_tokenizer(src, vocab_size=DENSE["vocab_size"])
    convert(src, tmp_path / "model.gguf", to_format="gguf", verify=False)
    fields = fields_of(tmp_path / "model.gguf")
    vocab = tokenizer.get_vocab()
    by_id = sorted(vocab, key=vocab.get)
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.tokens"] == by_id + [f"[PAD{i}]" for i in range(len(by_id), DENSE["vocab_size"])]
    merges = json.loads((src / "tokenizer.json").read_text())["model"]["merges"]
    assert len(fields["tokenizer.ggml.merges"]) == len(merges)
    assert fields["tokenizer.ggml.eos_token_id"] == vocab["<|endoftext|>"]


def test_a_tokenizer_swapped_for_a_link_after_its_check_is_not_read(tmp_path, monkeypatch):
    """SRC's tokenizer.json swapped, as soon as it is checked, for a link to another tokenizer outside SRC: the GGUF
    holds the vocabulary that was checked (read through the file opened when it was checked), never the outside
    one, whether the swap comes before the tokenizer files are copied or before the gguf package reads them."""
    from gated_qwen.conversion import io

    src = saved(tmp_path / "gated", DENSE)
    tokenizer = tiny_tokenizer(src, vocab_size=DENSE["vocab_size"])
    tiny_tokenizer(tmp_path / "outside", texts=["an outside tokenizer, trained on other text entirely"],
                   vocab_size=DENSE["vocab_size"])
    checked = io.source_file

    def check_then_swap(folder, name, what):
        opened = checked(folder, name, what)
        if name == "tokenizer.json":
            (src / "tokenizer.json").unlink()
            (src / "tokenizer.json").symlink_to(tmp_path / "outside" / "tokenizer.json")
        return opened

    monkeypatch.setattr(io, "source_file", check_then_swap)
    convert(src, tmp_path / "model.gguf", to_format="gguf", verify=False)
    assert (src / "tokenizer.json").is_symlink()  # the swap happened during the run
    vocab = tokenizer.get_vocab()
    tokens = fields_of(tmp_path / "model.gguf")["tokenizer.ggml.tokens"]
    assert tokens[: len(vocab)] == sorted(vocab, key=vocab.get)


# ---------------------------------------------------------------------------------------------- layer types
@pytest.mark.parametrize("to", ["qwen3_5", "qwen3_next", "release"])
def test_every_export_declares_its_layers_one_way(tmp_path, to):
    """`layer_types` and `full_attention_interval` (where written) say the same layers are full attention, and a
    reader that goes by the interval alone (Transformers without `layer_types`, as llama.cpp's converter goes)
    builds the same model; the release layout (Qwen3's, no linear attention) writes neither."""
    src = saved(tmp_path / "gated", MOE if to == "qwen3_next" else DENSE)
    convert(src, tmp_path / to, to_format=to, verify=False)
    written = json.loads((tmp_path / to / "config.json").read_text())
    layers = written["num_hidden_layers"]
    if to == "release":
        assert "full_attention_interval" not in written and "linear_attention" not in written.get("layer_types", [])
        return
    interval = written["full_attention_interval"]
    by_interval = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    assert written["layer_types"] == by_interval == ["full_attention"] * layers
    without = {k: v for k, v in written.items() if k != "layer_types"}
    (tmp_path / to / "config.json").write_text(json.dumps(without))
    assert AutoConfig.from_pretrained(tmp_path / to).layer_types == ["full_attention"] * layers


# ---------------------------------------------------------------------------------------------- refusals
REFUSED = {  # name: (config fields, the message)
    "G2 value gate": (dict(gate_position="value"), "gates only the attention output"),
    "additive gate": (dict(gate_combine="add", gate_activation="silu"), "cannot add it"),
    "silu gate": (dict(gate_activation="silu", gate_bias=True), "gate_activation='silu'"),
    "non-gate control": (dict(gate_position=None, sdpa_output_transform="rmsnorm"), "sdpa_output_transform"),
    "o_proj bias": (dict(attention_bias=True), "llama.cpp's Qwen3.5 / Qwen3-Next attention does not have"),
    "yarn": (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                   "original_max_position_embeddings": 128}), "rope_type='yarn'"),
    "no qk norm": (dict(use_qk_norm=False), "use_qk_norm=False"),
    "sliding window": (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
                       "no sliding-window attention"),
    "dense MoE layer": (dict(TINY_MOE, shared_expert_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0]),
                        "llama.cpp's Qwen3-Next has experts in every layer"),
    "MoE routing weights": (dict(TINY_MOE, shared_expert_intermediate_size=32), "norm_topk_prob=False"),
    "MoE without shared expert": (dict(TINY_MOE, norm_topk_prob=True), "always have a shared expert"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_llama_cpp_cannot_express_is_refused(tmp_path, capsys, case):
    changes, message = REFUSED[case]
    src = saved(tmp_path / "gated", sizes(DENSE, **changes))
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "m.gguf"), "--to", "gguf"], message, tmp_path / "m.gguf")


def test_folder_options_outputs_in_src_and_foreign_tokenizers_are_refused(tmp_path, capsys):
    src = saved(tmp_path / "gated", DENSE)
    dst = tmp_path / "m.gguf"
    assert_refused(capsys, ["convert", str(src), str(dst), "--to", "gguf", "--max-shard-size", "1GB"],
            "--max-shard-size apply to safetensors folder outputs", dst)
    assert_refused(capsys, ["convert", str(src), str(src / "m.gguf"), "--to", "gguf"], "lies inside the input", src / "m.gguf")
    tiny_tokenizer(src, vocab_size=DENSE["vocab_size"])
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Whitespace"}
    (src / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert_refused(capsys, ["convert", str(src), str(dst), "--to", "gguf"], "is not a byte-level BPE tokenizer", dst)
