"""`gated_qwen.files.identity`, through every command that writes: no command writes into, over or around one of its
inputs (each data-loss case of every command, checked byte for byte on the whole folder tree), whatever second path
reaches the input (a bind mount, a hard link, links at any depth, an index's shard outside the folder), and nothing is
written into, as or around a Hugging Face cache."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.cli import main
from tests.helpers import TINY, assert_refused, cli_runs_in_namespace, private_namespace, refusal_line, tree


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """outer/model (a GatedQwen folder), outer/qwen3 (a stock Qwen3 folder whose files are links into outer/blobs,
    as in a Hugging Face cache snapshot), input files, links; the current folder is elsewhere/, beside outer/."""
    outer = tmp_path / "outer"
    GatedQwenForCausalLM(GatedQwenConfig(**TINY)).save_pretrained(outer / "model")
    Qwen3ForCausalLM(Qwen3Config(**TINY)).save_pretrained(outer / "qwen3")
    (outer / "blobs").mkdir()
    for name in ("config.json", "model.safetensors"):
        os.rename(outer / "qwen3" / name, outer / "blobs" / name)
        (outer / "qwen3" / name).symlink_to(outer / "blobs" / name)
    save_file({"input_ids": torch.zeros(2, 16, dtype=torch.long)}, outer / "tokens.safetensors")
    (outer / "text.txt").write_text("some held-out text\n")
    (outer / "model" / "README.md").write_text('[{"task_type": "x"}]')
    (outer / "link-to-qwen3").symlink_to(outer / "qwen3")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "src-link").symlink_to(outer / "qwen3")
    monkeypatch.chdir(tmp_path / "elsewhere")
    return tmp_path


DATA_LOSS = {  # command line (run in elsewhere/) -> how the refusal names what it protects
    "convert: DST contains SRC": (["convert", "../outer/qwen3", "../outer", "--from", "qwen3", "--overwrite"],
                                  "DST '../outer' contains the input '../outer/qwen3'"),
    "convert: DST contains SRC, given as a link": (["convert", "src-link", "../outer", "--from", "qwen3",
                                                    "--overwrite"], "DST '../outer' contains the input 'src-link'"),
    "convert: DST is SRC": (["convert", "../outer/qwen3", "../outer/qwen3", "--from", "qwen3", "--overwrite"],
                            "DST '../outer/qwen3' is the input '../outer/qwen3'"),
    "convert: DST inside SRC": (["convert", "../outer/model", "../outer/model/q35", "--to", "qwen3_5"],
                                "DST '../outer/model/q35' lies inside the input '../outer/model'"),
    "convert: DST a link to SRC": (["convert", "../outer/qwen3", "../outer/link-to-qwen3", "--from", "qwen3",
                                    "--overwrite"], "DST '../outer/link-to-qwen3' is the input '../outer/qwen3'"),
    "convert: DST holds the files SRC links to": (["convert", "../outer/qwen3", "../outer/blobs", "--from", "qwen3",
                                                   "--overwrite"],
                                                  "DST '../outer/blobs' contains '../outer/qwen3/config.json', which the input '../outer/qwen3' holds"),
    "convert: DST is .": (["convert", "../outer/qwen3", ".", "--from", "qwen3", "--overwrite"],
                          "DST '.' is or contains the current folder"),
    "convert: DST is ..": (["convert", "../outer/qwen3", "..", "--from", "qwen3", "--overwrite"],
                           "DST '..' is or contains the current folder"),
    "analyze: --out MODEL": (["analyze", "../outer/model", "--out", "../outer/model", "--overwrite"],
                             "--out '../outer/model' is the input '../outer/model'"),
    "analyze: --out inside MODEL": (["analyze", "../outer/model", "--out", "../outer/model/analysis"],
                                    "lies inside the input '../outer/model'"),
    "analyze: --out contains MODEL": (["analyze", "../outer/model", "--out", "../outer", "--overwrite"],
                                      "--out '../outer' contains the input '../outer/model'"),
    "analyze: --out the tokens file": (["analyze", "../outer/model", "--tokens", "../outer/tokens.safetensors",
                                        "--out", "../outer/tokens.safetensors", "--overwrite"],
                                       "is the input '../outer/tokens.safetensors'"),
    "eval-ppl: --out MODEL/config.json": (["eval-ppl", "../outer/model", "--lengths", "8", "--out",
                                           "../outer/model/config.json", "--overwrite"],
                                          "is '../outer/model/config.json', which the input '../outer/model' holds"),
    "eval-ppl: --out the text": (["eval-ppl", "../outer/model", "--lengths", "8", "--text", "../outer/text.txt",
                                  "--out", "../outer/text.txt", "--overwrite"],
                                 "--out '../outer/text.txt' is the input '../outer/text.txt'"),
    "reproduce: --out .": (["reproduce", "--preset", "smoke", "--out", ".", "--overwrite"],
                           "--out '.' is or contains the current folder"),
    "card: the card is the results file": (["card", "../outer/model", "--eval-results", "../outer/model/README.md",
                                            "--overwrite"], "the card '../outer/model/README.md' is the input"),
}


@pytest.mark.parametrize("case", list(DATA_LOSS))
def test_no_command_writes_into_over_or_around_its_input(workspace, capsys, case):
    args, message = DATA_LOSS[case]
    before = tree(workspace)
    assert_refused(capsys, args, message)
    assert tree(workspace) == before


# ------------------------------------------------------------------------------------------ file identity
@pytest.mark.skipif(private_namespace() is None, reason="needs a mount namespace (root or user namespaces)")
def test_a_bind_mount_of_an_input_is_recognised(tmp_path):
    """`mount --bind A B`: B/m is A/m under another path (as a case-insensitive file system gives A/M): converting
    A/m into B/m with --overwrite must not delete it, nor may eval-ppl replace the model's config through ALIAS."""
    (tmp_path / "A").mkdir()
    Qwen3ForCausalLM(Qwen3Config(**TINY)).save_pretrained(tmp_path / "A" / "m")
    GatedQwenForCausalLM(GatedQwenConfig(**TINY)).save_pretrained(tmp_path / "model")
    for folder in ("B", "ALIAS"):
        (tmp_path / folder).mkdir()
    before = tree(tmp_path)
    a, b, model, alias = (str(tmp_path / name) for name in ("A", "B", "model", "ALIAS"))
    answers = cli_runs_in_namespace(f"mount --bind {a} {b}; mount --bind {model} {alias}", [
        ["convert", f"{a}/m", f"{b}/m", "--from", "qwen3", "--overwrite"],
        ["convert", f"{a}/m", b, "--from", "qwen3", "--overwrite"],
        ["eval-ppl", model, "--lengths", "8", "--out", f"{alias}/config.json", "--overwrite"],
    ])
    refusal_line(**answers[0], message=f"DST '{b}/m' is the input '{a}/m'")
    refusal_line(**answers[1], message=f"DST '{b}' contains the input '{a}/m'")
    refusal_line(**answers[2], message=f"--out '{alias}/config.json' is '{model}/config.json', which the input '{model}' holds")
    assert tree(tmp_path) == before


def test_a_hard_link_to_an_input_file_is_refused(tmp_path, capsys):
    """A second name for the same file (a hard link; a case-insensitive file system's other spelling) is the same
    file: compared by device and inode, not by path."""
    GatedQwenForCausalLM(GatedQwenConfig(**TINY)).save_pretrained(tmp_path / "model")
    (tmp_path / "alias").mkdir()
    os.link(tmp_path / "model" / "config.json", tmp_path / "alias" / "config.json")
    before = tree(tmp_path)
    capsys.readouterr()
    assert_refused(capsys, ["eval-ppl", str(tmp_path / "model"), "--lengths", "8", "--out",
                     str(tmp_path / "alias" / "config.json"), "--overwrite"],
            f"is '{tmp_path}/model/config.json', which the input '{tmp_path}/model' holds")
    assert tree(tmp_path) == before


def sharded_qwen3(folder: Path) -> list[str]:
    """A stock Qwen3 folder with its weights in several shards; returns the shard names."""
    Qwen3ForCausalLM(Qwen3Config(**TINY)).save_pretrained(folder, max_shard_size="40KB")
    return sorted(p.name for p in folder.glob("model-*.safetensors"))


def move_shards(src: Path, shards: list[str], into: str) -> None:
    """Rewrites SRC's index to name its shards in the sub-folder `into`."""
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name: f"{into}/{file}" for name, file in index["weight_map"].items()}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def test_links_at_any_depth_are_inputs(tmp_path, capsys):
    """SRC's index names shards/model-*.safetensors, and shards/ holds links into the old DST: replacing DST would
    leave SRC pointing at nothing. Every file a command reads, at any depth, is an input, links resolved."""
    src, old = tmp_path / "src", tmp_path / "old"
    shards = sharded_qwen3(src)
    assert len(shards) > 1
    old.mkdir()
    (src / "shards").mkdir()
    for name in shards:
        os.rename(src / name, old / name)
        (src / "shards" / name).symlink_to(old / name)
    move_shards(src, shards, "shards")
    GatedQwenForCausalLM(GatedQwenConfig(**TINY)).save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "notes" / "deeper").mkdir(parents=True)
    (tmp_path / "analysis").mkdir()
    (tmp_path / "analysis" / "report.md").write_text("old report")
    (tmp_path / "model" / "notes" / "deeper" / "report.md").symlink_to(tmp_path / "analysis" / "report.md")
    before = tree(tmp_path)
    capsys.readouterr()
    assert_refused(capsys, ["convert", str(src), str(old), "--from", "qwen3", "--overwrite"],
            f"DST {str(old)!r} contains '{src}/shards/{shards[0]}', which the input {str(src)!r} holds")
    assert_refused(capsys, ["analyze", str(tmp_path / "model"), "--out", str(tmp_path / "analysis"), "--overwrite"],
            f"contains '{tmp_path}/model/notes/deeper/report.md', which the input '{tmp_path}/model' holds")
    assert tree(tmp_path) == before


def test_a_card_never_writes_through_a_link(tmp_path, capsys):
    """README.md a link to the weights: the card replaces the link; the weights stay as they were."""
    model = tmp_path / "model"
    GatedQwenForCausalLM(GatedQwenConfig(**TINY)).save_pretrained(model)
    weights = (model / "model.safetensors").read_bytes()
    (model / "README.md").symlink_to("model.safetensors")
    capsys.readouterr()
    assert_refused(capsys, ["card", str(model)], "already exists; pass --overwrite")
    assert main(["card", str(model), "--overwrite"]) == 0
    assert not (model / "README.md").is_symlink() and (model / "README.md").read_text().startswith("---\n")
    assert (model / "model.safetensors").read_bytes() == weights


def hub_cache_snapshot(cache: Path) -> Path:
    """A Hugging Face cache holding one model as huggingface_hub lays it out: snapshots/REV/FILE links into blobs/."""
    repo = cache / "models--me--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    GatedQwenForCausalLM(GatedQwenConfig(**TINY)).save_pretrained(snapshot)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for i, path in enumerate(sorted(snapshot.iterdir())):
        blob = repo / "blobs" / f"blob{i:02d}"
        os.rename(path, blob)
        path.symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_nothing_is_written_into_a_hugging_face_cache(tmp_path, capsys):
    snapshot = hub_cache_snapshot(tmp_path / "hub")
    GatedQwenForCausalLM(GatedQwenConfig(**TINY)).save_pretrained(tmp_path / "model")
    before = tree(tmp_path)
    capsys.readouterr()
    assert_refused(capsys, ["card", str(snapshot), "--overwrite"], "lies inside the Hugging Face cache")
    assert_refused(capsys, ["eval-ppl", str(tmp_path / "model"), "--lengths", "8", "--out", str(snapshot / "rows.json")],
            f"lies inside the Hugging Face cache '{tmp_path}/hub/models--me--tiny'")
    assert tree(tmp_path) == before


def test_no_output_is_the_hugging_face_cache_lies_in_it_or_holds_it(tmp_path, capsys, hermetic_hf_caches):
    """The cache root (the folder of `models--*/` repositories) and every folder of it, and the folders that hold it
    (HF_HOME, with the token): never replaced, never written into, whatever the command reads."""
    hub = tmp_path / "hub"
    hub_cache_snapshot(hub)
    (hub / ".locks").mkdir()
    GatedQwenForCausalLM(GatedQwenConfig(**{**TINY, "vocab_size": 64})).save_pretrained(tmp_path / "model")
    home = Path(hermetic_hf_caches["HF_HOME"])
    (home / "hub").mkdir(parents=True)
    (home / "token").write_text("hf_secret")
    before, home_before = tree(tmp_path), tree(home)
    capsys.readouterr()
    model = str(tmp_path / "model")
    assert_refused(capsys, ["analyze", model, "--length", "8", "--out", str(hub), "--overwrite"],
            f"--out {str(hub)!r} is the Hugging Face cache {str(hub)!r}")
    assert_refused(capsys, ["analyze", model, "--length", "8", "--out", str(hub / ".locks"), "--overwrite"],
            f"lies inside the Hugging Face cache {str(hub)!r}")
    assert_refused(capsys, ["analyze", model, "--length", "8", "--out", str(hub / "analysis")],
            f"lies inside the Hugging Face cache {str(hub)!r}")
    assert_refused(capsys, ["eval-ppl", model, "--lengths", "8", "--out", str(home / "rows.json")],
            f"lies inside the Hugging Face cache {str(home)!r}")
    assert_refused(capsys, ["analyze", model, "--length", "8", "--out", str(home), "--overwrite"],
            f"is the Hugging Face cache {str(home)!r}")
    assert_refused(capsys, ["analyze", model, "--length", "8", "--out", str(home.parent), "--overwrite"],
            f"contains the Hugging Face cache {str(home)!r}")
    assert tree(tmp_path) == before and tree(home) == home_before


def test_an_input_given_as_a_link_is_its_target(tmp_path, capsys):
    """MODEL and --tokens given through links: the output at what they name (the real folder, the real file) is the
    input itself, not a stranger beside the link."""
    model = tmp_path / "model"
    GatedQwenForCausalLM(GatedQwenConfig(**{**TINY, "vocab_size": 64})).save_pretrained(model)
    save_file({"input_ids": torch.zeros(2, 16, dtype=torch.long)}, tmp_path / "tokens.safetensors")
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "model").symlink_to(model)
    (tmp_path / "links" / "tokens").symlink_to(tmp_path / "tokens.safetensors")
    before = tree(tmp_path)
    capsys.readouterr()
    assert_refused(capsys, ["analyze", str(tmp_path / "links" / "model"), "--length", "8", "--out", str(model), "--overwrite"],
            f"--out {str(model)!r} is the input {str(tmp_path / 'links' / 'model')!r}")
    assert_refused(capsys, ["eval-ppl", str(model), "--lengths", "8", "--tokens", str(tmp_path / "links" / "tokens"),
                     "--out", str(tmp_path / "tokens.safetensors"), "--overwrite"],
            f"is the input {str(tmp_path / 'links' / 'tokens')!r}")
    assert tree(tmp_path) == before


def index_naming_a_shard_outside(tmp_path: Path) -> tuple[Path, Path]:
    """tmp/sh/model, sharded, whose index names its second shard as ../shared/SHARD (Transformers follows it), and
    tmp/sh/shared holding that shard and a file of the user's; returns (model, the shard)."""
    model, shared = tmp_path / "sh" / "model", tmp_path / "sh" / "shared"
    torch.manual_seed(0)
    GatedQwenForCausalLM(GatedQwenConfig(**{**TINY, "vocab_size": 64})).save_pretrained(model, max_shard_size="40KB")
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    shared.mkdir()
    os.rename(model / shard, shared / shard)
    (shared / "notes.txt").write_text("the user's")
    index["weight_map"] = {k: f"../shared/{v}" if v == shard else v for k, v in index["weight_map"].items()}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    return model, shared / shard


def test_the_shards_an_index_names_outside_the_folder_are_inputs(tmp_path, capsys):
    """Transformers before 5.25 reads `../shared/SHARD` when the index names it (5.25 refuses such an index itself):
    that shard is an input wherever it lies (every file a command reads is), so no output may replace it or the
    folder that holds it; convert, which reads only SRC's own files, refuses such an index."""
    model, shard = index_naming_a_shard_outside(tmp_path)
    try:  # what the commands read, as the installed Transformers does
        assert GatedQwenForCausalLM.from_pretrained(model) is not None
    except ValueError as error:
        assert "points outside the model directory" in str(error)
    before = tree(tmp_path)
    capsys.readouterr()
    shown = f"'{model}/../shared/{shard.name}', which the input {str(model)!r} names"
    assert_refused(capsys, ["analyze", str(model), "--length", "8", "--out", str(shard.parent), "--overwrite"],
            f"--out {str(shard.parent)!r} contains {shown}")
    assert_refused(capsys, ["eval-ppl", str(model), "--lengths", "8", "--out", str(shard), "--overwrite"],
            f"--out {str(shard)!r} is {shown}")
    assert_refused(capsys, ["convert", str(model), str(shard.parent), "--to", "release", "--overwrite"],
            f"DST {str(shard.parent)!r} contains {shown}")
    assert_refused(capsys, ["convert", str(model), str(tmp_path / "release"), "--to", "release"],
            "names weight files outside the folder (['../shared/")
    assert tree(tmp_path) == before
