"""`gated_qwen.outputs`, the one place every command writes through: no command writes into, over or around one of its
inputs (each data-loss case of every command, checked byte for byte on the whole folder tree); an output appears
whole or not at all and replaces an old one only when complete; the staging folders of killed runs (real processes
killed with SIGKILL) are removed, or put back, by the next run and by `gated-qwen convert --clean`."""

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.cli import main
from gated_qwen.outputs import OWNER_FILE, OutputError, clean_stale, output_file, output_folder


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under `root`: file contents, link targets, folders."""
    out = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        out[key] = (f"-> {os.readlink(path)}" if path.is_symlink() else path.read_bytes() if path.is_file()
                    else "folder")
    return out


def refused(capsys, args: list[str], message: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gated-qwen: error: ") and message in err, err


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
                                                  "DST '../outer/blobs' contains the input '../outer/qwen3/config.json'"),
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
                                          "lies inside the input '../outer/model'"),
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
    refused(capsys, args, message)
    assert tree(workspace) == before


# ------------------------------------------------------------------------------------------ whole or not at all
def test_output_folder_appears_whole_or_not_at_all(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), output_folder(target) as staging:
        (staging / "part.bin").write_bytes(b"x")
        raise RuntimeError("the work failed")
    assert list(tmp_path.iterdir()) == []

    target.mkdir()  # an empty folder holds nothing to lose
    with output_folder(target) as staging:
        (staging / "a.txt").write_text("first")
    assert tree(tmp_path) == {"out": "folder", "out/a.txt": b"first"}

    with pytest.raises(OutputError, match="already exists; pass --overwrite"), output_folder(target):
        pass
    with pytest.raises(OutputError, match="appeared while this run was writing it"):
        with output_folder(tmp_path / "raced") as staging:
            (staging / "mine.txt").write_text("mine")
            (tmp_path / "raced").mkdir()  # another run published the same output meanwhile
            (tmp_path / "raced" / "theirs.txt").write_text("theirs")
    assert tree(tmp_path / "raced") == {"theirs.txt": b"theirs"}
    (tmp_path / "raced" / "theirs.txt").unlink()
    (tmp_path / "raced").rmdir()
    with pytest.raises(KeyboardInterrupt), output_folder(target, overwrite=True) as staging:
        (staging / "b.txt").write_text("second")
        raise KeyboardInterrupt
    assert tree(tmp_path) == {"out": "folder", "out/a.txt": b"first"}  # the old one, untouched
    with output_folder(target, overwrite=True) as staging:
        (staging / "b.txt").write_text("second")
    assert tree(tmp_path) == {"out": "folder", "out/b.txt": b"second"}  # replaced whole, nothing left beside it

    with pytest.raises(RuntimeError), output_folder(tmp_path / "new" / "deeper" / "out", create_parents=True):
        raise RuntimeError
    assert not (tmp_path / "new").exists()  # the parents it made are gone too
    with output_folder(tmp_path / "new" / "deeper" / "out", create_parents=True) as staging:
        (staging / "c.txt").write_text("third")
    assert (tmp_path / "new" / "deeper" / "out" / "c.txt").read_text() == "third"


def test_output_file_replaces_atomically_only_when_complete(tmp_path):
    target = tmp_path / "rows.json"
    target.write_text("old")
    with pytest.raises(OutputError, match="already exists"), output_file(target):
        pass
    with pytest.raises(ValueError), output_file(target, overwrite=True) as path:
        path.write_text("half")
        raise ValueError
    assert tree(tmp_path) == {"rows.json": b"old"}
    with output_file(target, overwrite=True) as path:
        path.write_text("new")
    assert tree(tmp_path) == {"rows.json": b"new"}
    with pytest.raises(OutputError, match="exists and is a folder"), output_file(tmp_path):
        pass


def test_published_folders_and_files_get_the_usual_permissions(tmp_path):
    """mkdtemp and safetensors create private entries; a published folder is readable (and traversable) like any."""
    with output_folder(tmp_path / "out") as staging:
        (staging / "models" / "run0").mkdir(parents=True)
        for folder in (staging, staging / "models", staging / "models" / "run0"):
            folder.chmod(0o700)
        (staging / "models" / "run0" / "model.safetensors").write_bytes(b"x")
        (staging / "models" / "run0" / "model.safetensors").chmod(0o600)
    umask = os.umask(0)
    os.umask(umask)
    for path in [tmp_path / "out", *(tmp_path / "out").rglob("*")]:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, path
    assert OWNER_FILE not in tree(tmp_path / "out")


# ------------------------------------------------------------------------------------------ killed runs
KILLED_RUN = """
import os, signal, sys
from gated_qwen.outputs import output_folder

target, when = sys.argv[1:]
rename = os.rename

def killed_after_moving_the_old_output_aside(src, dst):
    rename(src, dst)
    if ".replaced-" in str(dst):
        os.kill(os.getpid(), signal.SIGKILL)

os.rename = killed_after_moving_the_old_output_aside
with output_folder(target, overwrite=True) as staging:
    (staging / "new.bin").write_bytes(b"new" * 1000)
    if when == "writing":
        os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_run(target: Path, when: str) -> None:
    result = subprocess.run([sys.executable, "-c", KILLED_RUN, str(target), when], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]


def staging_folders(parent: Path) -> list[str]:
    return sorted(p.name.split("-")[0] for p in parent.iterdir() if p.name.startswith("."))


def test_staging_folders_of_killed_runs_are_removed_or_put_back(tmp_path, capsys):
    Qwen3ForCausalLM(Qwen3Config(**TINY)).save_pretrained(tmp_path / "qwen3")
    target = tmp_path / "out"

    killed_run(target, "writing")
    (staging,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.writing-")]
    assert json.loads((staging / OWNER_FILE).read_text())["host"] == socket.gethostname()
    assert main(["convert", "--clean", str(target)]) == 0
    assert f"removed the stale staging folder {staging}" in capsys.readouterr().out
    assert staging_folders(tmp_path) == [] and not target.exists()

    killed_run(target, "writing")  # the next run that writes the same output removes it
    assert main(["convert", str(tmp_path / "qwen3"), str(target), "--from", "qwen3", "--no-verify"]) == 0
    assert "removed the stale staging folder" in capsys.readouterr().err
    assert staging_folders(tmp_path) == [] and (target / "config.json").is_file()

    before = tree(target)
    killed_run(target, "replacing")  # stopped between moving the old output aside and moving the new one in
    assert not target.exists() and staging_folders(tmp_path) == [".out.replaced", ".out.writing"]
    assert main(["convert", "--clean", str(tmp_path)]) == 0  # PATH a folder: the outputs inside it
    assert f"restored {target}" in capsys.readouterr().out
    assert staging_folders(tmp_path) == [] and tree(target) == before

    refused(capsys, ["convert", "--clean", str(target), str(tmp_path / "qwen3")], "--clean PATH takes no other")


def test_a_staging_folder_whose_process_runs_or_is_elsewhere_is_kept(tmp_path):
    live = subprocess.Popen(["sleep", "60"])
    try:
        ours = tmp_path / f".out.writing-{live.pid}-abc"
        other_host = tmp_path / ".out.writing-1-def"
        for folder, owner in ((ours, {"pid": live.pid, "host": socket.gethostname()}),
                              (other_host, {"pid": 1, "host": "another-machine"})):
            folder.mkdir()
            (folder / OWNER_FILE).write_text(json.dumps(owner))
        assert clean_stale(tmp_path / "out") == [] and ours.exists() and other_host.exists()
    finally:
        live.kill()
        live.wait()
    assert clean_stale(tmp_path / "out") == [f"removed the stale staging folder {ours} (its process has ended)"]
    assert other_host.exists()
