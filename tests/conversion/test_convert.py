"""What every conversion does, whatever the format: the destination (overwrite, pickle), bad input (exit 2, one line,
nothing written), the structure checked whatever --verify says, what convert reads and carries from SRC, files
swapped while it runs, a missing tensor that holds the gate."""

from __future__ import annotations

import collections
import dataclasses
import errno
import importlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import gated_qwen
from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.cli import main
from gated_qwen.conversion import TO_FORMATS, ConversionError, convert, plans
from gated_qwen.conversion.formats import qwen3 as qwen3_module
from tests.conversion.conversion_helpers import (
    TINY,
    VOCAB,
    copy_source,
    edit_json,
    load,
    logits,
    randomize_,
    refuse,
    tensors,
    write_release,
)
from tests.helpers import assert_nothing_written, assert_refused, refusal_line, sizes


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
                                      or "mlp.gate_proj.weight is [64, 32] where the config implies [40, 32]",
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
        assert_refused(capsys, ["convert", str(src), str(tmp_path / "dst"), *flags, verify], message, tmp_path / "dst")


@pytest.mark.parametrize("target", ["qwen3_5", "release"])
def test_export_of_weights_that_do_not_match_their_config_is_refused(gated_source, tmp_path, capsys, target):
    src = tmp_path / "src"
    shutil.copytree(gated_source, src)
    edit_json(src / "config.json", num_key_value_heads=1)
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "dst"), "--to", target, "--no-verify"],
                "k_proj.weight is [16, 32] where the config implies [8, 32]", tmp_path / "dst")


def test_exports_that_vllm_would_compute_wrongly_are_refused(tmp_path, capsys):
    """An o_proj bias (Qwen3's attention_bias), which vLLM's Qwen3.5 / Qwen3-Next drop without a word, is refused
    naming the native folder and the flag (with the flag: written for stock Transformers, with a warning); a dense
    model to Qwen3-Next, which vLLM refuses, names --to qwen3_5. tests/serving checks vLLM's side."""
    randomize_(GatedQwenForCausalLM(GatedQwenConfig(**TINY, attention_bias=True))).save_pretrained(tmp_path / "bias")
    randomize_(GatedQwenForCausalLM(GatedQwenConfig(**TINY))).save_pretrained(tmp_path / "dense")
    for target in ("qwen3_5", "qwen3_next"):
        assert_refused(capsys, ["convert", str(tmp_path / "bias"), str(tmp_path / "dst"), "--to", target],
                    "attention_bias=True, an o_proj bias" if target == "qwen3_5" else "--to qwen3_5", tmp_path / "dst")
    line = assert_refused(capsys, ["convert", str(tmp_path / "dense"), str(tmp_path / "dst"), "--to", "qwen3_next"],
                       "this model is dense", tmp_path / "dst")
    assert "use --to qwen3_5" in line
    assert_refused(capsys, ["convert", str(tmp_path / "dense"), str(tmp_path / "dst"), "--to", "release",
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
    assert_refused(capsys, ["convert", str(src), str(dangling), *args], "is a symlink to", dangling)
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "no" / "dst"), *args],
                f"The folder {str(tmp_path / 'no')!r} that would hold DST", tmp_path / "x")
    assert not (tmp_path / "no").exists()
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root may write anywhere; answer as the permission bits do for everyone else
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: real_access(path, mode) and Path(path) != read_only)
    assert_refused(capsys, ["convert", str(src), str(read_only / "dst"), *args],
                f"Cannot write in {str(read_only)!r}", read_only / "dst")
    for size in ("inf", "infGB", "nan", "0", "-2GB", "lots"):
        assert_refused(capsys, ["convert", str(src), str(tmp_path / "dst"), *args, f"--max-shard-size={size}"],
                    f"--max-shard-size {size!r} is not a size", tmp_path / "dst")


def test_disk_full_removes_the_partial_output_and_keeps_the_old_one(qwen3_sources, tmp_path, capsys, monkeypatch):
    from gated_qwen.conversion import io

    def full_disk(path, plan, progress):
        Path(path).write_bytes(b"\0" * 100)  # a partial shard
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(io, "_write_shard", full_disk)
    src, dst = qwen3_sources[False][0], tmp_path / "dst"
    assert_refused(capsys, ["convert", str(src), str(dst), "--from", "qwen3"],
                f"No space left on the device that holds {str(tmp_path)!r} while writing DST {str(dst)!r}; the "
                "partial output", dst, bars=True)
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
    line = assert_refused(capsys, ["convert", str(unsafe), str(tmp_path / "u"), "--from", "qwen3", "--allow-pickle"],
                       "pytorch_model.bin in SRC cannot be read with torch.load(weights_only=True) (Unsupported "
                       "global: GLOBAL pathlib", tmp_path / "u")
    assert "weights_only=False" not in line


def test_non_finite_source_is_named_as_such(qwen3_sources, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(qwen3_sources[True][0], src)
    weights = tensors(src)
    weights["model.norm.weight"][3] = float("inf")
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "dst"), "--from", "qwen3"],
                "the source produces non-finite logits", tmp_path / "dst", bars=True)


def test_verification_failure_exits_with_1(qwen3_sources, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(qwen3_module, "added_gate_init", lambda config: (0.0, "none", 1.0))
    assert_refused(capsys, ["convert", str(qwen3_sources[False][0]), str(tmp_path / "dst"), "--from", "qwen3",
                         "--add-gate", "elementwise"], "verification failed", tmp_path / "dst", status=1, bars=True)


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
        line = assert_refused(capsys, args, "verification failed", dst, status=1, bars=True)
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
        config, plan = fmt.writing.plan(ckpt, **options)
        edit(plan)
        return config, plan

    monkeypatch.setitem(FORMATS, name, dataclasses.replace(fmt, writing=dataclasses.replace(fmt.writing, plan=export)))


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
    assert_refused(capsys, ["convert", str(src), str(dst), "--from", "qwen3", "--no-verify"], message, dst)
    monkeypatch.setattr(conversion, "VERIFY_MAX_PARAMETERS", 1000)  # default flags, a model above the verify limit
    assert main(["convert", str(src), str(dst), "--from", "qwen3"]) == 2
    note, err = capsys.readouterr().err.split("\n", 1)
    assert note.startswith("not verifying: ") and "pass --verify to run it anyway" in note, note
    line = refusal_line(2, err, message)
    assert_nothing_written(dst)
    assert "the converted checkpoint would not match the model its config.json describes" in line


def test_export_plans_are_checked_against_the_stock_class(gated_source, tmp_path, capsys, monkeypatch):
    _patched_export(monkeypatch, "qwen3_5", lambda plan: plan.pop("model.layers.0.self_attn.q_proj.weight"))
    assert_refused(capsys, ["convert", str(gated_source), str(tmp_path / "dst"), "--to", "qwen3_5", "--no-verify"],
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
        assert_refused(capsys, ["convert", str(src), str(dst), "--from", "qwen3", "--no-verify"],
                    "the written weights differ from the plan at model.layers.0.mlp.up_proj.weight", dst, bars=True)
    write_config = conversion._write_config

    def config_without_vocab_size(config, folder, result):
        write_config(config, folder, result)
        data = json.loads((folder / "config.json").read_text())
        del data["vocab_size"]
        (folder / "config.json").write_text(json.dumps(data))

    monkeypatch.setattr(conversion, "_write_config", config_without_vocab_size)
    assert_refused(capsys, ["convert", str(src), str(dst), "--from", "qwen3", "--no-verify"],
                f"model.embed_tokens.weight is [{VOCAB}, 32] where the config implies [151936, 32]", dst, bars=True)


# ------------------------------------------------------------------------- what convert reads and carries from SRC
def test_only_regular_files_inside_src_are_read_or_carried(qwen3_sources, tmp_path, capsys):
    """A tokenizer.json that links outside SRC, a pipe named like a tokenizer file, a folder of shards that links
    outside SRC: each refused by name before anything is written. A link that stays inside SRC is carried as a
    regular file with its content."""
    src = copy_source(qwen3_sources, tmp_path)
    (tmp_path / "secret.txt").write_text("someone else's file")
    (src / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "dst"), "--from", "qwen3", "--no-verify"],
                f"SRC's file to carry 'tokenizer.json' is '{tmp_path}/secret.txt', outside SRC (through the link "
                "'tokenizer.json')", tmp_path / "dst")
    (src / "tokenizer.json").unlink()
    os.mkfifo(src / "tokenizer_extra.json")
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "dst"), "--from", "qwen3", "--no-verify"],
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
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "dst2"), "--from", "qwen3", "--no-verify"],
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
    package = Path(gated_qwen.__file__).parent / "model" / "modeling_gated.py"
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


@pytest.mark.parametrize("how", ["grows", "truncated"])
@pytest.mark.parametrize("moment", ["before verifying", "after verify read it"])
def test_src_changing_while_converting_is_one_line_with_verify(tmp_path, monkeypatch, capsys, how, moment):
    """--verify reads SRC again by its name; SRC's model.safetensors growing or truncated once the weights are
    staged (before --verify reads it: the read fails), or after --verify read it again (the read succeeded): one
    line, exit 2, nothing written."""
    verify_module = importlib.import_module("gated_qwen.conversion.verify")
    src = tmp_path / "src"
    randomize_(Qwen3ForCausalLM(Qwen3Config(**TINY))).save_pretrained(src)
    weights = src / "model.safetensors"
    size = weights.stat().st_size
    now = size + 4096 if how == "grows" else size // 2
    if moment == "before verifying":
        swapping_when(monkeypatch, "end", lambda: os.truncate(weights, now))
    else:
        read_again = verify_module.model_logits

        def model_logits(folder, *args, **kwargs):
            logits = read_again(folder, *args, **kwargs)
            if Path(folder) == src:
                os.truncate(weights, now)
            return logits

        monkeypatch.setattr(verify_module, "model_logits", model_logits)
    assert_refused(capsys, ["convert", str(src), str(tmp_path / "dst"), "--from", "qwen3", "--verify"],
                   f"SRC changed while converting: {weights} is {now} bytes, not the {size} read. Nothing was "
                   "written", tmp_path / "dst", bars=True)
    assert weights.stat().st_size == now  # the change happened during the run


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
    assert_refused(capsys, ["convert", str(snapshot / "1B_baseline"), str(tmp_path / "dst2"), "--from", "qwen3"],
                f"SRC's file to carry 'tokenizer.json' is '{tmp_path}/secret.txt', outside SRC (through the link "
                "'tokenizer.json')", tmp_path / "dst2")


def test_srcs_code_named_like_a_module_of_this_package_is_srcs_own(qwen3_sources, tmp_path, capsys):
    """SRC's model_card.py or cli.py (named like modules of this package that a saved folder does not ship) is SRC's code:
    carried with --carry-code, said to be left behind without it."""
    src = copy_source(qwen3_sources, tmp_path)
    (src / "model_card.py").write_text("# someone else's code\n")
    assert main(["convert", str(src), str(tmp_path / "plain"), "--from", "qwen3", "--no-verify"]) == 0
    assert "not carried: SRC's code files ['model_card.py'] (someone else's code" in capsys.readouterr().err
    assert not (tmp_path / "plain" / "model_card.py").exists()
    assert main(["convert", str(src), str(tmp_path / "code"), "--from", "qwen3", "--no-verify", "--carry-code"]) == 0
    assert "carried SRC's code files ['model_card.py'] (--carry-code)" in capsys.readouterr().err
    assert (tmp_path / "code" / "model_card.py").read_text() == "# someone else's code\n"


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
        assert_refused(capsys, ["convert", str(tmp_path / folder), str(tmp_path / "dst"), "--from", fmt, "--no-verify"],
                    said, tmp_path / "dst")
        with pytest.raises(ValueError) as refusal:
            GatedQwenForCausalLM.from_pretrained(tmp_path / folder)
        assert said in str(refusal.value)


LOOP = "is a link loop: following its links leads back to a link already followed"


@pytest.mark.parametrize("direction", [["--from", "qwen3"], *(["--to", to] for to in TO_FORMATS)], ids=" ".join)
def test_a_link_loop_is_refused_by_name_in_every_direction(qwen3_sources, gated_source, tmp_path, capsys, direction):
    """`model.safetensors -> model.safetensors`, a config.json and a tokenizer.json that link to each other, SRC a
    link to itself, DST one: each refused in one line naming the path, status 2, nothing written (Python 3.11's
    `Path.resolve` raises a bare RuntimeError on a loop)."""
    src = tmp_path / "src"
    shutil.copytree(qwen3_sources[False][0] if direction[0] == "--from" else gated_source, src)
    dst = tmp_path / "dst"
    argv = ["convert", str(src), str(dst), *direction, "--no-verify"]
    for name in [p.name for p in src.glob("model*.safetensors*")]:
        (src / name).unlink()
    (src / "model.safetensors").symlink_to("model.safetensors")
    assert_refused(capsys, argv, f"SRC's 'model.safetensors' {LOOP}", dst)

    (src / "model.safetensors").unlink()
    (src / "config.json").unlink()
    (src / "config.json").symlink_to("tokenizer.json")
    (src / "tokenizer.json").symlink_to("config.json")
    assert_refused(capsys, argv, f"SRC's 'config.json' {LOOP}", dst)

    (tmp_path / "self").symlink_to("self")
    assert_refused(capsys, ["convert", str(tmp_path / "self"), str(dst), *direction], f"SRC {str(tmp_path / 'self')!r} "
                f"{LOOP}", dst)
    assert_refused(capsys, ["convert", str(gated_source), str(tmp_path / "self"), *direction],
                f"DST {str(tmp_path / 'self')!r} {LOOP}", None)
    assert os.readlink(tmp_path / "self") == "self"


def test_a_source_or_destination_whose_name_is_not_utf8_is_converted_and_verified(qwen3_sources, tmp_path, capsys):
    """`out\\xfe` (a name the file system takes but the safetensors library cannot open, a Rust string): verified and
    written, as with a UTF-8 name; the same for SRC. The result computes the source's logits."""
    src, expected = qwen3_sources[False]
    dst = tmp_path / os.fsdecode(b"out\xfe")
    try:
        dst.mkdir()
        dst.rmdir()
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system takes only UTF-8 names")
    assert main(["convert", str(src), str(dst), "--from", "qwen3", "--verify"]) == 0
    assert "verified: logits agree" in capsys.readouterr().err
    assert main(["convert", str(dst), str(tmp_path / os.fsdecode(b"back\xfe")), "--to", "qwen3_5", "--verify"]) == 0
    assert "verified: logits agree" in capsys.readouterr().err
    os.rename(dst, tmp_path / "plain")  # Transformers' own from_pretrained opens only UTF-8 names
    torch.testing.assert_close(logits(load(GatedQwenForCausalLM, tmp_path / "plain")), expected)


@pytest.mark.parametrize("to", TO_FORMATS)
def test_every_export_refuses_an_output_into_over_or_around_its_input(gated_source, tmp_path, capsys, to):
    """docs/cli.md's first rule for every registered export: DST inside SRC, DST that is SRC through a link (for a one-file GGUF: a folder), and DST holding SRC (with
    --overwrite) are refused in one line
    before anything is read or written (`--to onnx` before it asks for ONNX Runtime), SRC left as it was."""
    src = tmp_path / "holder" / "src"
    shutil.copytree(gated_source, src)
    before = {path: path.read_bytes() for path in src.rglob("*") if path.is_file()}
    (tmp_path / "link").symlink_to(src)
    for dst, extra, message in ((src / "out", [], f"lies inside the input {str(src)!r}"), (tmp_path / "link", ["--overwrite"], f"is the input {str(src)!r}"
                                 if to != "gguf" else "exists and is a folder"),  # a file output replaces a link
                                (tmp_path / "holder", ["--overwrite"], "contains the input")):
        assert_refused(capsys, ["convert", str(src), str(dst), "--to", to, *extra], message, None)
        assert {path: path.read_bytes() for path in src.rglob("*") if path.is_file()} == before
        assert not (src / "out").exists()
