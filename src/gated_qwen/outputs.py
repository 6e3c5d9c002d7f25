"""Every file and folder the package writes (`convert`, `analyze`, `eval-ppl`, `reproduce`, `card`) goes through here.

The rules, written once:
- **Never into, over or around an input, by file identity.** Files and folders are compared by what they are
  (device and inode), not by their paths, so a second path to the same folder (a bind mount, a case-insensitive file
  system, a hard link, a symlink at any depth) is recognised. An input is every file and folder a command may read:
  each input given, and, for a folder, everything under it, links followed, and every file an index in it names
  (a shard `../shared/x`, which Transformers follows, wherever it lies). An output is refused before anything is
  read or written (`check_output`) when it is one of those, lies inside one (one of its folders is an input folder),
  or would replace something that holds one (the old output is walked as its removal would walk it, mount points
  included); the current folder counts as an input. Also refused: an output that is, lies inside or holds a Hugging
  Face cache (the configured HF_HOME and hub cache, a folder of `models--*/` repositories, a repository: a
  snapshot's files are links into blobs that other snapshots share), an output that is or holds a mount point
  (renaming it or removing it would fail half-way or reach into the mounted file system), a name longer than the
  file system allows.
  A file output never writes through a link: a link in its place is replaced, its target left as it is.
- **Whole or not at all.** The output is built in a staging folder beside it, `.NAME.writing-PID-XXXXXXXX/NAME`,
  and renamed into place only when complete; on any failure (a full disk included, said as such) the staging folder
  and the parent folders this run created are removed.
- **Replaced only when asked, and only by a complete new one.** An existing output (other than an empty folder) is
  refused without `overwrite`; with it, the old one is moved aside into `.NAME.replaced-PID-XXXXXXXX/NAME` just
  before the new one is renamed into place, and removed afterwards.
- **Nothing left behind, no live run disturbed.** Each staging folder holds this project's owner record,
  `owner.json` (`"by": "gated-qwen"`, process, host, output name), which the run holds an exclusive `flock` on for
  its whole life: the lock, not the process id, says whether the run is live (a process id means nothing in another
  PID namespace, e.g. a container sharing the volume). A staging folder whose lock is free (its run was killed) is
  removed by the next run that writes that output, or by `clean_stale(path)` (`gated-qwen convert --clean PATH`),
  which say what they removed; a `.replaced-` folder whose output is missing (a run killed between the two renames)
  is moved back into place first. A folder without this project's owner record is never removed, whatever its name.

What the package reads (JSON objects, a config.json's values) is checked in `reading.py`. Standard library only: the
command-line parser imports this module without the model stack.
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

OWNER_FILE = "owner.json"
OWNER = "gated-qwen"  # the owner record's "by": what makes a folder one of this project's staging folders
STAGING_NAME = re.compile(r"^\..+\.(?:writing|replaced)-\d+-[^.]*$")
MKDTEMP_SUFFIX = 8  # the random characters tempfile.mkdtemp appends
MAX_INPUT_ENTRIES = 200_000  # files and folders an input may reach (links followed) before it is refused
CACHE_REPO = re.compile(r"^(?:models|datasets|spaces)--")  # a repository's folder in a Hugging Face cache


class OutputError(ValueError):
    """An output that cannot be written as asked (it would touch an input, exists, has no writable parent...)."""


def say(message: str) -> None:
    """A progress or status line for the user (stderr, so that stdout keeps only results)."""
    print(message, file=sys.stderr)


# ------------------------------------------------------------------------------------------------------- the checks
def _identity(status: os.stat_result) -> tuple[int, int]:
    return status.st_dev, status.st_ino


class _Inputs:
    """Every file and folder the inputs reach, by identity: each given path, under a folder everything (links
    followed), and every file an index in such a folder names (`*.index.json`: its `weight_map`'s files, which
    Transformers reads wherever they lie, `../shared/x` included). `top` (identity -> an input as given), `reached`
    (identity -> the path it was reached by, the input it belongs to, and how: "holds" or "names") and `chains`
    (identity of a folder that holds an input -> that input)."""

    def __init__(self, inputs: Iterable[str | os.PathLike | None], cwd: Path):
        self.top: dict[tuple[int, int], str] = {}
        self.reached: dict[tuple[int, int], tuple[str, str, str]] = {}
        self.chains: dict[tuple[int, int], str] = {
            _identity(folder.stat()): "the current folder" for folder in [*reversed(cwd.parents), cwd]}
        for given in inputs:
            if given is not None:
                self._add(str(given), Path(given))

    def _reach(self, status: os.stat_result, name: str, given: str, how: str = "holds") -> None:
        if len(self.reached) >= MAX_INPUT_ENTRIES:
            raise OutputError(f"The input {given!r} reaches more than {MAX_INPUT_ENTRIES} files and folders "
                              "(links followed); give a folder that holds only what the command reads.")
        self.reached.setdefault(_identity(status), (name, given, how))

    def _add(self, given: str, path: Path) -> None:
        try:
            status = path.stat()
        except OSError:  # a missing input: nothing to protect (the command refuses it itself)
            return
        self.top.setdefault(_identity(status), given)
        if path.is_symlink():
            self.top.setdefault(_identity(path.lstat()), given)
        for folder in path.resolve().parents:
            self.chains.setdefault(_identity(folder.stat()), f"the input {given!r}")
        if not stat.S_ISDIR(status.st_mode):
            return
        stack, seen = [(given, path)], {_identity(status)}
        while stack:
            shown, folder = stack.pop()
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError:
                continue  # unreadable: the command cannot read it either
            for entry in entries:
                name = f"{shown}/{entry.name}"
                if entry.is_symlink():
                    self._reach(entry.stat(follow_symlinks=False), name, given)
                try:
                    target = entry.stat()
                except OSError:
                    continue  # a dangling link
                self._reach(target, name, given)
                if stat.S_ISDIR(target.st_mode) and _identity(target) not in seen:
                    seen.add(_identity(target))
                    stack.append((name, Path(folder) / entry.name))
        for named in _files_an_index_names(path):
            for status in _statuses(path / named):
                self._reach(status, f"{given}/{named}", given, "names")

    def describe(self, identity: tuple[int, int]) -> str | None:
        """What `identity` is among the inputs, for a message; None when it is none of them."""
        if identity in self.top:
            return f"the input {self.top[identity]!r}"
        if identity in self.reached:
            name, given, how = self.reached[identity]
            return f"{name!r}, which the input {given!r} {how}"
        return None


def _statuses(path: Path) -> list[os.stat_result]:
    """The identity of `path` and, for a link, of what it names (none where nothing is)."""
    found = []
    for follow in (False, True):
        try:
            found.append(os.stat(path, follow_symlinks=follow))
        except OSError:
            pass
    return found


INDEX_MAX_BYTES = 64 * 2**20


def _files_an_index_names(folder: Path) -> list[str]:
    """The files that the indexes of a model folder (`*.index.json`, e.g. `model.safetensors.index.json`) name in
    their `weight_map`, as written (an index that is not one names nothing: the command refuses it itself)."""
    named = set()
    for index in sorted(folder.glob("*.index.json")):
        try:
            with open(index, "rb") as file:
                weight_map = json.loads(file.read(INDEX_MAX_BYTES + 1)[:INDEX_MAX_BYTES]).get("weight_map")
        except (OSError, ValueError, RecursionError, AttributeError):
            continue
        if isinstance(weight_map, dict):
            named.update(value for value in weight_map.values()
                         if isinstance(value, str) and value and "\0" not in value)
    return sorted(named)


def _mount_points() -> set[str]:
    """Every mount point (Linux: /proc/self/mountinfo, which also lists bind mounts within one file system)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return set()
    unescape = lambda text: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), text)
    return {unescape(line.split()[4]) for line in lines if len(line.split()) > 4}


def _is_mount_point(path: Path, mounts: set[str]) -> bool:
    return str(path) in mounts or os.path.ismount(path)


def _is_cache_repository(folder: Path) -> bool:
    """Whether `folder` is a repository of a Hugging Face cache (`models--ORG--NAME/`, holding `blobs/` or
    `snapshots/`)."""
    return bool(CACHE_REPO.match(folder.name)) and ((folder / "snapshots").is_dir() or (folder / "blobs").is_dir())


def _holds_cache_repository(folder: Path) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(CACHE_REPO.match(entry.name) and _is_cache_repository(Path(entry.path)) for entry in entries)
    except OSError:
        return False


def _configured_caches() -> list[Path]:
    """The Hugging Face caches this machine is configured with that exist: HF_HOME (the token lives there) and the
    hub cache (huggingface_hub's constants, which read HF_HOME, HF_HUB_CACHE, XDG_CACHE_HOME)."""
    from huggingface_hub import constants

    return [Path(folder).resolve() for folder in (constants.HF_HOME, constants.HF_HUB_CACHE) if Path(folder).is_dir()]


def _cache_around(target: Path) -> tuple[Path, str] | None:
    """The Hugging Face cache that `target` is, lies inside or holds, and which of the three: a configured one, a
    repository of one (`models--ORG--NAME/`) or a cache root (a folder that holds repositories)."""
    configured = _configured_caches()
    for folder in [target, *target.parents]:
        if folder.exists() and (folder in configured or _is_cache_repository(folder)
                                or _holds_cache_repository(folder)):
            return folder, "is" if folder == target else "lies inside"
    held = [cache for cache in configured if target in cache.parents]
    return (held[0], "contains") if held else None


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _what_it_would_replace(target: Path, inputs: _Inputs, mounts: set[str], shown: str) -> None:
    """Refuses replacing `target` when its removal would reach an input or a mounted file system: the old output
    is walked as `shutil.rmtree` walks it (links not followed, mount points entered)."""
    device = target.lstat().st_dev
    for folder, subfolders, files in os.walk(target):
        for name in sorted(subfolders) + sorted(files):
            path = Path(folder) / name
            status = path.lstat()
            what = inputs.describe(_identity(status)) or inputs.chains.get(_identity(status))  # or holds one
            if what == "the current folder":
                raise OutputError(f"{shown} contains the current folder ({path}); choose a new folder.")
            if what is not None:
                raise OutputError(f"{shown} contains {what} (as {str(path)!r}); replacing it could destroy the input. "
                                  "Choose an output outside every input.")
            if stat.S_ISDIR(status.st_mode) and _is_cache_repository(path):
                raise OutputError(f"{shown} contains the Hugging Face cache {str(path.parent)!r}; replacing it would "
                                  "delete the models cached there. Choose another path.")
            if stat.S_ISDIR(status.st_mode) and (status.st_dev != device or _is_mount_point(path, mounts)):
                raise OutputError(f"{shown} contains the mount point {str(path)!r}; replacing it would delete what is "
                                  "mounted there. Unmount it, or choose another path.")


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
    touched; returns the path to write. `kind`: `"folder"` (a link is followed to the folder it names) or `"file"`
    (its folder resolved, the name kept: a link there is replaced, not written through). `create_parents`: a missing
    parent folder will be created (else it is refused)."""
    given = Path(path)
    shown = f"{label} {str(path)!r}"
    if given.name in ("", ".", "..") and kind == "file":
        raise OutputError(f"{shown} names a folder; give a file path.")
    if given.is_symlink() and not given.exists():
        raise OutputError(f"{shown} is a symlink to {os.readlink(given)!r}, which does not exist; remove the link or "
                          "choose another path.")
    target = given.resolve() if kind == "folder" else given.absolute().parent.resolve() / given.name
    if target.parent == target:
        raise OutputError(f"{shown} is the root of the file system; choose a new folder.")
    if len(os.fsencode(target.name)) > _name_max(_nearest_existing(target.parent)):
        raise OutputError(f"{shown}: the name {target.name[:40]!r}... is {len(os.fsencode(target.name))} bytes, more "
                          f"than the file system allows ({_name_max(_nearest_existing(target.parent))}); choose a "
                          "shorter name.")
    cache = _cache_around(target)
    if cache is not None:
        folder, relation = cache
        raise OutputError(f"{shown} {relation} the Hugging Face cache {str(folder)!r}, whose snapshots are links into "
                          "blobs they share; write outside it (to work on a cached model, copy it to a folder of its "
                          "own first: `hf download REPO_ID --local-dir DIR`).")
    cwd = Path.cwd().resolve()
    known = _Inputs(inputs, cwd)
    exists = target.exists() or target.is_symlink()
    if exists:
        identity = _identity(target.lstat() if kind == "file" else target.stat())
        what = known.describe(identity) or known.chains.get(identity)
        if what == "the current folder":
            raise OutputError(f"{shown} is or contains the current folder ({cwd}); choose a new folder.")
        if what is not None:
            relation = "contains" if identity not in known.top and identity not in known.reached else "is"
            raise OutputError(f"{shown} {relation} {what}; writing it could destroy the input. Choose an output "
                              "outside every input.")
    for folder in target.parents:
        if folder.exists():
            what = known.describe(_identity(folder.stat()))
            if what is not None:
                raise OutputError(f"{shown} lies inside {what}; writing it could destroy the input. Choose an "
                                  "output outside every input.")
    mounts = _mount_points()
    if exists:
        if kind == "folder" and not target.is_dir():
            raise OutputError(f"{shown} exists and is not a folder; choose a folder path.")
        if kind == "file" and target.is_dir():
            raise OutputError(f"{shown} exists and is a folder; choose a file path.")
        empty_folder = kind == "folder" and not any(target.iterdir())
        if not overwrite and not empty_folder:
            raise OutputError(f"{shown} already exists; pass --overwrite (Python: overwrite=True) to replace it "
                              "once the new one is complete, or choose another path.")
        if _is_mount_point(target, mounts):
            raise OutputError(f"{shown} is a mount point, which cannot be replaced by renaming; write into a new "
                              "folder inside it, or choose another path.")
        if kind == "folder":
            _what_it_would_replace(target, known, mounts, shown)
    parent = target.parent
    if not parent.is_dir():
        if not create_parents or (parent.exists() and not parent.is_dir()):
            raise OutputError(f"The folder {str(parent)!r} that would hold {shown} does not exist; create it first.")
        parent = _nearest_existing(parent)
        if not parent.is_dir():
            raise OutputError(f"{str(parent)!r}, on the way to {shown}, is not a folder; choose another path.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"Cannot write in {str(parent)!r} (no write permission), where {shown} would be created.")
    return target


# ---------------------------------------------------------------------------------------------- staging folders
def _claim(folder: Path, record: dict) -> int:
    """Writes this project's owner record (`record` with `by`, process and host) into `folder` and returns the
    descriptor that holds its lock (`flock`, held until it is closed or the process ends)."""
    lock = os.open(folder / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with os.fdopen(os.dup(lock), "w") as owner:  # closing the copy keeps the lock
            owner.write(json.dumps({"by": OWNER, **record, "pid": os.getpid(), "host": socket.gethostname()}) + "\n")
    except BaseException:
        os.close(lock)
        raise
    return lock


class _Staging:
    """A staging folder beside an output: `folder` holds the owner record (locked while this process runs) and
    `item`, named as the output: the output being built (`writing`) or the old output set aside (`replaced`)."""

    def __init__(self, target: Path, kind: str):
        prefix = f".{target.name}.{kind}-{os.getpid()}-"
        room = _name_max(target.parent) - MKDTEMP_SUFFIX
        name = target.name
        while len(os.fsencode(prefix)) > room and name:  # a staging name that fits whenever the output's does
            name = name[:-1]
            prefix = f".{name}.{kind}-{os.getpid()}-"
        self.folder = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
        self.item = self.folder / target.name
        self._lock = None
        try:
            self._lock = _claim(self.folder, {"kind": kind, "name": target.name})
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _stale_record(folder: Path, kinds: tuple[str, ...] = ("writing", "replaced")) -> tuple[dict | None, str]:
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
            record, state = _stale_record(entry)
            if record is None:
                if name is None or entry.name.startswith(f".{name}."):
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


# ---------------------------------------------------------------------------------------------- scratch folders
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
    folder = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{purpose}-"))
    lock = None
    try:
        lock = _claim(folder, {"kind": "scratch"})
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
            record, state = _stale_record(entry, kinds=("scratch",))
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
        full = _disk_full(error, target.parent if target.parent.exists() else _nearest_existing(target.parent))
        if staging is not None:
            staging.remove()
        for folder in created:
            try:
                folder.rmdir()
            except OSError:
                break
        if full:
            raise OutputError(f"No space left on the device that holds {str(_nearest_existing(target.parent))!r} "
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
