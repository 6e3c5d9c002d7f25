"""Reading and writing checkpoints one tensor at a time.

`Checkpoint` lists a folder's tensors (names, shapes, dtypes) from the safetensors headers without reading any data,
and `get(name)` reads one tensor with the file opened just for that read (a memory map that is closed again, so the
pages it touched stop counting against this process). `write_checkpoint` computes the output tensors shard by shard
from a plan (`name -> TensorPlan`), saves each shard with `safetensors.torch.save_file`, and builds the folder in a
temporary sibling of the destination that is renamed into place only once everything is written (and verified).
Peak memory is about one output shard (plus the imports); by default an output shard is at most half the largest
input file.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm


class ConversionError(ValueError):
    """A checkpoint, a flag or a destination that cannot be converted as asked; the message says why."""


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

# Files carried over unchanged from the source folder: tokenizer, generation defaults, licence.
CARRIED_FILE_PATTERNS = (
    "tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template*",
    "generation_config.json", "LICENSE*", "NOTICE*",
)


@dataclass(frozen=True)
class TensorInfo:
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype


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
    """A model folder: `config` (config.json as a dict), `tensors` (name -> TensorInfo) and `get(name)`."""

    def __init__(self, folder: str | os.PathLike, allow_pickle: bool = False):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ConversionError(f"SRC {str(self.folder)!r} is not a folder; give the folder that holds config.json.")
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise ConversionError(f"SRC {str(self.folder)!r} has no config.json; a model folder needs one.")
        self.config: dict = json.loads(config_path.read_text())
        self.pickled = False
        files = self._weight_files(allow_pickle)
        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            for name, info in self._list(file).items():
                if name in self.tensors:
                    raise ConversionError(f"Tensor {name!r} appears in both {self.tensors[name].file} and {file}.")
                self.tensors[name] = info

    def _weight_files(self, allow_pickle: bool) -> list[str]:
        folder = self.folder
        for index_name, single_name, pickled in (
            ("model.safetensors.index.json", "model.safetensors", False),
            ("pytorch_model.bin.index.json", "pytorch_model.bin", True),
        ):
            if (folder / index_name).is_file():
                files = sorted(set(json.loads((folder / index_name).read_text())["weight_map"].values()))
            elif (folder / single_name).is_file():
                files = [single_name]
            else:
                continue
            missing = [f for f in files if not (folder / f).is_file()]
            if missing:
                raise ConversionError(f"{index_name} in {str(folder)!r} names shard(s) that are missing: {missing}.")
            if pickled and not allow_pickle:
                raise ConversionError(
                    f"SRC {str(folder)!r} holds pickled PyTorch weights ({', '.join(files)}); unpickling a file can "
                    "run code from it. Pass --allow-pickle (Python: allow_pickle=True) to read them with "
                    "torch.load(weights_only=True), or give a folder with .safetensors weights."
                )
            self.pickled = pickled
            return files
        raise ConversionError(
            f"SRC {str(folder)!r} has no weights: expected model.safetensors, model.safetensors.index.json, "
            "pytorch_model.bin or pytorch_model.bin.index.json."
        )

    def _list(self, file: str) -> dict[str, TensorInfo]:
        if self.pickled:
            state = self._load_pickled(file)
            return {k: TensorInfo(file, tuple(v.shape), v.dtype) for k, v in state.items()}
        out = {}
        with safe_open(self.folder / file, framework="pt") as f:
            for name in f.keys():
                view = f.get_slice(name)
                dtype = view.get_dtype()
                if dtype not in SAFETENSORS_DTYPES:
                    raise ConversionError(f"Tensor {name!r} in {file} has dtype {dtype}, which is not supported.")
                out[name] = TensorInfo(file, tuple(view.get_shape()), SAFETENSORS_DTYPES[dtype])
        return out

    def _load_pickled(self, file: str) -> dict[str, torch.Tensor]:
        return torch.load(self.folder / file, map_location="cpu", weights_only=True, mmap=True)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` (memory-mapped until touched)."""
        info = self.tensors[name]
        if self.pickled:
            return self._load_pickled(info.file)[name]
        with safe_open(self.folder / info.file, framework="pt") as f:
            return f.get_tensor(name)

    @property
    def largest_file_bytes(self) -> int:
        return max(os.path.getsize(self.folder / f) for f in {t.file for t in self.tensors.values()})

    @property
    def parameter_count(self) -> int:
        total = 0
        for info in self.tensors.values():
            numel = 1
            for size in info.shape:
                numel *= size
            total += numel
        return total


def check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuses a destination that exists (unless `overwrite`) or that is the source itself."""
    if dst.resolve() == src.resolve():
        raise ConversionError(f"DST {str(dst)!r} is SRC; write the converted model to another folder.")
    if dst.exists() and not overwrite:
        raise ConversionError(
            f"DST {str(dst)!r} already exists; pass --overwrite (Python: overwrite=True) to replace it, or choose "
            "another folder."
        )
    if dst.exists() and not dst.is_dir():
        raise ConversionError(f"DST {str(dst)!r} exists and is not a folder.")
    if not dst.parent.is_dir():
        raise ConversionError(f"The parent folder of DST, {str(dst.parent)!r}, does not exist.")


@contextmanager
def staging_folder(dst: Path) -> Iterator[Path]:
    """A temporary folder beside `dst`, removed if the block fails; the caller moves it into place with `publish`."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.writing-", dir=dst.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: Path, dst: Path) -> None:
    """Renames the complete folder `tmp` to `dst`; an existing `dst` is moved aside first and removed afterwards.
    The folder, its subfolders and its files get the usual permissions (mkdtemp and safetensors create them
    private)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [tmp, *tmp.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.replaced-", dir=dst.parent))
        os.rename(dst, old / dst.name)
        os.rename(tmp, dst)
        shutil.rmtree(old)
    else:
        os.rename(tmp, dst)


def parse_size(size: int | str) -> int:
    """`"2GB"`, `"500MB"`, `"1GiB"` or a number of bytes -> bytes."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * factor)
            except ValueError:
                break
    if text.isdigit():
        return int(text)
    raise ConversionError(f"max_shard_size {size!r} is not a size; write e.g. '2GB', '500MB' or a number of bytes.")


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
            # No reference may outlive its shard: a tensor read from a memory-mapped file keeps the pages of that
            # file that were touched resident for as long as it lives.
            shard = {name: _compute(name, plan[name]) for name in names}
            save_file(shard, folder / filename, metadata={"format": "pt"})
            progress.update(sum(plan[name].nbytes for name in names))
            del shard
            _return_freed_memory()
    if split.is_sharded:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _return_freed_memory() -> None:
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


def carry_files(src: Path, folder: Path) -> list[str]:
    """Copies tokenizer files, generation_config.json and licence files from `src` to `folder`."""
    copied = []
    for pattern in CARRIED_FILE_PATTERNS:
        for path in sorted(src.glob(pattern)):
            if path.is_file() and not (folder / path.name).exists():
                shutil.copyfile(path, folder / path.name)
                copied.append(path.name)
    return copied


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
