"""Torch's distributed checkpoint format (DCP: `.metadata` and `*.distcp` files), which the pretraining engines save
(Megatron-core's `torch_dist`, OLMo-core's trainer), read and written with `torch.distributed.checkpoint` alone.

Reading (`DcpCheckpoint`): the tensors are listed from `.metadata`, which torch writes as a pickle; it is unpickled
with only the classes of torch's checkpoint metadata allowed (`METADATA_CLASSES`), so a `.metadata` naming anything
else is refused and reading it runs no code of the file's. A tensor, or one index along its first dimension (a layer
of Megatron's stacked tensors), is read at a time by torch's own `FileSystemReader` (payloads through
`torch.load(weights_only=True)`), through the files opened when they were checked (`io.source_file`). A data file
that `.metadata` names and SRC lacks, or a tensor whose saved chunks do not cover it, is refused by name.

Writing (`write_dcp`): `{name: TensorPlan | [TensorPlan per index of the first dimension] | bytes}` saved with
`torch.distributed.checkpoint.save` and no process group; each tensor (each layer of a stacked one, as its own chunk)
is computed when it is written, so memory holds about one of them.
"""

from __future__ import annotations

import io
import math
import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import LoadPlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..files.identity import resolved as resolved_path
from .errors import ConversionError
from .io import Checkpoint, SourceFile, TensorInfo, TensorPlan, source_file

METADATA = ".metadata"
# What torch's `.metadata` pickle holds: its dataclasses and enums, torch.Size, dtypes (checked in find_class), paths.
METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # the checkpoint_id torch records
}


# Engines' own copies of torch's classes, read as torch's (OLMo-core's writer records its own storage info).
SAME_AS_TORCH = {("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"):
                 ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` with only `METADATA_CLASSES` and torch's dtypes allowed."""

    def find_class(self, module: str, name: str):
        module, name = SAME_AS_TORCH.get((module, name), (module, name))
        if name in METADATA_CLASSES.get(module, ()) or module == "torch" and isinstance(getattr(torch, name, None),
                                                                                         torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a torch distributed checkpoint's metadata")


class _CheckedFiles(FileSystem):
    """torch's file system for `FileSystemReader`, opening only the files checked when SRC was opened (by name)."""

    def __init__(self, files: dict[str, SourceFile]):
        self.files = files

    @contextmanager
    def create_stream(self, path, mode):
        name = Path(path).name
        if mode != "rb" or name not in self.files:
            raise ConversionError(f"the checkpoint asks for {name!r}, which is not one of SRC's checked files.")
        with open(self.files[name].path, "rb") as stream:
            yield stream


class _Into:
    """The part of torch's `LoadPlanner` that `FileSystemReader.read_data` calls: copies each read into `out`."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def resolve_tensor(self, item):
        view = self.out
        for dim, (offset, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, item, tensor) -> None:
        pass

    def load_bytes(self, item, stream) -> None:
        raise ConversionError(f"{item.dest_index.fqn!r} is not a tensor")


def dcp_files(folder: Path) -> bool:
    """Whether `folder` holds a torch distributed checkpoint (its `.metadata`)."""
    return (folder / METADATA).is_file()


class DcpCheckpoint(Checkpoint):
    """A torch distributed checkpoint as a `Checkpoint`: `tensors` (every tensor of `.metadata`, by its key),
    `objects` (the keys of saved bytes, not read), `get(name)`, `layer(name, index)` (`tensor[index]`), and
    `config`, the dict its format made of the checkpoint's own description (`common.pt`, a config.json)."""

    def __init__(self, folder: str | Path, config: dict):
        self.folder, self.config, self.pickled, self._cached = Path(folder), config, False, None
        resolved_path(self.folder, f"SRC {str(self.folder)!r}", ConversionError)
        if not dcp_files(self.folder):
            raise ConversionError(f"SRC {str(self.folder)!r} has no {METADATA}: it is not a torch distributed "
                                  "checkpoint (a folder of .metadata and *.distcp files).")
        meta = source_file(self.folder, METADATA, "SRC's")
        try:
            with open(meta.path, "rb") as stream:
                self.metadata = MetadataUnpickler(stream).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:
            raise ConversionError(f"SRC's {METADATA} is not a torch distributed checkpoint's metadata ({error}); "
                                  "nothing was read from it.") from None
        stored = {info.relative_path for info in self.metadata.storage_data.values()}
        missing = sorted(name for name in stored if not (self.folder / name).exists())
        if missing:
            raise ConversionError(f"SRC's {METADATA} names data files that SRC lacks: {missing[:4]} (a shard of the "
                                  "save is missing; copy the whole checkpoint folder). Nothing was written.")
        self.files = {METADATA: meta, **{name: source_file(self.folder, name, f"the data file (named by {METADATA})")
                                         for name in sorted(stored)}}
        self.read = list(self.files.values())  # what `check_unchanged` holds SRC to
        self.tensors, self.objects = {}, []
        for name, entry in self.metadata.state_dict_metadata.items():
            if isinstance(entry, BytesStorageMetadata):
                self.objects.append(name)
                continue
            covered = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
            if covered != math.prod(entry.size):
                raise ConversionError(f"SRC's tensor {name!r} {list(entry.size)} is saved in chunks that cover "
                                      f"{covered} of its {math.prod(entry.size)} elements (a shard of the save is "
                                      "missing). Nothing was written.")
            self.tensors[name] = TensorInfo(self._file_of(name), tuple(entry.size), entry.properties.dtype)
        self._reader = dcp.FileSystemReader(self.folder)
        self._reader.fs = _CheckedFiles(self.files)
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)

    def _file_of(self, name: str) -> str:
        return next((info.relative_path for index, info in self.metadata.storage_data.items()
                     if index.fqn == name), METADATA)

    def get(self, name: str) -> torch.Tensor:
        return self._read(name, None)

    def layer(self, name: str, index: int) -> torch.Tensor:
        """`tensor[index]` of the tensor `name` (only that part is read)."""
        return self._read(name, index)[0]

    def _read(self, name: str, index: int | None) -> torch.Tensor:
        info, entry = self.tensors[name], self.metadata.state_dict_metadata[name]
        offsets, sizes = [0] * len(info.shape), list(info.shape)
        if index is not None:
            offsets[0], sizes[0] = index, 1
        out = torch.empty(sizes, dtype=info.dtype)
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        plan = LoadPlan(create_read_items_for_chunk_list(name, entry, [chunk]))
        self._reader.read_data(plan, _Into(out)).wait()
        return out

    @property
    def largest_file_bytes(self) -> int:
        return max(file.size for name, file in self.files.items() if name != METADATA)


# ------------------------------------------------------------------------------------------------------ writing
class _Lazy:
    """A tensor to write: its parts (TensorPlans), one chunk each, stacked along a new first dimension (`stacked`) or
    the one part as the whole tensor. DCP's planner asks it for its write items and for each chunk's data."""

    def __init__(self, parts: list[TensorPlan], stacked: bool):
        self.parts, self.stacked = parts, stacked
        first = parts[0]
        self.size = torch.Size((len(parts), *first.shape) if stacked else first.shape)
        self.properties = TensorProperties(dtype=first.dtype)

    def items(self, fqn: str) -> list[WriteItem]:
        out = []
        for i, part in enumerate(self.parts):
            offsets = torch.Size((i, *[0] * len(part.shape)) if self.stacked else [0] * len(part.shape))
            sizes = torch.Size((1, *part.shape) if self.stacked else part.shape)
            kind = WriteItemType.SHARD if self.stacked else WriteItemType.TENSOR  # several chunks of one tensor: shards
            out.append(WriteItem(index=MetadataIndex(fqn, offsets), type=kind, tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets, sizes), properties=self.properties, size=self.size)))
        return out

    def data(self, offset: torch.Size) -> torch.Tensor:
        index = offset[0] if self.stacked else 0
        part = self.parts[index]
        tensor = part.make().contiguous()
        if tuple(tensor.shape) != tuple(part.shape) or tensor.dtype != part.dtype:
            raise RuntimeError(f"conversion bug: a part came out as {tuple(tensor.shape)} {tensor.dtype}, planned "
                               f"{part.shape} {part.dtype}")
        return tensor.unsqueeze(0) if self.stacked else tensor


class _Planner(dcp.DefaultSavePlanner):
    """torch's save planner over `_Lazy` tensors and raw bytes (written as they are)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=False)

    def create_local_plan(self):
        items = [item for fqn, obj in self.state_dict.items() for item in (
            obj.items(fqn) if isinstance(obj, _Lazy) else [WriteItem(index=MetadataIndex(fqn),
                                                                     type=WriteItemType.BYTE_IO)])]
        self.plan = dcp.SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.data(index.offset) if isinstance(obj, _Lazy) else io.BytesIO(obj)

    def transform_object(self, write_item, obj):
        return obj


def write_dcp(folder: Path, entries: dict[str, TensorPlan | list[TensorPlan] | bytes]) -> None:
    """Saves `entries` as a torch distributed checkpoint in `folder`: a TensorPlan as one tensor, a list of them
    stacked along a new first dimension (one chunk each), bytes as a saved object."""
    state = {name: entry if isinstance(entry, bytes) else _Lazy(entry if isinstance(entry, list) else [entry],
                                                                isinstance(entry, list))
             for name, entry in entries.items()}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, sync_files=False), planner=_Planner(),
                 no_dist=True)
