"""`GatedQwenForCausalLM.from_pretrained` on folders of other formats, with no convert step (conversion/loading.py):
the paper's release, stock Qwen3 / Qwen3-MoE (with or without an added gate; a mixture of experts through
`GatedQwenMoeForCausalLM`), Qwen3.5 text. Each is held against an
independent reference: the release folder's logits from the official computation written out per head
(`conversion_helpers.release_forward`), the stock Transformers model with the same weights, and what `gated-qwen
convert` writes for the same folder, tensor for tensor."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, GatedQwenModel, GatedQwenMoeForCausalLM
from gated_qwen.cli import main as cli
from gated_qwen.conversion import CheckpointFormatError, convert
from gated_qwen.conversion.loading import release_pages
from tests.conversion.conversion_helpers import release_forward, write_release
from tests.helpers import TINY, randomize_, sizes

IDS = torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(3))


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    return {name: tensor for file in files for name, tensor in load_file(folder / file).items()}


def shard(folder: Path, pieces: int = 3) -> None:
    """Rewrites `folder/model.safetensors` as `pieces` shards with an index, as large checkpoints come."""
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i in range(pieces):
        file = f"model-{i + 1:05d}-of-{pieces:05d}.safetensors"
        part = names[i::pieces]
        save_file({name: tensors[name] for name in part}, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (folder / "model.safetensors").unlink()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))


def load(folder: Path, causal_lm: type = GatedQwenForCausalLM, **kwargs) -> GatedQwenForCausalLM:
    model, info = causal_lm.from_pretrained(folder, output_loading_info=True, **kwargs)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = folder_tensors(a), folder_tensors(b)
    assert ta.keys() == tb.keys(), set(ta) ^ set(tb)
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


# ------------------------------------------------------------------------------------------------- the release
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.parametrize("variant", ["baseline", "headwise", "elementwise"])
def test_release_folder_loads_as_the_official_model_computes(tmp_path, variant, kv_heads):
    release = tmp_path / "release"
    weights = write_release(release, variant, kv_heads, qkv_bias=variant == "headwise", seed=kv_heads)
    shard(release)
    expected = release_forward(weights, kv_heads, variant, variant == "headwise", IDS)

    model = load(release)
    assert model.config.gate_position == (None if variant == "baseline" else "sdpa")
    if variant != "baseline":
        assert model.config.gate_granularity == variant and model.config.gate_bias == (variant == "headwise")
    torch.testing.assert_close(logits(model), expected, rtol=1e-4, atol=1e-4)

    model.save_pretrained(tmp_path / "saved")  # saves as gated_qwen...
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == "gated_qwen"
    assert "_checkpoint_format" not in (tmp_path / "saved" / "config.json").read_text()
    torch.testing.assert_close(logits(load(tmp_path / "saved")), logits(model), rtol=0, atol=0)
    convert(release, tmp_path / "converted", from_format="release", verify=False)  # ... as the converter does
    assert_same_tensors(tmp_path / "saved", tmp_path / "converted")


def test_release_folder_loads_in_bfloat16_with_a_device_map_and_its_tokenizer(tmp_path):
    release = tmp_path / "release"
    write_release(release, "elementwise", 2)
    (release / "tokenizer.json").unlink()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_tiny_tokenizer(), pad_token="<pad>")
    tokenizer.save_pretrained(release)
    reference = load(release)
    model = load(release, dtype=torch.bfloat16, device_map="cpu")
    assert next(model.parameters()).dtype == torch.bfloat16
    for parameter in reference.parameters():  # the float32 model's weights rounded to bfloat16 (its buffers kept)
        parameter.data = parameter.data.to(torch.bfloat16)
    torch.testing.assert_close(logits(model), logits(reference), rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(release)("the gate").input_ids == tokenizer("the gate").input_ids


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=TINY["vocab_size"], special_tokens=["<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:80])
    tokenizer.train_from_iterator(["the gate sits after attention"], trainer)
    return tokenizer


def test_entry_points_for_foreign_folders(tmp_path):
    """A release folder is model_type 'qwen3' to Transformers: `GatedQwenForCausalLM.from_pretrained` and the Auto
    class with `config=GatedQwenConfig.from_pretrained(...)` read it as GatedQwen; the base model too."""
    release = tmp_path / "release"
    write_release(release, "headwise", 2)
    expected = logits(load(release))
    config = GatedQwenConfig.from_pretrained(release)
    auto = AutoModelForCausalLM.from_pretrained(release, config=config)
    assert type(auto) is GatedQwenForCausalLM
    torch.testing.assert_close(logits(auto.eval()), expected, rtol=0, atol=0)
    base = GatedQwenModel.from_pretrained(release)
    with torch.no_grad():
        torch.testing.assert_close(base(IDS).last_hidden_state, load(release).model(IDS).last_hidden_state)


@pytest.mark.parametrize("flags, rows_of, message", [
    (dict(elementwise_attn_output_gate=True), "baseline", "the baseline layout: fix the gate flags"),
    (dict(headwise_attn_output_gate=False), "headwise", "rows"),
])
def test_release_flags_that_disagree_with_the_tensors_are_refused(tmp_path, flags, rows_of, message):
    """A gate flag without gate rows, or gate rows without the flag: an error, never a random or dropped gate."""
    release = tmp_path / "release"
    write_release(release, rows_of, 2)
    config = json.loads((release / "config.json").read_text())
    (release / "config.json").write_text(json.dumps({**config, **flags}))
    with pytest.raises((CheckpointFormatError, RuntimeError, ValueError), match=message):
        GatedQwenForCausalLM.from_pretrained(release)


def test_release_with_both_gate_flags_is_the_headwise_variant_for_every_reader(tmp_path, capsys):
    """The official modeling_qwen3.py reads the flags `if headwise ... elif elementwise`: a config.json with both
    true is the headwise variant. `from_pretrained` and `gated-qwen convert --from release` both read it so (its
    q_proj holds the headwise rows) and compute the official forward; with the elementwise rows the folder is refused
    by both, naming the headwise flag and the layout the rows are."""
    both = dict(headwise_attn_output_gate=True, elementwise_attn_output_gate=True)
    release = tmp_path / "release"
    weights = write_release(release, "headwise", 2, seed=7)
    config = json.loads((release / "config.json").read_text())
    (release / "config.json").write_text(json.dumps({**config, **both}))
    expected = release_forward(weights, 2, "headwise", False, IDS)

    model = load(release)
    assert (model.config.gate_position, model.config.gate_granularity) == ("sdpa", "headwise")
    torch.testing.assert_close(logits(model), expected, rtol=1e-4, atol=1e-4)
    assert cli(["convert", str(release), str(tmp_path / "converted"), "--from", "release", "--verify"]) == 0
    converted = load(tmp_path / "converted")
    assert converted.config.gate_granularity == "headwise"
    torch.testing.assert_close(logits(converted), expected, rtol=1e-4, atol=1e-4)

    elementwise = tmp_path / "elementwise"
    write_release(elementwise, "elementwise", 2)
    (elementwise / "config.json").write_text(json.dumps({**config, **both}))
    refusal = r"headwise variant \(headwise_attn_output_gate=True\).* 36 rows .* has 64 rows, the elementwise layout"
    with pytest.raises(CheckpointFormatError, match=refusal):
        GatedQwenForCausalLM.from_pretrained(elementwise)
    capsys.readouterr()
    assert cli(["convert", str(elementwise), str(tmp_path / "refused"), "--from", "release"]) == 2
    assert re.search(refusal, capsys.readouterr().err) and not (tmp_path / "refused").exists()


# ------------------------------------------------------------------------------------------------ stock Qwen3
def qwen3_folder(tmp_path: Path, **fields) -> tuple[Path, torch.Tensor]:
    stock = randomize_(Qwen3ForCausalLM(Qwen3Config(**sizes(TINY, **fields))), seed=5).eval()
    stock.save_pretrained(tmp_path / "qwen3")
    return tmp_path / "qwen3", logits(stock)


def test_stock_qwen3_folder_loads_without_a_gate(tmp_path):
    folder, expected = qwen3_folder(tmp_path)
    model = load(folder)
    assert model.config.gate_position is None  # never a randomly initialised default gate
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)


G1_ADDED = {
    "elementwise": dict(gate_position="sdpa"),
    "headwise": dict(gate_position="sdpa", gate_granularity="headwise"),
    "head-shared": dict(gate_position="sdpa", gate_shared_across_heads=True),
    "input-independent": dict(gate_position="sdpa", gate_input_dependent=False),
    "bias": dict(gate_position="sdpa", gate_bias=True),
}


@pytest.mark.parametrize("variant", list(G1_ADDED))
def test_gate_arguments_add_a_gate_that_keeps_the_function(tmp_path, variant):
    """`from_pretrained(qwen3_folder, gate_position=..., ...)`: the upcycle of `gated-qwen convert --add-gate`, the
    same tensors and the same logits as the stock model."""
    folder, expected = qwen3_folder(tmp_path)
    model = load(folder, **G1_ADDED[variant])
    for field, value in G1_ADDED[variant].items():
        assert getattr(model.config, field) == value
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "saved")
    convert(folder, tmp_path / "converted", from_format="qwen3", add_gate=G1_ADDED[variant], verify=False)
    assert_same_tensors(tmp_path / "saved", tmp_path / "converted")


def test_added_gates_that_cannot_keep_the_function_are_refused_before_loading(tmp_path):
    folder, _ = qwen3_folder(tmp_path)
    with pytest.raises(CheckpointFormatError, match="attention_bias=false"):
        GatedQwenForCausalLM.from_pretrained(folder, gate_position="value", gate_combine="add")
    with pytest.raises(CheckpointFormatError, match="silences attention"):
        GatedQwenForCausalLM.from_pretrained(folder, gate_activation="silu")


def test_stock_qwen3_moe_folder_loads_with_its_experts(tmp_path):
    stock = randomize_(Qwen3MoeForCausalLM(Qwen3MoeConfig(**sizes(TINY, num_experts=4, num_experts_per_tok=2,
                                                                  moe_intermediate_size=16))), seed=6).eval()
    stock.save_pretrained(tmp_path / "moe")
    model = load(tmp_path / "moe", GatedQwenMoeForCausalLM, gate_position="sdpa")
    assert model.config.num_experts == 4 and model.config.gate_position == "sdpa"
    torch.testing.assert_close(logits(model), logits(stock), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="holds a mixture of experts.*GatedQwenMoeForCausalLM"):
        GatedQwenForCausalLM.from_pretrained(tmp_path / "moe")  # the dense class: never a dense model


# -------------------------------------------------------------------------------------------------- Qwen3.5
def test_qwen3_5_folder_with_every_layer_full_attention_loads_with_its_gate(tmp_path):
    config = Qwen3_5TextConfig(**sizes(TINY, layer_types=["full_attention"] * 2), partial_rotary_factor=1.0)
    stock = randomize_(Qwen3_5ForCausalLM(config), seed=7, norm_center=0.0).eval()
    stock.save_pretrained(tmp_path / "qwen3_5")
    model = load(tmp_path / "qwen3_5")
    assert model.config.gate_position == "sdpa" and model.config.gate_granularity == "elementwise"
    torch.testing.assert_close(logits(model), logits(stock), rtol=1e-5, atol=1e-5)


def test_qwen3_5_linear_attention_layers_are_refused_with_the_reason(tmp_path):
    config = Qwen3_5TextConfig(**sizes(TINY), layer_types=["linear_attention", "full_attention"])
    config.save_pretrained(tmp_path / "hybrid")
    with pytest.raises(CheckpointFormatError, match=r"layers \[0\] are 'linear_attention'"):
        GatedQwenForCausalLM.from_pretrained(tmp_path / "hybrid")


# ------------------------------------------------------------ the converter and the load path: one layout each
FULL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
STOCK_FOLDERS = {  # name: (stock model, `--from` format, gate fields to add)
    "qwen3": (lambda: Qwen3ForCausalLM(Qwen3Config(**sizes(TINY, tie_word_embeddings=False))), "qwen3", None),
    "qwen3 + G2 headwise, bias": (lambda: Qwen3ForCausalLM(Qwen3Config(**sizes(TINY, attention_bias=True))), "qwen3",
                                  dict(gate_position="value", gate_granularity="headwise", gate_bias=True)),
    "qwen3 + additive sigmoid G3": (lambda: Qwen3ForCausalLM(Qwen3Config(**sizes(TINY, attention_bias=True))),
                                    "qwen3", dict(gate_position="key", gate_combine="add")),
    "qwen3 + constant ns_sigmoid G5, layer 1": (
        lambda: Qwen3ForCausalLM(Qwen3Config(**TINY)), "qwen3",
        dict(gate_position="dense", gate_activation="ns_sigmoid", gate_input_dependent=False, gate_layers=[1])),
    "qwen3_moe": (lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**sizes(TINY, **MOE))), "qwen3_moe", None),
    "qwen3_moe + headwise": (lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**sizes(TINY, mlp_only_layers=[0], **MOE))),
                             "qwen3_moe", dict(gate_position="sdpa", gate_granularity="headwise")),
    "qwen3_5 text, bias": (lambda: Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        **sizes(TINY, layer_types=["full_attention"] * 2), attention_bias=True, rope_parameters=FULL_ROPE)),
        "qwen3_5", None),
    "qwen3_next dense": (lambda: Qwen3NextForCausalLM(Qwen3NextConfig(
        **sizes(TINY, layer_types=["full_attention"] * 2), mlp_only_layers=[0, 1], rope_parameters=FULL_ROPE, **MOE)),
        "qwen3_5", None),
    "qwen3_next moe": (lambda: Qwen3NextForCausalLM(Qwen3NextConfig(
        **sizes(TINY, layer_types=["full_attention"] * 2), shared_expert_intermediate_size=24,
        rope_parameters=FULL_ROPE, **MOE)), "qwen3_next", None),
}
MOE_FOLDERS = ("qwen3_moe", "qwen3_moe + headwise", "qwen3_next moe")  # read by GatedQwenMoeForCausalLM


@pytest.mark.parametrize("name", list(STOCK_FOLDERS))
def test_converter_and_from_pretrained_read_a_folder_alike(tmp_path, name):
    """`gated-qwen convert --from X` and `from_pretrained(folder of X).save_pretrained` write the same config and
    the same tensors, bit for bit, for every format and kind of added gate (the release: above), and both compute
    the stock model: the two paths read each layout the same way."""
    make, fmt, gate = STOCK_FOLDERS[name]
    stock = randomize_(make(), seed=8, norm_center=0.0 if fmt in ("qwen3_5", "qwen3_next") else 1.0).eval()
    stock.save_pretrained(tmp_path / "stock")
    convert(tmp_path / "stock", tmp_path / "converted", from_format=fmt, add_gate=gate, verify=False)
    model = load(tmp_path / "stock", GatedQwenMoeForCausalLM if name in MOE_FOLDERS else GatedQwenForCausalLM,
                 **(gate or {}))
    torch.testing.assert_close(logits(model), logits(stock), rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "saved")
    assert_same_tensors(tmp_path / "saved", tmp_path / "converted")
    configs = [json.loads((tmp_path / folder / "config.json").read_text()) for folder in ("saved", "converted")]
    assert configs[0] == configs[1]
    assert configs[0]["model_type"] == ("gated_qwen_moe" if name in MOE_FOLDERS else "gated_qwen")


# ------------------------------------------------------------------------------------------------------ errors
def test_a_folder_of_another_model_type_is_refused_naming_what_is_read(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(**{k: v for k, v in TINY.items() if k != "head_dim"}).save_pretrained(tmp_path / "llama")
    with pytest.raises(CheckpointFormatError, match="model_type='llama'; GatedQwen reads gated_qwen and gated_qwen_moe folders and these formats: release"):
        GatedQwenForCausalLM.from_pretrained(tmp_path / "llama")


def test_a_missing_gate_tensor_is_an_error_not_a_random_gate(tmp_path):
    torch.manual_seed(0)
    GatedQwenForCausalLM(GatedQwenConfig(**TINY)).save_pretrained(tmp_path / "gated")
    tensors = load_file(tmp_path / "gated" / "model.safetensors")
    del tensors["model.layers.1.self_attn.gate.g_proj.weight"]
    save_file(tensors, tmp_path / "gated" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no tensor for model.layers.1.self_attn.gate.g_proj.weight.*"
                                         r"refusing to start that gate at random"):
        GatedQwenForCausalLM.from_pretrained(tmp_path / "gated")


@pytest.mark.parametrize("edit, field", [(dict(gate_layers=[0]), "gate_layers=[0]"),
                                         (dict(gate_position=None), "gate_position=None")])
def test_a_gate_tensor_the_config_does_not_have_is_an_error_not_dropped(tmp_path, edit, field):
    """The mirror of a missing gate: config.json says layer 1 has no gate (or no layer has one) while the weights hold
    layer 1's gate; loading would drop it and compute another model than the one saved."""
    torch.manual_seed(0)
    GatedQwenForCausalLM(GatedQwenConfig(**TINY)).save_pretrained(tmp_path / "gated")
    config = json.loads((tmp_path / "gated" / "config.json").read_text())
    (tmp_path / "gated" / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=re.escape(
            "the checkpoint holds model.layers.0.self_attn.gate.g_proj.weight (and 1 more gate tensors)"
            if "gate_position" in edit else "the checkpoint holds model.layers.1.self_attn.gate.g_proj.weight")
            + re.escape(f", a gate its config does not have ({field}); refusing to drop it")):
        GatedQwenForCausalLM.from_pretrained(tmp_path / "gated")


def misshapen(folder: Path, name: str, **gate) -> None:
    """A saved GatedQwen folder whose tensor `name` lost its last 4 rows."""
    torch.manual_seed(0)
    GatedQwenForCausalLM(GatedQwenConfig(**TINY, **gate)).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors[name] = tensors[name][:-4].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("name, gate", [
    ("model.layers.1.self_attn.gate.g_proj.weight", {}),
    ("model.layers.0.self_attn.gate.logits", {"gate_input_dependent": False}),
])
@pytest.mark.parametrize("ignore", [False, True])
def test_a_misshapen_gate_tensor_is_an_error_even_when_mismatches_are_ignored(tmp_path, name, gate, ignore):
    """Transformers' ignore_mismatched_sizes=True would start the gate at random (its log says so, the load goes
    on): a gate tensor of another shape is as much an error as a missing one."""
    misshapen(tmp_path / "gated", name, **gate)
    with pytest.raises(ValueError, match=rf"a tensor of another shape for {re.escape(name)}.*refusing to start that "
                                         "gate at random"):
        GatedQwenForCausalLM.from_pretrained(tmp_path / "gated", ignore_mismatched_sizes=ignore)


def test_other_misshapen_tensors_are_named_unless_mismatches_are_ignored(tmp_path, capsys):
    from gated_qwen.cli import main as cli

    name = "model.layers.0.mlp.up_proj.weight"
    misshapen(tmp_path / "gated", name)
    shape = [TINY["intermediate_size"], TINY["hidden_size"]]
    with pytest.raises(ValueError, match=re.escape(f"the checkpoint's {name} has shape {[shape[0] - 4, shape[1]]}, "
                                                   f"not the {shape} its config gives")):
        GatedQwenForCausalLM.from_pretrained(tmp_path / "gated")
    model, info = GatedQwenForCausalLM.from_pretrained(tmp_path / "gated", ignore_mismatched_sizes=True,
                                                       output_loading_info=True)  # as Transformers does: re-started
    assert [key[0] for key in info["mismatched_keys"]] == [name] and list(model.get_parameter(name).shape) == shape
    capsys.readouterr()
    assert cli(["analyze", str(tmp_path / "gated"), "--length", "8", "--out", str(tmp_path / "out")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith(f"gated-qwen: error: the checkpoint's {name} has shape")


def test_analyze_reads_a_release_folder_directly(tmp_path):
    """`gated-qwen analyze` on the paper's layout: the same report as on the converted folder."""
    pytest.importorskip("matplotlib", reason="needs the analysis extra: pip install 'gated-qwen[analysis]'")
    release = tmp_path / "release"
    write_release(release, "elementwise", 2)
    convert(release, tmp_path / "converted", from_format="release", verify=False)
    save_file({"input_ids": IDS}, tmp_path / "ids.safetensors")
    reports = {}
    for name in ("release", "converted"):
        assert cli(["analyze", str(tmp_path / name), "--tokens", str(tmp_path / "ids.safetensors"), "--length", "11",
                    "--sequences", "2", "--out", str(tmp_path / f"report-{name}")]) == 0
        reports[name] = json.loads((tmp_path / f"report-{name}" / "report.json").read_text())["summary"]
    assert reports["release"] == reports["converted"] and reports["release"]["gate_mean"] is not None


def _resident_mb(kind: str) -> float:
    return int(re.search(rf"{kind}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT and /proc are Linux's")
def test_release_pages_drops_a_split_tensors_mapped_pages_and_keeps_every_value(tmp_path):
    """The loader hands the packed q_proj over memory-mapped from the checkpoint; once split, its pages are given
    back (benchmarks/load_memory.py's peak-memory goal) without changing what the tensor reads, file-backed or anonymous."""
    reference = torch.randn(4096, 2048)  # 32 MB
    reference.numpy().tofile(tmp_path / "q_proj.bin")
    mapped = torch.from_file(str(tmp_path / "q_proj.bin"), shared=False, size=reference.numel()).view(4096, 2048)
    before = _resident_mb("RssFile")
    assert torch.equal(mapped, reference)  # reading maps the pages in
    read = _resident_mb("RssFile")
    assert read - before > 28
    release_pages(mapped)
    assert read - _resident_mb("RssFile") > 28
    assert torch.equal(mapped, reference)  # pages come back from the file
    anonymous = reference.clone()
    release_pages(anonymous)
    release_pages(reference[:, ::2])  # a strided view: left alone
    assert torch.equal(anonymous, reference)
