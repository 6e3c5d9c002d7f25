"""Reading and writing checkpoints one tensor at a time.

`Checkpoint` lists a folder's tensors (names, shapes, dtypes) from the safetensors headers without reading any data,
and `get(name)` reads one tensor with the file opened just for that read (a memory map that is closed again, so the
pages it touched stop counting against this process). `write_weights` computes the output tensors shard by shard
from a plan (`name -> TensorPlan`) and saves each shard with `safetensors.torch.save_file` into a staging folder
(`gated_qwen.outputs`). Peak memory is about one output shard (plus the imports); by default an output shard is at
most half the largest input file. Every way a folder can be unreadable (config.json, the index, a shard, a pickle)
is a `ConversionError` that names the file.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..outputs import read_json_object, write_json
from .errors import ConversionError

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
        self.config: dict = read_json_object(config_path, "SRC's config.json", ConversionError)
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
            if (folder / index_name).is_file():
                weight_map = _weight_map(folder / index_name)
                files = sorted(set(weight_map.values()))
            elif (folder / single_name).is_file():
                files, weight_map = [single_name], None
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
            with safe_open(self.folder / file, framework="pt") as f:
                for name in f.keys():
                    view = f.get_slice(name)
                    dtype = view.get_dtype()
                    if dtype not in SAFETENSORS_DTYPES:
                        raise ConversionError(f"Tensor {name!r} in {file} has dtype {dtype}, which is not supported.")
                    out[name] = TensorInfo(file, tuple(view.get_shape()), SAFETENSORS_DTYPES[dtype])
        except (SafetensorError, OSError) as error:
            raise ConversionError(f"{file} in SRC is not a readable safetensors file ({_one_line(error)}); it may be "
                                  "truncated or corrupt.") from None
        return out

    def _load_pickled(self, file: str) -> dict[str, torch.Tensor]:
        """`torch.load(weights_only=True)`: memory-mapped for the zip format of `torch.save`; a legacy (non-zip)
        file cannot be mapped, so it is read whole, and kept until another file is read."""
        if self._cached and self._cached[0] == file:
            return self._cached[1]
        path = self.folder / file
        legacy = not zipfile.is_zipfile(path)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=not legacy)
        except Exception as error:  # UnpicklingError, EOFError, RuntimeError, KeyError... for a damaged file
            found = re.search(r"WeightsUnpickler error: (.*?)(?: was not an allowed global|$)", str(error), re.M)
            reason = found.group(1) if found else _one_line(error)
            raise ConversionError(
                f"{file} in SRC cannot be read with torch.load(weights_only=True) ({reason}). Only plain tensors are "
                "read from pickled files; save the weights as safetensors instead."
            ) from None
        if legacy:
            self._cached = (file, state)
        return state

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` (memory-mapped until touched)."""
        info = self.tensors[name]
        if self.pickled:
            return self._load_pickled(info.file)[name]
        with safe_open(self.folder / info.file, framework="pt") as f:
            return f.get_tensor(name)

    @property
    def largest_file_bytes(self) -> int:
        if not self.tensors:
            raise ConversionError(f"SRC {str(self.folder)!r} holds no tensors.")
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
            # No reference may outlive its shard: a tensor read from a memory-mapped file keeps the pages of that
            # file that were touched resident for as long as it lives.
            shard = {name: _compute(name, plan[name]) for name in names}
            save_file(shard, folder / filename, metadata={"format": "pt"})
            progress.update(sum(plan[name].nbytes for name in names))
            del shard
            _return_freed_memory()
    if split.is_sharded:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        write_json(folder / "model.safetensors.index.json", index)


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



def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _weight_map(index_path: Path) -> dict[str, str]:
    """An index's tensor name -> weight file, each file a plain name inside the checkpoint folder."""
    weight_map = read_json_object(index_path, index_path.name, ConversionError).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConversionError(f"{index_path.name} in SRC has no `weight_map` object of tensor name -> file name.")
    outside = sorted({f for f in weight_map.values() if Path(f).is_absolute() or ".." in Path(f).parts
                      or not f.strip()})
    if outside:
        raise ConversionError(f"{index_path.name} in SRC names weight files outside the folder ({outside[:3]}); "
                              "an index may only name files inside it.")
    return weight_map
