"""Reading and writing checkpoints one tensor at a time.

`Checkpoint` lists a folder's tensors (names, shapes, dtypes) from the safetensors headers, read with plain reads
(nothing is mapped, so a file larger than the memory is listed, and refused by the memory check, like any other),
and `get(name)` reads that one tensor's bytes, through the handle opened when the file was checked. `write_weights`
computes the output tensors from a plan (`name -> TensorPlan`) one at a time, each written into its shard in a staging
folder (`gated_qwen.files`) as it is computed: peak memory is about the largest tensor (plus the imports). Every way a
folder can be unreadable (config.json, the index, a shard, a pickle) is a `ConversionError` that names the file.

SRC's files are the regular files inside SRC: a link is followed only when it stays inside SRC (or, in a Hugging
Face cache snapshot or a sub-folder of one, inside the repository's `blobs/`, where a snapshot's links point); a
weight file, an index entry or a carried file that reaches elsewhere, or that is not a regular file, is refused by
name (`source_file`). Each is opened once and checked as opened (`SourceFile`), and every tensor read and every file
carried goes through that handle: a name swapped for a link while the conversion runs reaches nothing.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import re
import shutil
import stat
import struct
import weakref
import zipfile
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from tqdm.auto import tqdm
from transformers.dynamic_module_utils import get_relative_import_files

from ..files import read_json_object, write_json
from ..files.identity import resolved as resolved_path
from ..files.reading import safetensors_header
from ..model import modeling_gated, modeling_gated_moe
from .errors import ConversionError

# In the order safetensors writes a file's tensors (then by name), as `write_weights` does.
SAFETENSORS_DTYPES = {
    "I64": torch.int64, "F64": torch.float64, "F32": torch.float32, "I32": torch.int32, "BF16": torch.bfloat16,
    "F16": torch.float16, "I16": torch.int16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_DTYPE_ORDER = {dtype: rank for rank, dtype in enumerate(SAFETENSORS_DTYPES.values())}

# Files carried over unchanged from the source folder: tokenizer, generation defaults, licence (never code: a `*.py`
# file is carried only when asked, `carry_code`).
CARRIED_FILE_PATTERNS = (
    "tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template*",
    "generation_config.json", "LICENSE*", "NOTICE*",
)


def _source_roots(src: Path) -> list[Path]:
    """The folders SRC's files may lie in, resolved: SRC, and when SRC is or lies inside a Hugging Face cache snapshot
    (`models--ORG--NAME/snapshots/REVISION[/SUB-FOLDER]`, e.g. one model of a release that holds several) the
    repository's `blobs/`, which the snapshot's files link to."""
    root = src.resolve()
    roots = [root]
    for folder in [root, *root.parents]:
        if folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir():
            roots.append((folder.parent.parent / "blobs").resolve())
            break
    return roots


class SourceFile:
    """One of SRC's files, opened once and checked as opened (a regular file inside SRC): everything convert reads
    from it goes through this handle, so a name swapped for a link while the conversion runs changes nothing.
    `path` names the opened file itself (Linux: `/proc/self/fd/N`, which safetensors and torch open as they would
    the file; elsewhere the file's resolved path, whose identity is checked again at every `path`); `str()` is the
    name as SRC has it, for messages."""

    def __init__(self, fd: int, shown: str, resolved: Path):
        self.fd, self.shown, self.resolved = fd, shown, resolved
        self.opened = os.fstat(fd)
        self.identity = (self.opened.st_dev, self.opened.st_ino)
        self._close = weakref.finalize(self, os.close, fd)
        self._proc = Path(f"/proc/self/fd/{fd}")

    @property
    def path(self) -> str:
        if self._proc.exists():
            return str(self._proc)
        status = os.stat(self.resolved)
        if (status.st_dev, status.st_ino) != self.identity:
            raise ConversionError(f"SRC's {self.shown} was replaced while the conversion ran; nothing was written.")
        return str(self.resolved)

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read_text(self) -> str:
        return os.pread(self.fd, self.size + 1, 0).decode()

    def close(self) -> None:
        self._close()

    def changed(self) -> str | None:
        """How the file its name in SRC names now differs from the one opened (replaced, gone, grown, truncated or
        written since), or None."""
        try:
            now = os.stat(self.shown)
        except OSError:
            return "is gone"
        if (now.st_dev, now.st_ino) != self.identity:
            return "was replaced"
        if now.st_size != self.opened.st_size:
            return f"is {now.st_size} bytes, not the {self.opened.st_size} read"
        return "was written to" if now.st_mtime_ns != self.opened.st_mtime_ns else None

    def __str__(self) -> str:
        return self.shown

    __fspath__ = path.fget


def source_file(src: Path, name: str, what: str) -> SourceFile:
    """`src / name`, opened, when it is one of SRC's files (a regular file inside SRC, links inside SRC followed);
    otherwise a `ConversionError` that names it (`what`: how the command came to read it) and says why."""
    path = src / name
    resolved = resolved_path(path, f"{what} {name!r}", ConversionError)
    roots = _source_roots(src)

    def outside(where: Path) -> ConversionError:
        links = [str(Path(*Path(name).parts[: i + 1])) for i in range(len(Path(name).parts))
                 if (src / Path(*Path(name).parts[: i + 1])).is_symlink()]
        return ConversionError(
            f"{what} {name!r} is {str(where)!r}, outside SRC" + (f" (through the link {links[0]!r})" if links else "")
            + "; convert reads only files inside SRC. Copy the file into SRC instead of linking to it.")

    if not any(resolved.is_relative_to(root) for root in roots):
        raise outside(resolved)
    if not resolved.exists():
        raise ConversionError(f"{what} {name!r} in SRC does not exist" + (" (a dangling link)" if path.is_symlink()
                                                                          else "") + ".")
    if not resolved.is_file():
        kind = "a folder" if resolved.is_dir() else "not a regular file (a pipe, socket or device)"
        raise ConversionError(f"{what} {name!r} in SRC is {kind}; convert reads and carries only regular files.")
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        raise ConversionError(f"{what} {name!r} in SRC cannot be read ({error.strerror}).") from None
    opened = SourceFile(fd, str(path), resolved)
    proc = Path(f"/proc/self/fd/{fd}")
    where = Path(os.readlink(proc)) if proc.is_symlink() else resolved  # what was opened, whatever its name is now
    regular = stat.S_ISREG(os.fstat(fd).st_mode)
    if regular and any(where.is_relative_to(root) for root in roots):
        return opened
    opened.close()
    if not regular:
        raise ConversionError(f"{what} {name!r} in SRC is not a regular file (a pipe, socket or device); convert "
                              "reads and carries only regular files.")
    raise outside(where)


@dataclass(frozen=True)
class TensorInfo:
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    span: tuple[int, int] | None = None  # its bytes in a safetensors file: (first, end)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: its shape and dtype (known before any data is read) and how to compute it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


class Checkpoint:
    """A model folder: `config` (config.json as a dict), `tensors` (name -> TensorInfo) and `get(name)`. Each of its
    files is opened once, when it is checked (`source_file`), and read through that handle only (`files`: weight file
    name -> `SourceFile`)."""

    def __init__(self, folder: str | os.PathLike, allow_pickle: bool = False):
        self.folder = Path(folder)
        resolved_path(self.folder, f"SRC {str(self.folder)!r}", ConversionError)
        if not self.folder.is_dir():
            raise ConversionError(f"SRC {str(self.folder)!r} is not a folder; give the folder that holds config.json.")
        config_path = self.folder / "config.json"
        if not config_path.exists() and not config_path.is_symlink():
            raise ConversionError(f"SRC {str(self.folder)!r} has no config.json; a model folder needs one.")
        with closing(source_file(self.folder, "config.json", "SRC's")) as config_file:
            self.config: dict = read_json_object(config_file, "SRC's config.json", ConversionError)
        self.read: list[SourceFile] = [config_file]  # every file of SRC read, for `check_unchanged`
        self.files: dict[str, SourceFile] = {}
        self.pickled = False
        self._cached: tuple[str, dict] | None = None  # the last legacy (non-zip) pickle read whole
        files, weight_map = self._weight_files(allow_pickle)
        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            for name, info in self._list(file).items():
                if weight_map is not None and weight_map.get(name) != file:
                    continue  # as Transformers reads a sharded folder: the index says which tensors there are
                if name in self.tensors:
                    raise ConversionError(f"Tensor {name!r} appears in both {self.tensors[name].file} and {file}.")
                self.tensors[name] = info
        absent = sorted(set(weight_map or ()) - set(self.tensors))
        if absent:
            raise ConversionError(f"the index of SRC names tensors that its files do not hold: {absent[:4]} (in "
                                  f"{sorted({weight_map[name] for name in absent})[:2]}).")

    def _weight_files(self, allow_pickle: bool) -> tuple[list[str], dict[str, str] | None]:
        """The weight files and, for a sharded folder, the index's tensor name -> file."""
        folder = self.folder
        for index_name, single_name, pickled in (
            ("model.safetensors.index.json", "model.safetensors", False),
            ("pytorch_model.bin.index.json", "pytorch_model.bin", True),
        ):
            if (folder / index_name).exists() or (folder / index_name).is_symlink():
                with closing(source_file(folder, index_name, "SRC's")) as index:
                    weight_map = _weight_map(index, index_name)
                self.read.append(index)
                files = sorted(set(weight_map.values()))
            elif (folder / single_name).exists() or (folder / single_name).is_symlink():
                files, weight_map = [single_name], None
            else:
                continue
            missing = [f for f in files if not (folder / f).exists() and not (folder / f).is_symlink()]
            if missing:
                raise ConversionError(f"{index_name} in {str(folder)!r} names shard(s) that are missing: {missing}.")
            for file in files:
                self.files[file] = source_file(folder, file, f"the weight file (named by {index_name})" if weight_map
                                               else "SRC's")
            self.read += self.files.values()
            if pickled and not allow_pickle:
                raise ConversionError(
                    f"SRC {str(folder)!r} holds pickled PyTorch weights ({', '.join(files)}); unpickling a file can "
                    "run code from it. Pass --allow-pickle (Python: allow_pickle=True) to read them with "
                    "torch.load(weights_only=True), or give a folder with .safetensors weights."
                )
            self.pickled = pickled
            return files, weight_map
        raise ConversionError(
            f"SRC {str(folder)!r} has no weights: expected model.safetensors, model.safetensors.index.json, "
            "pytorch_model.bin or pytorch_model.bin.index.json."
        )

    def _list(self, file: str) -> dict[str, TensorInfo]:
        if self.pickled:
            state = self._load_pickled(file)
            if not isinstance(state, dict) or not all(
                    isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
                raise ConversionError(f"{file} in SRC does not hold a state dict of named tensors.")
            return {k: TensorInfo(file, tuple(v.shape), v.dtype) for k, v in state.items()}
        out = {}
        try:
            header = safetensors_header(self.files[file].fd, f"{file} in SRC")
        except ValueError as error:
            raise ConversionError(str(error)) from None
        for name, (dtype, shape, span) in header.items():
            if dtype not in SAFETENSORS_DTYPES:
                raise ConversionError(f"Tensor {name!r} in {file} has dtype {dtype}, which is not supported.")
            out[name] = TensorInfo(file, shape, SAFETENSORS_DTYPES[dtype], span)
        return out

    def _load_pickled(self, file: str) -> dict[str, torch.Tensor]:
        """`torch.load(weights_only=True)`: memory-mapped for the zip format of `torch.save`; a legacy (non-zip)
        file cannot be mapped, so it is read whole, and kept until another file is read."""
        if self._cached and self._cached[0] == file:
            return self._cached[1]
        path = self.files[file].path
        legacy = not zipfile.is_zipfile(path)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=not legacy)
        except Exception as error:  # UnpicklingError, EOFError, RuntimeError, KeyError... for a damaged file
            reason = unpickling_reason(error)
            raise ConversionError(
                f"{file} in SRC cannot be read with torch.load(weights_only=True) ({reason}). Only plain tensors are "
                "read from pickled files; save the weights as safetensors instead."
            ) from None
        if legacy:
            self._cached = (file, state)
        return state

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`: its bytes read from the file opened when it was checked (nothing else of the file is
        read or mapped)."""
        info = self.tensors[name]
        if self.pickled:
            return self._load_pickled(info.file)[name]
        first, end = info.span
        data = torch.empty(end - first, dtype=torch.uint8)
        buffer, done = memoryview(data.numpy()), 0
        while done < len(buffer):
            read = os.preadv(self.files[info.file].fd, [buffer[done:]], first + done)
            if read == 0:
                raise ConversionError(f"{info.file} in SRC ended while {name!r} was read; it was truncated while the "
                                      "conversion ran. Nothing was written.")
            done += read
        return data.view(info.dtype).view(info.shape)

    def check_unchanged(self) -> None:
        """Refuses (ConversionError) when a file of SRC that was read is, by its name in SRC, no longer the file that
        was opened (what `--verify` reads again by name)."""
        for source in self.read:
            if how := source.changed():
                raise ConversionError(f"SRC changed while converting: {source} {how}. Nothing was written; convert "
                                      "again once nothing writes to SRC.")

    @property
    def largest_tensor(self) -> tuple[str, TensorInfo]:
        return max(self.tensors.items(), key=lambda item: item[1].nbytes)

    @property
    def largest_file_bytes(self) -> int:
        if not self.tensors:
            raise ConversionError(f"SRC {str(self.folder)!r} holds no tensors.")
        return max(self.files[f].size for f in {t.file for t in self.tensors.values()})

    @property
    def parameter_count(self) -> int:
        total = 0
        for info in self.tensors.values():
            numel = 1
            for size in info.shape:
                numel *= size
            total += numel
        return total


def open_checkpoint(fmt, folder: str | os.PathLike, allow_pickle: bool = False) -> Checkpoint:
    """SRC in format `fmt` (a `format.Format`): a config.json and safetensors folder, or what the format's
    `Reading.open` reads (an engine's distributed checkpoint)."""
    opener = fmt.reading.open if fmt.reading is not None else None
    return opener(Path(folder), allow_pickle) if opener is not None else Checkpoint(folder, allow_pickle=allow_pickle)


def parse_size(size: int | str) -> int:
    """`"2GB"`, `"500MB"`, `"1GiB"` or a number of bytes -> a positive number of bytes."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    text = str(size).strip().upper()
    unit = next((u for u in units if text.endswith(u)), "")
    try:
        value = float(text[: len(text) - len(unit)]) * units.get(unit, 1)
    except ValueError:
        value = math.nan
    if isinstance(size, bool) or not (math.isfinite(value) and value >= 1):
        raise ConversionError(f"--max-shard-size {size!r} is not a size; write e.g. '2GB', '500MB' or a positive "
                              "number of bytes.")
    return int(value)


def write_weights(plan: dict[str, TensorPlan], folder: Path, max_shard_size: int, desc: str = "converting") -> None:
    """Computes and saves every tensor of `plan` into `folder` as `model.safetensors` or as shards of at most
    `max_shard_size` bytes (a single larger tensor gets its own shard) with `model.safetensors.index.json`."""
    split = split_state_dict_into_shards_factory(
        plan, get_storage_size=lambda p: p.nbytes, filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )
    total = sum(p.nbytes for p in plan.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc) as progress:
        for filename, names in split.filename_to_tensors.items():
            _write_shard(folder / filename, {name: plan[name] for name in names}, progress)
            return_freed_memory()
    if split.is_sharded:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        write_json(folder / "model.safetensors.index.json", index)


def _write_shard(path: Path, plan: dict[str, TensorPlan], progress: tqdm) -> None:
    """Writes `plan`'s tensors as the safetensors file `safetensors.torch.save_file` writes (the same bytes: the header
    from the planned shapes and dtypes, the tensors in its order), computing one tensor at a time: `save_file` holds
    a copy of the whole shard. No tensor outlives its write: one read from a memory-mapped file keeps the pages of
    that file it touched resident for as long as it lives."""
    order = sorted(plan, key=lambda name: (_DTYPE_ORDER[plan[name].dtype], name))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in order:
        end = offset + plan[name].nbytes
        header[name] = {"dtype": _DTYPE_NAMES[plan[name].dtype], "shape": list(plan[name].shape),
                        "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for name in order:
            tensor = _compute(name, plan[name])
            out.write(tensor.reshape(-1).view(torch.uint8).numpy())
            del tensor
            progress.update(plan[name].nbytes)


def return_freed_memory() -> None:
    """Asks glibc to hand freed heap memory back to the OS (it keeps freed blocks of a few MB otherwise, so the
    copies made for one shard would stay resident during the next). Best effort: a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _compute(name: str, plan: TensorPlan) -> torch.Tensor:
    tensor = plan.make()
    if tuple(tensor.shape) != plan.shape or tensor.dtype != plan.dtype:
        raise RuntimeError(f"conversion bug: {name} came out as {tuple(tensor.shape)} {tensor.dtype}, planned "
                           f"{plan.shape} {plan.dtype}")
    return tensor.contiguous()


def own_code(src: Path) -> set[str]:
    """The names of SRC's own `*.py` code files: this package's modeling files, which a gated_qwen folder ships, not
    counted."""
    return {path.name for path in src.glob("*.py")} - shipped_code()


def files_to_carry(src: Path, carry_code: bool = False) -> tuple[dict[str, SourceFile], list[str]]:
    """(name -> file) of what `carry_files` copies from SRC: its tokenizer files, generation_config.json and licence
    files and, with `carry_code`, its own `*.py` code; and the names of the code files left behind without it (this
    package's modeling files, which a gated_qwen folder ships, are not counted). Refuses (by name) a match that is not
    one of SRC's files (`source_file`)."""
    names = {path.name for pattern in CARRIED_FILE_PATTERNS for path in src.glob(pattern)}
    code = own_code(src)
    names = (names - {n for n in names if n.endswith(".py")}) | (code if carry_code else set())
    carried = {name: source_file(src, name, "SRC's file to carry") for name in sorted(names)}
    return carried, sorted(code - names)


@functools.cache
def shipped_code() -> frozenset[str]:
    """The code files a saved gated_qwen folder ships, which `save_pretrained` copies from this package (each
    modeling module and the files it imports relatively, all of `model/`): not someone else's code. The package's
    other modules (`model_card.py`, `cli.py`...) are not among them, so SRC's files of those names are SRC's own."""
    return frozenset(Path(file).name for module in (modeling_gated, modeling_gated_moe)
                     for file in [module.__file__, *get_relative_import_files(module.__file__)])


def carry_files(carried: dict[str, SourceFile], folder: Path) -> list[str]:
    """Copies the files of `files_to_carry` into `folder` (each from the file opened when it was checked), except
    those the conversion wrote itself."""
    copied = []
    for name, source in carried.items():
        if not (folder / name).exists():
            shutil.copyfile(source.path, folder / name)
            copied.append(name)
        source.close()
    return copied



def unpickling_reason(error: BaseException) -> str:
    """Why `torch.load(weights_only=True)` refused a file, in a few words, without PyTorch's advice to load it with
    `weights_only=False` (which would run whatever code the file holds)."""
    text = str(error)
    for pattern in (r"WeightsUnpickler error: (.*?)(?: was not an allowed global|$)",
                    r"(Trying to load unsupported GLOBAL \S+)", r"(Unsupported global: GLOBAL \S+)"):
        found = re.search(pattern, text, re.M)
        if found:
            return " ".join(found.group(1).split()).rstrip(".")
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    kept = [s for s in sentences if "weights_only" not in s and "torch.load" not in s and "://" not in s]
    return " ".join(kept).rstrip(".") or type(error).__name__


def _weight_map(index: SourceFile, name: str) -> dict[str, str]:
    """An index's tensor name -> weight file, each file a plain name inside the checkpoint folder."""
    weight_map = read_json_object(index, name, ConversionError).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConversionError(f"{name} in SRC has no `weight_map` object of tensor name -> file name.")
    outside = sorted({f for f in weight_map.values() if Path(f).is_absolute() or ".." in Path(f).parts
                      or not f.strip()})
    if outside:
        raise ConversionError(f"{name} in SRC names weight files outside the folder ({outside[:3]}); "
                              "an index may only name files inside it.")
    return weight_map
