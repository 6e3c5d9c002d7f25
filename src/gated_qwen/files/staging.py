"""Outputs whole or not at all: each is built in a staging folder beside it (`.NAME.writing-PID-XXXXXXXX/NAME`),
owned by this project's owner record, and renamed into place only when complete (`output_folder`, `output_file`);
`clean_stale` removes what a killed run left. The rules are in `gated_qwen.files`' docstring.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .identity import OutputError, check_output, name_max, nearest_existing

OWNER_FILE = "owner.json"
PARTIAL_OWNER_FILE = OWNER_FILE + ".partial"  # the record being written (`claim`)
OWNER = "gated-qwen"  # the owner record's "by": what makes a folder one of this project's staging folders
STAGING_NAME = re.compile(r"^\..+\.(?:writing|replaced)-\d+-[^.]*$")
MKDTEMP_SUFFIX = 8  # the random characters tempfile.mkdtemp appends


def say(message: str) -> None:
    """A progress or status line for the user (stderr, so that stdout keeps only results)."""
    print(message, file=sys.stderr)


def claim(folder: Path, record: dict) -> int:
    """Writes this project's owner record (`record` with `by`, process and host) into `folder` and returns the
    descriptor that holds its lock (`flock`, held until it is closed or the process ends). The record is written
    under another name, locked, and renamed into place, so that `owner.json` appears whole and locked; a run killed
    before leaves its folder empty or holding only the unlocked `PARTIAL_OWNER_FILE` (`unclaimed`)."""
    partial = folder / PARTIAL_OWNER_FILE
    lock = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with os.fdopen(os.dup(lock), "w") as owner:  # closing the copy keeps the lock
            owner.write(json.dumps({"by": OWNER, **record, "pid": os.getpid(), "host": socket.gethostname()}) + "\n")
        os.rename(partial, folder / OWNER_FILE)
    except BaseException:
        os.close(lock)
        raise
    return lock


def unclaimed(folder: Path) -> bool:
    """Whether `folder` (named as this project's staging folders are) is one that a run killed before its owner
    record was in place left behind: empty, or holding only the partial record, whose lock no process holds."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return False
    if entries != [PARTIAL_OWNER_FILE]:
        return entries == []
    try:
        fd = os.open(folder / PARTIAL_OWNER_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False  # its run is writing the record right now
    finally:
        os.close(fd)


def remove_if_empty(folder: Path, kind: str) -> list[str]:
    """Removes an `unclaimed` `folder`'s partial owner record, then `folder` if that left it empty; returns what was
    done (one line, or none where the folder still holds something)."""
    (folder / PARTIAL_OWNER_FILE).unlink(missing_ok=True)
    try:
        folder.rmdir()  # only if empty
    except OSError:
        return []
    return [f"removed the empty {kind} folder {folder} (a run stopped before it wrote its owner record)"]


class _Staging:
    """A staging folder beside an output: `folder` holds the owner record (locked while this process runs) and
    `item`, named as the output: the output being built (`writing`) or the old output set aside (`replaced`)."""

    def __init__(self, target: Path, kind: str):
        prefix = f".{target.name}.{kind}-{os.getpid()}-"
        room = name_max(target.parent) - MKDTEMP_SUFFIX
        name = target.name
        while len(os.fsencode(prefix)) > room and name:  # a staging name that fits whenever the output's does
            name = name[:-1]
            prefix = f".{name}.{kind}-{os.getpid()}-"
        self._lock = None
        for attempt in range(3):  # another run's clean_stale may remove the folder while it is still empty
            self.folder = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
            self.item = self.folder / target.name
            try:
                self._lock = claim(self.folder, {"kind": kind, "name": target.name})
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
            except BaseException:
                self.remove()
                raise

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def stale_record(folder: Path, kinds: tuple[str, ...] = ("writing", "replaced")) -> tuple[dict | None, str]:
    """(the owner record, "stale") for a staging folder of this project (or another folder it owns, of `kinds`)
    whose run has ended; (record, "live") while its run holds the lock; (None, why) for a folder that is not one of
    this project's folders of those kinds."""
    try:
        fd = os.open(folder / OWNER_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None, "it has no gated-qwen owner record"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "its owner record is not a file"
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            live = False
        except BlockingIOError:
            live = True
        with os.fdopen(os.dup(fd)) as owner:
            try:
                record = json.loads(owner.read(65536))
            except (ValueError, UnicodeDecodeError):
                record = None
    finally:
        os.close(fd)
    named = isinstance(record, dict) and isinstance(record.get("name"), str) and record["name"] not in (
        "", ".", "..") and "/" not in record["name"] and "\0" not in record["name"]
    if not (isinstance(record, dict) and record.get("by") == OWNER and record.get("kind") in kinds
            and (named or record["kind"] == "scratch")):
        return None, "it has no gated-qwen owner record"
    if live:
        return record, "live"
    if record.get("host") != socket.gethostname():
        return record, "elsewhere"  # a file system shared with another machine may not share its locks
    return record, "stale"


def clean_stale(path: str | os.PathLike, inside: bool = False) -> list[str]:
    """Removes the stale staging folders of the output `path` (beside it) and, with `inside` when `path` is a folder,
    those of the outputs inside it; a stale `.replaced-` folder whose output is missing is moved back into place.
    Returns one line per action (and per staging folder left alone)."""
    path = Path(path).absolute()
    path = path.parent.resolve() / path.name
    places = [(path.parent, path.name)]
    if inside and path.is_dir() and not path.is_symlink():
        places.append((path, None))
    actions = []
    for folder, name in places:
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            if not STAGING_NAME.match(entry.name) or entry.is_symlink() or not entry.is_dir():
                continue
            record, state = stale_record(entry)
            ours = name is None or entry.name.startswith(f".{name}.")
            if record is None and ours and unclaimed(entry):
                actions.extend(remove_if_empty(entry, "staging"))
                continue
            if record is None:
                if ours:
                    actions.append(f"left {entry} alone: {state}, so it is not a staging folder of this project")
                continue
            if name is not None and record["name"] != name:
                continue
            run = f"process {record.get('pid')} on {record.get('host')}"
            if state != "stale":
                actions.append(f"left {entry} alone: its run ({run}) " + (
                    "is still going" if state == "live" else "is on another machine"))
                continue
            output, item = folder / record["name"], entry / record["name"]
            held = "nothing"
            if item.exists() or item.is_symlink():
                held = (f"the partial {record['name']} of a run that was stopped" if record["kind"] == "writing"
                        else f"the previous {record['name']}, already replaced")
            if record["kind"] == "replaced" and item.exists() and not output.exists() and not output.is_symlink():
                os.rename(item, output)
                actions.append(f"restored {output} from {entry} (a run was stopped while replacing it)")
                held = "nothing more"
            shutil.rmtree(entry, ignore_errors=True)
            actions.append(f"removed the stale staging folder {entry} ({run} has ended; it held {held})")
    return actions




def _make_parents(folder: Path, created: list[Path]) -> None:
    """Creates `folder` and its missing parents, appending each one created to `created`, deepest first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for new in reversed(missing):
        new.mkdir()
        created.insert(0, new)


def _publish(staging: _Staging, target: Path, kind: str, overwrite: bool, label: str) -> None:
    """Moves the complete output out of `staging` to `target` (the old `target` aside first and removed after)."""
    present = target.exists() or target.is_symlink()
    if not overwrite and present and not (kind == "folder" and target.is_dir() and not any(target.iterdir())):
        raise OutputError(f"{label} {str(target)!r} appeared while this run was writing it (another run?); pass "
                          "--overwrite to replace it.")
    umask = os.umask(0)
    os.umask(umask)
    for path in [staging.item, *staging.item.rglob("*")]:  # mkdtemp and safetensors create private entries
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
    if kind == "file" or not present:
        os.replace(staging.item, target)  # atomic, also over an existing file (or a link: never written through)
    else:
        aside = _Staging(target, "replaced")
        try:
            os.rename(target, aside.item)
        except BaseException:
            aside.remove()
            raise
        try:
            os.rename(staging.item, target)
        except BaseException:
            os.rename(aside.item, target)  # the old one back (if this fails too, `clean_stale` puts it back)
            aside.remove()
            raise
        aside.remove()


DISK_FULL = ("No space left on device", "StorageFull", "Disk quota exceeded", "QuotaExceeded", "os error 28",
             "os error 122")


def _disk_full(error: BaseException, folder: Path) -> bool:
    """Whether `error` (or what caused it) is a full disk or quota: an OSError's errno, or the message of a writer
    that wraps it (safetensors, PyTorch: "file write failed" on a device with no space left)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error)
        if any(phrase in text for phrase in DISK_FULL):
            return True
        if "write failed" in text:
            try:
                status = os.statvfs(folder)
                return status.f_bavail * status.f_frsize < 2**20
            except OSError:
                return False
        error = error.__cause__ or error.__context__
    return False


@contextmanager
def _staged(path, kind: str, inputs, overwrite: bool, create_parents: bool, label: str) -> Iterator[Path]:
    target = check_output(path, inputs=inputs, overwrite=overwrite, kind=kind, create_parents=create_parents,
                          label=label)
    for line in clean_stale(target):
        say(line)
    created: list[Path] = []
    staging = None
    try:
        if create_parents:
            _make_parents(target.parent, created)
        staging = _Staging(target, "writing")
        if kind == "folder":
            staging.item.mkdir()
        yield staging.item
        _publish(staging, target, kind, overwrite, label)
    except BaseException as error:
        full = _disk_full(error, target.parent if target.parent.exists() else nearest_existing(target.parent))
        if staging is not None:
            staging.remove()
        for folder in created:
            try:
                folder.rmdir()
            except OSError:
                break
        if full:
            raise OutputError(f"No space left on the device that holds {str(nearest_existing(target.parent))!r} "
                              f"while writing {label} {str(path)!r}; the partial output was removed and nothing was "
                              "written. Free some space there, or choose a folder on another device.") from None
        raise
    staging.remove()


def output_folder(path: str | os.PathLike, *, inputs: Iterable = (), overwrite: bool = False,
                  create_parents: bool = False, label: str = "--out"):
    """Context manager: yields an empty staging folder to fill; on success it becomes `path`, on failure it is
    removed (see the module docstring for the checks made first)."""
    return _staged(path, "folder", list(inputs), overwrite, create_parents, label)


def output_file(path: str | os.PathLike, *, inputs: Iterable = (), overwrite: bool = False,
                create_parents: bool = False, label: str = "--out"):
    """Context manager: yields a temporary path to write the file to; on success it atomically becomes `path`."""
    return _staged(path, "file", list(inputs), overwrite, create_parents, label)


def write_json(path: str | os.PathLike, data) -> None:
    """`data` as indented JSON (NaN and infinities written as JavaScript does, as Python's json reads them back)."""
    Path(path).write_text(json.dumps(data, indent=2, allow_nan=True) + "\n")
