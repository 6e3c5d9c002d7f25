"""Every file and folder the package writes (`convert`, `analyze`, `eval-ppl`, `reproduce`, `card`) goes through here.

The rules, written once:
- **Never into an input.** An output that is, contains or lies inside one of the command's inputs (paths resolved,
  symlinks followed, including the targets of symlinked files directly inside an input folder), or that is or
  contains the current folder (`.`, `..`), is refused before anything is read or written (`check_output`).
- **Whole or not at all.** The output is built in a staging folder beside it, `.NAME.writing-PID-XXXX/`, and renamed
  into place only when complete; on any failure (disk full included) the staging folder is removed.
- **Replaced only when asked, and only by a complete new one.** An existing output (other than an empty folder) is
  refused without `overwrite`; with it, the old one is moved aside into `.NAME.replaced-PID-XXXX/` just before the
  new one is renamed into place, and removed afterwards.
- **Nothing left behind.** Each staging folder records its owner (`owner.json`: process id and host). Staging
  folders of the same output whose owning process is gone (a killed run) are removed by the next run that writes
  that output, or by `clean_stale(path)` (`gated-qwen convert --clean PATH`); a `.replaced-` folder whose output is
  missing (a run killed between the two renames) is moved back into place instead.

Standard library only: the command-line parser imports this module without the model stack.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

OWNER_FILE = "owner.json"
STAGING_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<kind>writing|replaced)-(?:(?P<pid>\d+)-)?[^.]*$")
# A staging folder without an owner record (written by an older version) counts as stale once untouched this long.
UNOWNED_STALE_SECONDS = 3600


class OutputError(ValueError):
    """An output that cannot be written as asked (it would touch an input, exists, has no writable parent...)."""


def say(message: str) -> None:
    """A progress or status line for the user (stderr, so that stdout keeps only results)."""
    print(message, file=sys.stderr)


# ------------------------------------------------------------------------------------------------------- the checks
def _resolved_inputs(inputs: Iterable[str | os.PathLike | None]) -> list[tuple[str, Path]]:
    """(as given, resolved) for every input, plus the targets of symlinked entries directly inside input folders
    (a Hugging Face cache snapshot is a folder of links into `blobs/`)."""
    out = []
    for given in inputs:
        if given is None:
            continue
        path = Path(given)
        out.append((str(given), path.resolve()))
        if path.is_dir():
            for entry in sorted(path.iterdir()):
                if entry.is_symlink():
                    out.append((str(entry), entry.resolve()))
    return out


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output(
    path: str | os.PathLike,
    *,
    inputs: Iterable[str | os.PathLike | None] = (),
    overwrite: bool = False,
    kind: str = "folder",
    create_parents: bool = False,
    label: str = "--out",
) -> Path:
    """Refuses (with `OutputError`) an output that breaks the rules of this module's docstring, before anything is
    touched; returns the path to write (resolved: a symlink is followed to the folder or file it names). `kind`:
    `"folder"` or `"file"`. `create_parents`: a missing parent folder will be created (else it is refused)."""
    given = Path(path)
    shown = f"{label} {str(path)!r}"
    if given.is_symlink() and not given.exists():
        raise OutputError(f"{shown} is a symlink to {os.readlink(given)!r}, which does not exist; remove the link or "
                          "choose another path.")
    target = given.resolve()
    if target.parent == target:
        raise OutputError(f"{shown} is the root of the file system; choose a new folder.")
    cwd = Path.cwd().resolve()
    if cwd == target or cwd.is_relative_to(target):
        raise OutputError(f"{shown} is or contains the current folder ({cwd}); choose a new folder.")
    for original, resolved in _resolved_inputs(inputs):
        relation = ("is" if resolved == target else "lies inside" if target.is_relative_to(resolved)
                    else "contains" if resolved.is_relative_to(target) else None)
        if relation:
            raise OutputError(f"{shown} {relation} the input {original!r}; writing it could destroy the input. "
                              "Choose an output outside every input.")
    if target.exists():
        if kind == "folder" and not target.is_dir():
            raise OutputError(f"{shown} exists and is not a folder; choose a folder path.")
        if kind == "file" and target.is_dir():
            raise OutputError(f"{shown} exists and is a folder; choose a file path.")
        empty_folder = target.is_dir() and not any(target.iterdir())
        if not overwrite and not empty_folder:
            raise OutputError(f"{shown} already exists; pass --overwrite (Python: overwrite=True) to replace it "
                              "once the new one is complete, or choose another path.")
    parent = target.parent
    if not parent.is_dir():
        if not create_parents or (parent.exists() and not parent.is_dir()):
            raise OutputError(f"The folder {str(parent)!r} that would hold {shown} does not exist; create it first.")
        parent = _nearest_existing(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"Cannot write in {str(parent)!r} (no write permission), where {shown} would be created.")
    return target


# ---------------------------------------------------------------------------------------------- staging folders
def _process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), to tell a reused process id apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _new_staging(target: Path, kind: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.{kind}-{os.getpid()}-", dir=target.parent))
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": _process_start(os.getpid()),
             "output": str(target)}
    (folder / OWNER_FILE).write_text(json.dumps(owner) + "\n")
    return folder


def _owner_gone(folder: Path) -> bool:
    """Whether the process that made the staging folder `folder` has ended (False when it cannot be known: another
    host, a process of another user)."""
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
        pid, host, started = int(owner["pid"]), owner.get("host"), owner.get("started")
    except (OSError, ValueError, KeyError, TypeError):
        match = STAGING_NAME.match(folder.name)
        if match and match["pid"]:
            pid, host, started = int(match["pid"]), socket.gethostname(), None
        else:
            return time.time() - folder.stat().st_mtime > UNOWNED_STALE_SECONDS
    if host != socket.gethostname():
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return started is not None and _process_start(pid) not in (None, started)  # the id now names another process


def clean_stale(path: str | os.PathLike, inside: bool = False) -> list[str]:
    """Removes the stale staging folders of the output `path` (beside it) and, with `inside` when `path` is a folder,
    those of the outputs inside it; a stale `.replaced-` folder whose output is missing is moved back into place.
    Returns one line per action."""
    path = Path(path).resolve()
    places = [(path.parent, path.name)]
    if inside and path.is_dir():
        places.append((path, None))
    actions = []
    for folder, name in places:
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            match = STAGING_NAME.match(entry.name)
            if not match or (name is not None and match["name"] != name) or not entry.is_dir():
                continue
            if entry.is_symlink() or not _owner_gone(entry):
                continue
            output = folder / match["name"]
            old = entry / match["name"]
            if match["kind"] == "replaced" and old.exists() and not output.exists() and not output.is_symlink():
                os.rename(old, output)
                actions.append(f"restored {output} from {entry} (a run was stopped while replacing it)")
            shutil.rmtree(entry, ignore_errors=True)
            actions.append(f"removed the stale staging folder {entry} (its process has ended)")
    return actions


def _make_parents(folder: Path) -> list[Path]:
    """Creates `folder` and its missing parents; returns the ones created, deepest first."""
    created = []
    while not folder.exists():
        created.append(folder)
        folder = folder.parent
    for new in reversed(created):
        new.mkdir()
    return created


def _publish(staging: Path, target: Path, kind: str, overwrite: bool, label: str) -> None:
    """Moves the complete output out of `staging` to `target` (the old `target` aside first and removed after)."""
    if not overwrite and target.exists() and not (target.is_dir() and not any(target.iterdir())):
        raise OutputError(f"{label} {str(target)!r} appeared while this run was writing it (another run?); pass "
                          "--overwrite to replace it.")
    (staging / OWNER_FILE).unlink()
    umask = os.umask(0)
    os.umask(umask)
    for path in [staging, *staging.rglob("*")]:  # mkdtemp and safetensors create private entries
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
    if kind == "file":
        os.replace(staging / target.name, target)  # atomic, also over an existing file
        shutil.rmtree(staging)
    elif target.exists():
        aside = _new_staging(target, "replaced")
        os.rename(target, aside / target.name)
        os.rename(staging, target)
        shutil.rmtree(aside)
    else:
        os.rename(staging, target)


@contextmanager
def _staged(path, kind: str, inputs, overwrite: bool, create_parents: bool, label: str) -> Iterator[Path]:
    target = check_output(path, inputs=inputs, overwrite=overwrite, kind=kind, create_parents=create_parents,
                          label=label)
    for line in clean_stale(target):
        say(line)
    created = _make_parents(target.parent) if create_parents else []
    staging = _new_staging(target, "writing")
    try:
        yield staging
        _publish(staging, target, kind, overwrite, label)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:
            try:
                folder.rmdir()
            except OSError:
                break
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutputError(f"No space left on the device while writing {label} {str(path)!r}; the partial output "
                              f"({staging}) was removed and nothing was written.") from None
        raise


def output_folder(path: str | os.PathLike, *, inputs: Iterable = (), overwrite: bool = False,
                  create_parents: bool = False, label: str = "--out"):
    """Context manager: yields an empty staging folder to fill; on success it becomes `path`, on failure it is
    removed (see the module docstring for the checks made first)."""
    return _staged(path, "folder", list(inputs), overwrite, create_parents, label)


@contextmanager
def output_file(path: str | os.PathLike, *, inputs: Iterable = (), overwrite: bool = False,
                create_parents: bool = False, label: str = "--out") -> Iterator[Path]:
    """Context manager: yields a temporary path to write the file to; on success it atomically becomes `path`."""
    with _staged(path, "file", list(inputs), overwrite, create_parents, label) as staging:
        yield staging / Path(path).resolve().name


def read_json_object(path: Path, what: str, error: type[Exception] = ValueError) -> dict:
    """The JSON object in `path`, or `error` saying in one line what is wrong with it (`what` names the file)."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as problem:
        raise error(f"{what} ({path}) is not valid JSON ({' '.join(str(problem).split())}).") from None
    if not isinstance(data, dict):
        raise error(f"{what} ({path}) must hold a JSON object, not a {type(data).__name__}.")
    return data


def write_json(path: str | os.PathLike, data) -> None:
    """`data` as indented JSON (NaN and infinities written as JavaScript does, as Python's json reads them back)."""
    Path(path).write_text(json.dumps(data, indent=2, allow_nan=True) + "\n")
