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
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY, private_namespace, run_in_namespace
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


HOLDER = """
import sys, time
from gated_qwen.outputs import output_folder

with output_folder(sys.argv[1]) as staging:
    (staging / "part.bin").write_bytes(b"x")
    print("ready", flush=True)
    time.sleep(600)
"""


def holding_a_staging_folder(target: Path, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """A live run (a real process, in another PID namespace with `prefix`) that is writing `target`."""
    run = subprocess.Popen([*prefix, sys.executable, "-c", HOLDER, str(target)], stdout=subprocess.PIPE, text=True)
    assert run.stdout.readline() == "ready\n"
    return run


def test_a_live_run_is_told_by_its_lock_not_by_its_process_id(tmp_path):
    """A run's process id may name nothing here (another PID namespace, e.g. a container sharing the volume): the
    owner record's lock, which the live process holds, keeps its staging folder; once the run ends it is removed."""
    live = holding_a_staging_folder(tmp_path / "out")
    try:
        (staging,) = tmp_path.glob(".out.writing-*")
        record = json.loads((staging / OWNER_FILE).read_text())
        assert record["by"] == "gated-qwen" and record["name"] == "out" and record["pid"] == live.pid
        gone = subprocess.Popen(["true"])
        gone.wait()  # a process id that names no process any more
        (staging / OWNER_FILE).write_text(json.dumps({**record, "pid": gone.pid}))  # as seen from another namespace
        assert clean_stale(tmp_path / "out") == [
            f"left {staging} alone: its run (process {gone.pid} on {socket.gethostname()}) is still going"]
        assert staging.exists()
    finally:
        live.kill()
        live.wait()
    assert clean_stale(tmp_path / "out") == [
        f"removed the stale staging folder {staging} (process {gone.pid} on {socket.gethostname()} has ended; it held "
        "the partial out of a run that was stopped)"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(private_namespace(pid=True) is None, reason="needs a PID namespace (root or user namespaces)")
def test_a_live_run_in_another_pid_namespace_is_left_alone(tmp_path, capsys):
    live = holding_a_staging_folder(tmp_path / "out", prefix=private_namespace(pid=True))
    try:
        (staging,) = tmp_path.glob(".out.writing-*")
        assert json.loads((staging / OWNER_FILE).read_text())["pid"] == 1  # its own namespace's first process
        assert main(["convert", "--clean", str(tmp_path / "out")]) == 0
        assert f"left {staging} alone: its run" in capsys.readouterr().out and (staging / "out" / "part.bin").exists()
    finally:
        live.kill()  # unshare, whose child (--kill-child) is killed with it, a moment later
        live.wait()
    for _ in range(100):  # (other runs on this machine may hold live scratch folders: only this staging folder's line)
        assert main(["convert", "--clean", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        if f"left {staging} alone" not in out:
            break
        time.sleep(0.1)
    assert f"removed the stale staging folder {staging}" in out
    assert list(tmp_path.iterdir()) == []


def test_only_folders_with_this_projects_owner_record_are_removed(tmp_path, capsys):
    """A user's folder whose name merely looks like a staging folder is kept, whatever it holds, and said to be."""
    lookalikes = {".out.writing-123-abcdefgh": None, ".out.replaced-1-xyz": {"pid": 1, "host": socket.gethostname()},
                  ".out.writing-4-owner": "not json",
                  ".out.writing-5-theirs": {"by": "another-tool", "kind": "writing", "name": "out", "pid": 5,
                                            "host": socket.gethostname()}}  # a record in every way but its owner
    for name, owner in lookalikes.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("mine")
        if owner is not None:
            (tmp_path / name / OWNER_FILE).write_text(owner if isinstance(owner, str) else json.dumps(owner))
    before = tree(tmp_path)
    assert main(["convert", "--clean", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    for name in lookalikes:
        assert f"left {tmp_path / name} alone: it has no gated-qwen owner record" in out
    with output_folder(tmp_path / "out") as staging:  # a run writing that output leaves them too
        (staging / "new.txt").write_text("new")
    assert tree(tmp_path) == {**before, "out": "folder", "out/new.txt": b"new"}


# ------------------------------------------------------------------------------------------ file identity
CLI_RUNS = """
import contextlib, io, json, sys
from gated_qwen.cli import main

answers = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as done:
            code = done.code
    answers.append({"code": code, "err": err.getvalue()})
print(json.dumps(answers))
"""


def cli_runs_in_namespace(setup: str, runs: list[list[str]]) -> list[dict]:
    """Each command line of `runs` (gated-qwen arguments), in one process in a private mount namespace after
    `setup`: its exit status and stderr."""
    result = run_in_namespace(setup, [sys.executable, "-c", CLI_RUNS, json.dumps(runs)])
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def one_line(answer: dict, message: str) -> None:
    assert answer["code"] == 2, answer
    assert answer["err"].endswith("\n") and answer["err"].splitlines()[-1].startswith("gated-qwen: error: ")
    assert message in answer["err"].splitlines()[-1] and "Traceback" not in answer["err"], answer["err"]


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
    one_line(answers[0], f"DST '{b}/m' is the input '{a}/m'")
    one_line(answers[1], f"DST '{b}' contains the input '{a}/m'")
    one_line(answers[2], f"--out '{alias}/config.json' is '{model}/config.json', which the input '{model}' holds")
    assert tree(tmp_path) == before


def test_a_hard_link_to_an_input_file_is_refused(tmp_path, capsys):
    """A second name for the same file (a hard link; a case-insensitive file system's other spelling) is the same
    file: compared by device and inode, not by path."""
    GatedQwenForCausalLM(GatedQwenConfig(**TINY)).save_pretrained(tmp_path / "model")
    (tmp_path / "alias").mkdir()
    os.link(tmp_path / "model" / "config.json", tmp_path / "alias" / "config.json")
    before = tree(tmp_path)
    capsys.readouterr()
    refused(capsys, ["eval-ppl", str(tmp_path / "model"), "--lengths", "8", "--out",
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
    refused(capsys, ["convert", str(src), str(old), "--from", "qwen3", "--overwrite"],
            f"DST {str(old)!r} contains '{src}/shards/{shards[0]}', which the input {str(src)!r} holds")
    refused(capsys, ["analyze", str(tmp_path / "model"), "--out", str(tmp_path / "analysis"), "--overwrite"],
            f"contains '{tmp_path}/model/notes/deeper/report.md', which the input '{tmp_path}/model' holds")
    assert tree(tmp_path) == before


def test_a_card_never_writes_through_a_link(tmp_path, capsys):
    """README.md a link to the weights: the card replaces the link; the weights stay as they were."""
    model = tmp_path / "model"
    GatedQwenForCausalLM(GatedQwenConfig(**TINY)).save_pretrained(model)
    weights = (model / "model.safetensors").read_bytes()
    (model / "README.md").symlink_to("model.safetensors")
    capsys.readouterr()
    refused(capsys, ["card", str(model)], "already exists; pass --overwrite")
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
    refused(capsys, ["card", str(snapshot), "--overwrite"], "lies inside the Hugging Face cache")
    refused(capsys, ["eval-ppl", str(tmp_path / "model"), "--lengths", "8", "--out", str(snapshot / "rows.json")],
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
    refused(capsys, ["analyze", model, "--length", "8", "--out", str(hub), "--overwrite"],
            f"--out {str(hub)!r} is the Hugging Face cache {str(hub)!r}")
    refused(capsys, ["analyze", model, "--length", "8", "--out", str(hub / ".locks"), "--overwrite"],
            f"lies inside the Hugging Face cache {str(hub)!r}")
    refused(capsys, ["analyze", model, "--length", "8", "--out", str(hub / "analysis")],
            f"lies inside the Hugging Face cache {str(hub)!r}")
    refused(capsys, ["eval-ppl", model, "--lengths", "8", "--out", str(home / "rows.json")],
            f"lies inside the Hugging Face cache {str(home)!r}")
    refused(capsys, ["analyze", model, "--length", "8", "--out", str(home), "--overwrite"],
            f"is the Hugging Face cache {str(home)!r}")
    refused(capsys, ["analyze", model, "--length", "8", "--out", str(home.parent), "--overwrite"],
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
    refused(capsys, ["analyze", str(tmp_path / "links" / "model"), "--length", "8", "--out", str(model), "--overwrite"],
            f"--out {str(model)!r} is the input {str(tmp_path / 'links' / 'model')!r}")
    refused(capsys, ["eval-ppl", str(model), "--lengths", "8", "--tokens", str(tmp_path / "links" / "tokens"),
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
    """Transformers reads `../shared/SHARD` when the index names it: that shard is an input wherever it lies (every
    file a command reads is), so no output may replace it or the folder that holds it; convert, which reads only
    SRC's own files, refuses such an index."""
    model, shard = index_naming_a_shard_outside(tmp_path)
    assert GatedQwenForCausalLM.from_pretrained(model) is not None  # what the commands read, as Transformers does
    before = tree(tmp_path)
    capsys.readouterr()
    shown = f"'{model}/../shared/{shard.name}', which the input {str(model)!r} names"
    refused(capsys, ["analyze", str(model), "--length", "8", "--out", str(shard.parent), "--overwrite"],
            f"--out {str(shard.parent)!r} contains {shown}")
    refused(capsys, ["eval-ppl", str(model), "--lengths", "8", "--out", str(shard), "--overwrite"],
            f"--out {str(shard)!r} is {shown}")
    refused(capsys, ["convert", str(model), str(shard.parent), "--to", "release", "--overwrite"],
            f"DST {str(shard.parent)!r} contains {shown}")
    refused(capsys, ["convert", str(model), str(tmp_path / "release"), "--to", "release"],
            "names weight files outside the folder (['../shared/")
    assert tree(tmp_path) == before


# ------------------------------------------------------------------------------------------ left behind
def test_a_long_output_name_gets_a_staging_name_that_fits(tmp_path):
    """A legal 250-byte name: the staging folder's name is shortened (the owner record keeps the real one), so the
    run succeeds; a run that fails leaves none of the parent folders it made; a name over the limit is refused
    before any folder is made."""
    name = "n" * 250
    target = tmp_path / "new" / "deeper" / name
    with pytest.raises(RuntimeError), output_folder(target, create_parents=True) as staging:
        (staging_folder,) = (tmp_path / "new" / "deeper").iterdir()
        assert len(staging_folder.name) <= 255 and json.loads((staging_folder / OWNER_FILE).read_text())["name"] == name
        raise RuntimeError
    assert list(tmp_path.iterdir()) == []
    with output_folder(target, create_parents=True) as staging:
        (staging / "a.txt").write_text("a")
    assert tree(tmp_path / "new" / "deeper") == {name: "folder", f"{name}/a.txt": b"a"}
    with pytest.raises(OutputError, match="is 256 bytes, more than the file system allows"):
        with output_folder(tmp_path / "other" / ("n" * 256), create_parents=True):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]


FULL_DISK = """
import errno, os, sys
from gated_qwen.outputs import OutputError, output_folder

disk = sys.argv[1]
with open(os.path.join(disk, "filler"), "wb", buffering=0) as filler:  # fill the disk
    try:
        while True:
            filler.write(b"\\0" * 4096)
    except OSError as error:
        assert error.errno == errno.ENOSPC
os.mkdir(os.path.join(disk, "probe"))  # folders can still be made: what fails is writing the owner record
os.rmdir(os.path.join(disk, "probe"))
try:
    with output_folder(os.path.join(disk, "out")):
        raise AssertionError("the staging folder was made")
except OutputError as error:
    print(error)
print(sorted(os.listdir(disk)))
"""


@pytest.mark.skipif(private_namespace() is None, reason="needs a mount namespace (root or user namespaces)")
def test_a_full_disk_before_the_owner_record_leaves_nothing(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    result = run_in_namespace(f"mount -t tmpfs -o size=64k tmpfs {disk}", [sys.executable, "-c", FULL_DISK, disk])
    assert result.returncode == 0, result.stderr[-3000:]
    message, listing = result.stdout.splitlines()[-2:]
    assert message.startswith(f"No space left on the device that holds {str(disk)!r} while writing --out")
    assert listing == "['filler']"


@pytest.mark.skipif(private_namespace() is None, reason="needs a mount namespace (root or user namespaces)")
def test_a_full_disk_while_writing_is_said_plainly_and_leaves_nothing(tmp_path):
    """A real full disk (a 64 KiB tmpfs): safetensors' own error becomes one plain line naming the folder."""
    Qwen3ForCausalLM(Qwen3Config(**TINY)).save_pretrained(tmp_path / "qwen3")
    disk = tmp_path / "disk"
    disk.mkdir()
    (answer,) = cli_runs_in_namespace(f"mount -t tmpfs -o size=64k tmpfs {disk}", [
        ["convert", str(tmp_path / "qwen3"), str(disk / "out"), "--from", "qwen3", "--no-verify"]])
    one_line(answer, f"No space left on the device that holds {str(disk)!r} while writing DST '{disk}/out'; the "
                     "partial output was removed")
    assert list(disk.iterdir()) == []


@pytest.mark.skipif(private_namespace() is None, reason="needs a mount namespace (root or user namespaces)")
def test_a_mounted_destination_is_refused_before_staging(tmp_path):
    """A DST that is a mount point cannot be renamed: refused in one line before anything is staged; nor is an
    output replaced whose removal would reach into a mounted file system."""
    Qwen3ForCausalLM(Qwen3Config(**TINY)).save_pretrained(tmp_path / "qwen3")
    (tmp_path / "dst").mkdir()
    (tmp_path / "old" / "inner").mkdir(parents=True)
    before = tree(tmp_path)
    answers = cli_runs_in_namespace(
        f"mount -t tmpfs tmpfs {tmp_path}/dst; mount -t tmpfs tmpfs {tmp_path}/old/inner; "
        f"touch {tmp_path}/old/inner/precious",
        [["convert", str(tmp_path / "qwen3"), str(tmp_path / "dst"), "--from", "qwen3"],
         ["convert", str(tmp_path / "qwen3"), str(tmp_path / "old"), "--from", "qwen3", "--overwrite"]])
    one_line(answers[0], f"DST '{tmp_path}/dst' is a mount point, which cannot be replaced by renaming")
    one_line(answers[1], f"DST '{tmp_path}/old' contains the mount point '{tmp_path}/old/inner'")
    assert "qwen3 -> gated_qwen" not in answers[0]["err"] + answers[1]["err"]  # refused before any work
    assert tree(tmp_path) == before
