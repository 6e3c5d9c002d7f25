"""`gated_qwen.files.staging`: an output appears whole or not at all and replaces an old one only when complete; the
staging folders of killed runs (real processes killed with SIGKILL) are removed, or put back, by the next run and by
`gated-qwen convert --clean`, never a live run's; a full disk or a mounted destination leaves nothing."""

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
from transformers import Qwen3Config, Qwen3ForCausalLM

from gated_qwen.cli import main
from gated_qwen.files import OWNER_FILE, OutputError, clean_stale, output_file, output_folder
from tests.helpers import (
    TINY,
    assert_refused,
    cli_runs_in_namespace,
    private_namespace,
    refusal_line,
    run_in_namespace,
    tree,
)


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
from gated_qwen.files import output_folder

target, when = sys.argv[1:]
rename = os.rename

def killed_after_moving_the_old_output_aside(src, dst):
    rename(src, dst)
    if ".replaced-" in str(dst) and os.path.basename(dst) != "owner.json":  # the old output, not the record
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

    assert_refused(capsys, ["convert", "--clean", str(target), str(tmp_path / "qwen3")], "--clean PATH takes no other")


HOLDER = """
import sys, time
from gated_qwen.files import output_folder

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


def test_a_run_killed_before_its_owner_record_leaves_nothing_the_next_run_cannot_remove(tmp_path, capsys):
    """A run killed between creating its staging folder and writing its owner record leaves the folder empty, or
    holding only the record being written (`owner.json.partial`, unlocked: the record is renamed into place whole
    and locked): `convert --clean` and the next run that writes the output remove it. One whose record a live run is
    writing (its lock held) is left alone."""
    import fcntl

    empty, partial, live = (tmp_path / f".an.writing-{pid}-abcdefgh" for pid in (4242, 4243, 4244))
    for folder in (empty, partial, live):
        folder.mkdir()
    (partial / "owner.json.partial").write_text('{"by": "gated-qwen", "ki')
    held = os.open(live / "owner.json.partial", os.O_WRONLY | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        assert main(["convert", "--clean", str(tmp_path / "an")]) == 0
        out = capsys.readouterr().out
        for folder in (empty, partial):
            assert f"removed the empty staging folder {folder} (a run stopped before it wrote its owner record)" in out
        assert sorted(tmp_path.iterdir()) == [live]
    finally:
        os.close(held)
    with output_folder(tmp_path / "an") as staging:  # the next run: the record appears whole, under its name
        assert sorted(os.listdir(staging.parent)) == ["an", OWNER_FILE]
        (staging / "report.md").write_text("new")
    assert f"removed the empty staging folder {live}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["an"]


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
from gated_qwen.files import OutputError, output_folder

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
    refusal_line(answer["code"], answer["err"], f"No space left on the device that holds {str(disk)!r} while writing DST '{disk}/out'; the "
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
    refusal_line(**answers[0], message=f"DST '{tmp_path}/dst' is a mount point, which cannot be replaced by renaming")
    refusal_line(**answers[1], message=f"DST '{tmp_path}/old' contains the mount point '{tmp_path}/old/inner'")
    assert "qwen3 -> gated_qwen" not in answers[0]["err"] + answers[1]["err"]  # refused before any work
    assert tree(tmp_path) == before
