"""Scratch folders: temporary folders of a run (the Trainer's output_dir), owned like staging folders, so that what
a killed run left is removed by the next run or by `gated-qwen convert --clean`, wherever it was made. Standard
library only."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .staging import claim, remove_if_empty, say, stale_record, unclaimed

SCRATCH_PREFIX = "gated-qwen-"  # TMPDIR/gated-qwen-PURPOSE-XXXXXXXX


@contextmanager
def scratch_folder(purpose: str) -> Iterator[Path]:
    """A temporary folder for this process (`TMPDIR/gated-qwen-PURPOSE-XXXXXXXX`, e.g. the Trainer's output_dir),
    owned as a staging folder is: this project's owner record (`"kind": "scratch"`), locked for as long as the
    process lives. Removed when the block ends; one that a killed run left (its lock released with its process) is
    removed by the next run that makes one (said, as it is done) and by `clean_stale_scratch`, never a live run's,
    whatever TMPDIR each of them has: the folder it lies in is recorded (`scratch_places`)."""
    for line in clean_stale_scratch():
        if line.startswith("removed"):
            say(line)
    lock = None
    for attempt in range(3):  # another run's clean_stale_scratch may remove the folder while it is still empty
        folder = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{purpose}-"))
        try:
            lock = claim(folder, {"kind": "scratch"})
            break
        except FileNotFoundError:
            if attempt == 2:
                raise
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
    try:
        _remember_scratch_place(folder.parent)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if lock is not None:
            os.close(lock)


def _scratch_places_file() -> Path:
    """Where the folders that held scratch folders are recorded, a line each: this user's cache
    (`$XDG_CACHE_HOME/gated-qwen/scratch-places`, by default under ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gated-qwen" / "scratch-places"


def _recorded_scratch_places() -> list[Path]:
    try:
        lines = _scratch_places_file().read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    return [Path(line) for line in lines if Path(line).is_absolute()]


def scratch_places() -> list[Path]:
    """TMPDIR, then every other folder a run of this user made scratch folders in (as recorded)."""
    return list(dict.fromkeys([Path(tempfile.gettempdir()).absolute(), *_recorded_scratch_places()]))


def _remember_scratch_place(place: Path) -> None:
    """Records `place` (where a scratch folder was just made) for `scratch_places`, once. Best effort: where the
    record cannot be written, a stale scratch folder there is found only from the same TMPDIR."""
    place = place.absolute()
    if place in _recorded_scratch_places() or "\n" in str(place):
        return
    try:
        file = _scratch_places_file()
        file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, f"{place}\n".encode())  # one appending write: lines of concurrent runs do not interleave
        finally:
            os.close(fd)
    except OSError:
        pass


def clean_stale_scratch(folder: str | os.PathLike | None = None) -> list[str]:
    """Removes the scratch folders (`scratch_folder`) in `folder` (default: every place of `scratch_places`) whose
    run has ended, owner record and all; returns one line per folder removed or left alone (a live run's, another
    machine's). Folders without this project's owner record are not touched."""
    actions = []
    for place in [Path(folder)] if folder is not None else scratch_places():
        for entry in sorted(place.glob(f"{SCRATCH_PREFIX}*")):
            if entry.is_symlink() or not entry.is_dir():
                continue
            record, state = stale_record(entry, kinds=("scratch",))
            if record is None and unclaimed(entry):
                actions.extend(remove_if_empty(entry, "scratch"))
            if record is None:
                continue
            run = f"process {record.get('pid')} on {record.get('host')}"
            if state == "stale":
                shutil.rmtree(entry, ignore_errors=True)
                actions.append(f"removed the scratch folder {entry} ({run} has ended)")
            else:
                actions.append(f"left {entry} alone: its run ({run}) " + (
                    "is still going" if state == "live" else "is on another machine"))
    return actions
