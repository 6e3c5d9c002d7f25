"""What an output may not be, checked before anything is read or written (`check_output`): an input (by file
identity, through any link), inside one, or holding one; a Hugging Face cache; a mount point; a name longer than the
file system allows. The rules are in `gated_qwen.files`' docstring."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from huggingface_hub import constants

MAX_INPUT_ENTRIES = 200_000  # files and folders an input may reach (links followed) before it is refused
CACHE_REPO = re.compile(r"^(?:models|datasets|spaces)--")  # a repository's folder in a Hugging Face cache


class OutputError(ValueError):
    """An output that cannot be written as asked (it would touch an input, exists, has no writable parent...)."""


def resolved(path: str | os.PathLike, shown: str, error: type[Exception] = OutputError) -> Path:
    """`Path(path).resolve()`, or `error` (one line, `shown` naming the path) when following its links leads back to
    a link already followed (`model.safetensors -> model.safetensors`), where it names nothing: Python 3.11's
    `resolve` raises a bare RuntimeError there, later versions return a path that names nothing."""
    try:
        os.stat(path)
    except OSError as problem:
        if problem.errno == errno.ELOOP:
            raise error(f"{shown} is a link loop: following its links leads back to a link already followed (e.g. "
                        "a file that links to itself), so it names no file; replace the link with the file or folder "
                        "it should name.") from None
    except ValueError:  # a NUL byte in the name: nothing to resolve, the caller refuses it
        pass
    return Path(path).resolve()


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


def name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def nearest_existing(path: Path) -> Path:
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


def _refuse_a_name_too_long(target: Path, shown: str) -> None:
    """Refuses an output whose last name is longer than its file system allows."""
    allowed = name_max(nearest_existing(target.parent))
    if len(os.fsencode(target.name)) > allowed:
        raise OutputError(f"{shown}: the name {target.name[:40]!r}... is {len(os.fsencode(target.name))} bytes, more "
                          f"than the file system allows ({allowed}); choose a shorter name.")


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
    resolved(given, shown)  # a link loop is named as such, for a file as for a folder
    if given.is_symlink() and not given.exists():
        raise OutputError(f"{shown} is a symlink to {os.readlink(given)!r}, which does not exist; remove the link or "
                          "choose another path.")
    target = (resolved(given, shown) if kind == "folder"
              else resolved(given.absolute().parent, f"{shown}'s folder") / given.name)
    if target.parent == target:
        raise OutputError(f"{shown} is the root of the file system; choose a new folder.")
    _refuse_a_name_too_long(target, shown)
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
        if parent.exists():
            raise OutputError(f"{str(parent)!r}, which would hold {shown}, is a file, not a folder; choose another "
                              "path.")
        if not create_parents:
            raise OutputError(f"The folder {str(parent)!r} that would hold {shown} does not exist; create it first.")
        parent = nearest_existing(parent)
        if not parent.is_dir():
            raise OutputError(f"{str(parent)!r}, on the way to {shown}, is not a folder; choose another path.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"Cannot write in {str(parent)!r} (no write permission), where {shown} would be created.")
    return target


