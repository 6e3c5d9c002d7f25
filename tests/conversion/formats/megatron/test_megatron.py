"""`--from megatron` / `--to megatron` against Megatron-core 0.16.1 itself, with no Megatron installed: `tp1/` and
`tp2/` beside this file are checkpoints that Megatron-core's own `dist_checkpointing.save` wrote (tensor parallel 1,
with Megatron-LM's arguments in common.pt; tensor parallel 2, megatron-core alone, its arguments in a config.json),
`legacy_tp2/` the same TP-2 model in Megatron-LM's legacy `torch` format (each rank's state dict), and
`tp*.logits.safetensors` the logits Megatron-core's forward computed (G1 elementwise, GQA, QK-norm, SwiGLU, untied). `make test-megatron` regenerates them (tests/engine_megatron/megatron_cpu.py) and checks the
other direction in Megatron-core."""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.conversion import convert
from gated_qwen.conversion.dcp import DcpCheckpoint, write_dcp
from gated_qwen.conversion.formats.megatron import megatron_logits, open_megatron
from gated_qwen.conversion.io import TensorPlan
from tests.conversion.conversion_helpers import TINY, gated_logits, randomize_
from tests.helpers import assert_refused

HERE = Path(__file__).parent
PARITY = 1e-5  # max |logit difference| in float32, the bar


@pytest.mark.parametrize("save", ["tp1", "tp2"])
def test_a_megatron_core_save_converts_to_megatrons_own_logits(tmp_path, save):
    convert(HERE / save, tmp_path / "gated", from_format="megatron")
    expected = load_file(HERE / f"{save}.logits.safetensors")
    got = gated_logits(tmp_path / "gated", expected["input_ids"])
    error = (got - expected["logits"]).abs().max().item()
    print(f"megatron {save} -> gated_qwen: max |logit difference| {error:.3g}")
    assert error <= PARITY
    config = json.loads((tmp_path / "gated" / "config.json").read_text())
    assert (config["gate_position"], config["gate_granularity"], config["num_key_value_heads"]) == ("sdpa",
                                                                                                      "elementwise", 2)
    assert config["rms_norm_eps"] == 1e-5  # Megatron-LM's default, not GatedQwen's


@pytest.mark.parametrize("save", ["tp1", "tp2"])
def test_the_verify_reference_is_megatrons_forward(save):
    """`--verify`'s Megatron model (`megatron_logits`, written from the layout) computes what Megatron-core did."""
    expected = load_file(HERE / f"{save}.logits.safetensors")
    got = megatron_logits(open_megatron(HERE / save), expected["input_ids"])
    assert (got - expected["logits"]).abs().max().item() <= PARITY


def test_the_global_tensors_do_not_depend_on_the_tensor_parallel_size():
    """Both saves hold the same names and shapes; only the stored chunks differ (per rank)."""
    one, two = (DcpCheckpoint(HERE / save, {}) for save in ("tp1", "tp2"))
    assert {n: i.shape for n, i in one.tensors.items()} == {n: i.shape for n, i in two.tensors.items()}
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    assert len(two.metadata.state_dict_metadata[qkv].chunks) == 4  # 2 layers x 2 ranks
    assert torch.equal(two.layer(qkv, 1), two.get(qkv)[1])  # one layer read alone


def common(folder: Path) -> dict:
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(folder / "common.pt", weights_only=True)


def model_folder(tmp_path: Path, **fields) -> Path:
    config = GatedQwenConfig(**{**TINY, "num_key_value_heads": 2, "tie_word_embeddings": False, **fields})
    randomize_(GatedQwenForCausalLM(config), seed=5).save_pretrained(tmp_path / "gated")
    return tmp_path / "gated"


@pytest.mark.parametrize("fields", [{}, {"gate_granularity": "headwise"}, {"gate_layers": [1]},
                                    {"tie_word_embeddings": True}, {"gate_position": None}],
                         ids=["elementwise", "headwise", "one gated layer", "tied", "no gate"])
def test_to_megatron_and_back_computes_the_same_logits(tmp_path, fields):
    """`--to megatron` (verified against `megatron_logits`), read back by `--from megatron`: the same logits, and
    for the elementwise model the same tensors bit for bit (the import and the export are permutations)."""
    source = model_folder(tmp_path, **fields)
    convert(source, tmp_path / "megatron", to_format="megatron")
    convert(tmp_path / "megatron", tmp_path / "back", from_format="megatron")
    ids = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    assert (gated_logits(tmp_path / "back", ids) - gated_logits(source, ids)).abs().max().item() <= PARITY
    args = vars(common(tmp_path / "megatron")["args"])
    assert args["attention_output_gate"] == (fields.get("gate_position", "sdpa") is not None)
    if not fields:
        back, original = (GatedQwenForCausalLM.from_pretrained(f).state_dict() for f in (tmp_path / "back", source))
        assert all(torch.equal(back[name], original[name]) for name in original)


def test_headwise_is_written_as_repeated_rows_and_says_so(tmp_path, capsys):
    source = model_folder(tmp_path, gate_granularity="headwise")
    capsys.readouterr()
    convert(source, tmp_path / "megatron", to_format="megatron")
    assert "each head's row repeated head_dim times" in capsys.readouterr().err
    qkv = DcpCheckpoint(tmp_path / "megatron", {}).layer("decoder.layers.self_attention.linear_qkv.weight", 0)
    gate_rows = qkv.view(2, -1, TINY["hidden_size"])[:, 2 * 8:4 * 8]  # group: [q 2 heads | gate 2 heads | k | v]
    assert torch.equal(gate_rows[0, :8], gate_rows[0, :1].expand(8, -1))


# ------------------------------------------------------------------------------------------------------ refusals
def copy_of(tmp_path: Path, save: str) -> Path:
    return Path(shutil.copytree(HERE / save, tmp_path / save))


def with_args(folder: Path, **changes) -> Path:
    """The TP-1 save with its common.pt's arguments changed."""
    state = common(folder)
    state["args"] = argparse.Namespace(**{**vars(state["args"]), **changes})
    torch.save(state, folder / "common.pt")
    return folder


def with_tensor(folder: Path, name: str, drop: str | None = None) -> Path:
    """The checkpoint rewritten with torch alone, with one more tensor `name` (and without `drop`)."""
    ckpt = DcpCheckpoint(folder, {})
    entries = {n: TensorPlan(i.shape, i.dtype, lambda n=n: ckpt.get(n)) for n, i in ckpt.tensors.items() if n != drop}
    entries[name] = TensorPlan((2, 4), torch.float32, lambda: torch.zeros(2, 4))
    fresh = folder.parent / "fresh"
    fresh.mkdir()
    write_dcp(fresh, entries)
    shutil.copy(folder / "common.pt", fresh / "common.pt")
    shutil.rmtree(folder)
    return fresh.rename(folder)


REFUSALS = {  # name: (how the TP-1 save is spoiled, what the one line says)
    "a missing shard": (lambda f: (f / "__0_1.distcp").unlink() or f, "names data files that SRC lacks: ['__0_1.distcp']"),
    "a layer count that disagrees": (lambda f: with_args(f, num_layers=3), "stacks 2 layers, but num_layers=3"),
    "MLA in the arguments": (lambda f: with_args(f, multi_latent_attention=True), "multi-latent attention (MLA)"),
    "Gated DeltaNet in the arguments": (lambda f: with_args(f, experimental_attention_variant="gated_delta_net"),
                                        "linear-attention (Gated DeltaNet)"),
    "MLA tensors": (lambda f: with_tensor(f, "decoder.layers.self_attention.linear_kv_down_proj.weight"),
                    "multi-latent attention (MLA)"),
    "Gated DeltaNet tensors": (lambda f: with_tensor(f, "decoder.layers.self_attention.in_proj.weight"),
                               "linear-attention (Gated DeltaNet) layers"),
    "a mixture of experts": (lambda f: with_args(f, num_experts=8), "num_experts=8 (the checkpoint's args)"),
    "biases": (lambda f: with_args(f, add_bias_linear=True), "add_bias_linear=True"),
    "interleaved RoPE": (lambda f: with_args(f, rotary_interleaved=True), "interleaved RoPE"),
    "partial RoPE": (lambda f: with_args(f, rotary_percent=0.5), "rotary_percent=0.5"),
    "untied without its output layer": (lambda f: with_tensor(f, "decoder.extra", drop="output_layer.weight"),
                                        "the output layer is missing"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_bad_checkpoint_is_refused_in_one_line(tmp_path, capsys, name):
    spoil, message = REFUSALS[name]
    src = spoil(copy_of(tmp_path, "tp1"))
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "out"), "--from", "megatron"], message,
                   nothing_at=tmp_path / "out")


def test_absent_arguments_mean_megatron_lms_defaults_and_say_so(tmp_path, capsys):
    src = copy_of(tmp_path, "tp2")
    config = json.loads((src / "config.json").read_text())
    del config["add_bias_linear"]
    (src / "config.json").write_text(json.dumps(config))
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "out"), "--from", "megatron"],
                   "add_bias_linear=True (Megatron-LM's default, absent from SRC's config.json)",
                   nothing_at=tmp_path / "out")


def test_a_megatron_core_save_without_a_config_is_refused_naming_the_config_json(tmp_path, capsys):
    src = copy_of(tmp_path, "tp2")
    (src / "config.json").unlink()
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "out"), "--from", "megatron"],
                   "give the model's shape in a config.json in SRC", nothing_at=tmp_path / "out")


class Payload:
    """What a hostile .metadata would unpickle: its __reduce__ runs a command."""

    def __reduce__(self):
        return (print, ("this ran",))


def test_a_metadata_pickle_naming_other_code_is_refused_without_running_it(tmp_path, capsys):
    src = copy_of(tmp_path, "tp1")
    (src / ".metadata").write_bytes(pickle.dumps(Payload()))
    line = assert_refused(capsys, ["convert", str(src), str(tmp_path / "out"), "--from", "megatron"],
                          "builtins.print is not part of a torch distributed checkpoint's metadata",
                          nothing_at=tmp_path / "out")
    assert "this ran" not in line and "this ran" not in capsys.readouterr().out


def test_megatron_lms_own_classes_in_common_pt_are_read_as_inert_stand_ins(tmp_path, monkeypatch):
    """Megatron-LM's arguments hold its enums (`attention_backend=AttnBackend.auto`); common.pt is read without
    Megatron, and its other values still say the model."""
    enums = types.ModuleType("megatron.core.transformer.enums")

    class AttnBackend:
        __module__, __qualname__ = "megatron.core.transformer.enums", "AttnBackend"

        def __reduce__(self):
            return (AttnBackend, (5,))

    enums.AttnBackend = AttnBackend
    names = ("megatron", "megatron.core", "megatron.core.transformer", "megatron.core.transformer.enums")
    with monkeypatch.context() as patch:  # a stand-in module to pickle it from (Megatron is not installed here)
        for name in names:
            patch.setitem(sys.modules, name, enums if name == names[-1] else types.ModuleType(name))
        src = with_args(copy_of(tmp_path, "tp1"), attention_backend=AttnBackend())
    assert "megatron" not in sys.modules
    assert open_megatron(src).config["num_layers"] == 2


def test_a_megatron_lm_save_folder_is_read_at_its_latest_iteration(tmp_path):
    shutil.copytree(HERE / "tp1", tmp_path / "run" / "iter_0000100")
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("100\n")
    convert(tmp_path / "run", tmp_path / "gated", from_format="megatron")
    expected = load_file(HERE / "tp1.logits.safetensors")
    assert (gated_logits(tmp_path / "gated", expected["input_ids"]) - expected["logits"]).abs().max().item() <= PARITY


def test_apply_layernorm_1p_norms_are_read_plus_one(tmp_path):
    """Megatron's zero-centred norms (`apply_layernorm_1p`: the layer computes x̂·(1 + w)) become GatedQwen's x̂·w."""
    convert(with_args(copy_of(tmp_path, "tp1"), apply_layernorm_1p=True), tmp_path / "gated", from_format="megatron")
    stored = DcpCheckpoint(HERE / "tp1", {})
    state = GatedQwenForCausalLM.from_pretrained(tmp_path / "gated").state_dict()
    assert torch.equal(state["model.layers.1.self_attn.q_norm.weight"],
                       stored.layer("decoder.layers.self_attention.q_layernorm.weight", 1) + 1)
    assert torch.equal(state["model.norm.weight"], stored.get("decoder.final_layernorm.weight") + 1)


def test_a_tensor_whose_saved_chunks_do_not_cover_it_is_refused(tmp_path, capsys):
    """A save that lost one rank's chunk of a tensor (its data file may still be there) is refused by name."""
    src = copy_of(tmp_path, "tp2")
    metadata = pickle.loads((src / ".metadata").read_bytes())
    metadata.state_dict_metadata["decoder.layers.mlp.linear_fc2.weight"].chunks.pop()
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "out"), "--from", "megatron"],
                   "'decoder.layers.mlp.linear_fc2.weight' [2, 64, 96] is saved in chunks that cover 9216 of its 12288",
                   nothing_at=tmp_path / "out")


def test_the_legacy_torch_format_merges_its_tensor_parallel_ranks(tmp_path):
    """`legacy_tp2/` (mp_rank_00, mp_rank_01) is the TP-2 model: read with --allow-pickle, its shards merged, it gives
    the tensors of the torch_dist save bit for bit, and Megatron's logits."""
    convert(HERE / "legacy_tp2", tmp_path / "legacy", from_format="megatron", allow_pickle=True)
    convert(HERE / "tp2", tmp_path / "dist", from_format="megatron")
    legacy, dist = (GatedQwenForCausalLM.from_pretrained(tmp_path / f).state_dict() for f in ("legacy", "dist"))
    assert legacy.keys() == dist.keys() and all(torch.equal(legacy[n], dist[n]) for n in dist)
    expected = load_file(HERE / "tp2.logits.safetensors")
    assert (gated_logits(tmp_path / "legacy", expected["input_ids"]) - expected["logits"]).abs().max().item() <= PARITY


LEGACY_REFUSALS = {
    "without --allow-pickle": (lambda f: f, [], "Pass --allow-pickle"),
    "a missing rank file": (lambda f: shutil.rmtree(f / "mp_rank_01") or f, ["--allow-pickle"],
                            "tensor_model_parallel_size=2 but SRC has 1 rank file(s)"),
    "pipeline parallel": (lambda f: (f / "mp_rank_01").rename(f / "mp_rank_01_001") and f, ["--allow-pickle"],
                          "a pipeline-parallel legacy checkpoint"),
}


@pytest.mark.parametrize("name", list(LEGACY_REFUSALS))
def test_a_legacy_checkpoint_is_refused_in_one_line(tmp_path, capsys, name):
    spoil, flags, message = LEGACY_REFUSALS[name]
    src = spoil(copy_of(tmp_path, "legacy_tp2"))
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "out"), "--from", "megatron", *flags], message,
                   nothing_at=tmp_path / "out")
