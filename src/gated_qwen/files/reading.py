"""What the package reads from files a user gives (`convert`, `analyze`, `eval-ppl`, `card`, `from_pretrained` of
another format): a JSON value or object (nested at most `MAX_JSON_DEPTH` deep), a config.json's values, and the
headers of a folder's safetensors files, each refused with one line that names the file, the field and what would
be right, never a traceback from deep inside Transformers or safetensors. The rest of `files/` is its counterpart
for what the package writes.

"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import struct
import typing
from collections.abc import Iterator
from pathlib import Path

import torch
from huggingface_hub.dataclasses import type_validator
from transformers import PreTrainedConfig, configuration_utils

from .identity import resolved

MAX_JSON_DEPTH = 64  # arrays and objects nested deeper than this are refused: no config or results file comes close


def parse_json(text: str, what: str, error: type[Exception] = ValueError):
    """The JSON value `text` holds, or `error` saying in one line what is wrong with it (`what` names where the text
    comes from): not JSON, or nested deeper than `MAX_JSON_DEPTH` (which Python's parser, and the libraries a value
    then reaches, would meet as a RecursionError)."""
    try:
        data = json.loads(text)
        too_deep = _depth(data) > MAX_JSON_DEPTH
    except json.JSONDecodeError as problem:
        raise error(f"{what} is not valid JSON ({' '.join(str(problem).split())}).") from None
    except RecursionError:
        too_deep = True
    if too_deep:
        raise error(f"{what} is not valid JSON (nested too deeply: arrays and objects more than {MAX_JSON_DEPTH} "
                    "levels deep).") from None
    return data


def _depth(value) -> int:
    """How deeply `value`'s arrays and objects nest (counted without recursion; stops once past the limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_JSON_DEPTH:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def read_json_object(path: Path, what: str, error: type[Exception] = ValueError) -> dict:
    """The JSON object in `path`, or `error` saying in one line what is wrong with it (`what` names the file)."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as problem:
        raise error(f"{what} ({path}) is not valid JSON ({' '.join(str(problem).split())}).") from None
    data = parse_json(text, f"{what} ({path})", error)
    if not isinstance(data, dict):
        raise error(f"{what} ({path}) must hold a JSON object, not a {type(data).__name__}.")
    return data


# Bytes per element of each safetensors dtype (the sub-byte float formats are not read by this package).
SAFETENSORS_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                          "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
MAX_SAFETENSORS_HEADER = 100 * 2**20  # what the safetensors library itself accepts


def safetensors_header(fd: int, what: str) -> dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]:
    """name -> (dtype, shape, (first byte, end byte) in the file) of the safetensors file open as `fd`, read with
    plain reads (nothing is mapped, so a file larger than the memory or the address space this process may use is
    listed like any other) and checked as the safetensors library checks it: a JSON object after its 8-byte length,
    its `__metadata__` a map of strings, each tensor's bytes as many as its dtype and shape need, the tensors tiling
    the rest of the file exactly.
    Raises `ValueError`, one line naming what is wrong (`what` names the file)."""
    size = os.fstat(fd).st_size

    def refuse(reason: str):
        return ValueError(f"{what} is not a readable safetensors file ({reason}); it may be truncated or corrupt.")

    if size < 8:
        raise refuse(f"{size} bytes, fewer than the 8 of its header's length")
    length = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
    if length > min(MAX_SAFETENSORS_HEADER, size - 8):
        raise refuse(f"a header of {length} bytes in a file of {size}")
    try:
        header = parse_json(os.pread(fd, length, 8).decode(), "its header")
    except (UnicodeDecodeError, ValueError) as problem:
        raise refuse(" ".join(str(problem).split())) from None
    if not isinstance(header, dict):
        raise refuse("its header is not a JSON object")
    tensors, data = {}, 8 + length
    for name, entry in header.items():
        if name == "__metadata__":  # the library reads it as null or a map of strings, and refuses anything else
            if entry is not None and not (isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())):
                raise refuse(f"its __metadata__ is {json.dumps(entry)[:60]}, not a map of strings")
            continue
        fields = entry if isinstance(entry, dict) else {}
        dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
        good_shape = isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
        good_offsets = (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
                        and 0 <= offsets[0] <= offsets[1])
        if dtype not in SAFETENSORS_ITEM_BYTES or not good_shape or not good_offsets:
            raise refuse(f"tensor {name!r} has dtype {dtype!r}, shape {shape!r} and offsets {offsets!r}")
        count = 1
        for n in shape:
            count *= n
        if offsets[1] - offsets[0] != count * SAFETENSORS_ITEM_BYTES[dtype]:
            raise refuse(f"tensor {name!r} of {dtype} {shape} spans {offsets[1] - offsets[0]} bytes, not "
                         f"{count * SAFETENSORS_ITEM_BYTES[dtype]}")
        tensors[name] = (dtype, tuple(shape), (data + offsets[0], data + offsets[1]))
    end = data
    for name, (_, _, (first, last)) in sorted(tensors.items(), key=lambda item: item[1][2]):
        if first != end:
            raise refuse(f"tensor {name!r} starts at byte {first - data} of the data, not {end - data}")
        end = last
    if end != size:
        raise refuse(f"its tensors end at byte {end} of a file of {size} bytes")
    return tensors


def check_safetensors_files(folder: Path, what: str, error: type[Exception] = ValueError) -> None:
    """Refuses (`error`, one line naming the file) a weight file of the model folder `folder` whose safetensors
    header cannot be read or lies about the data: truncated, a dtype or offsets that do not match the bytes. The files
    are those its index names (`model.safetensors.index.json`), or `model.safetensors`; `what` names the folder. The
    headers are read, not mapped (`safetensors_header`)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, f"{what}'s model.safetensors.index.json", error).get("weight_map")
        names = sorted({v for v in weight_map.values() if isinstance(v, str)}) if isinstance(weight_map, dict) else []
    else:
        single = folder / "model.safetensors"
        names = ["model.safetensors"] if single.exists() or single.is_symlink() else []
    for name in names:
        resolved(folder / name, f"{what}: {name}", error)
        if not (folder / name).is_file():
            continue  # Transformers names what is missing
        try:
            fd = os.open(folder / name, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as problem:
            raise error(f"{what}: {name} cannot be read ({problem.strerror}).") from None
        try:
            safetensors_header(fd, f"{what}: {name}")
        except ValueError as problem:
            raise error(str(problem)) from None
        finally:
            os.close(fd)


@contextlib.contextmanager
def utf8_named(path: str | os.PathLike) -> Iterator[str | os.PathLike]:
    """`path`, or, where its name is not valid UTF-8 (a name the safetensors library cannot open: it takes Rust
    strings), another name of the same folder or file that is: `/proc/self/fd/N` of it, opened for as long as the
    block runs. Elsewhere than on Linux such a name is refused (`ValueError`, one line)."""
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        pass
    else:
        yield path
        return
    if not Path("/proc/self/fd").is_dir():
        raise ValueError(f"{str(path)!r} is not a valid UTF-8 name, which the safetensors library cannot open; "
                         "rename it.")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


# What Transformers' config classes raise on a config.json value of the wrong type (besides their own ValueErrors):
# e.g. `id2label` a list (AttributeError), `dtype` a list (IndexError).
CONFIG_VALUE_ERRORS = (ValueError, TypeError, AttributeError, IndexError, KeyError)
# Fields that Transformers reads from every config.json but declares on no config class: (type, as written).
UNDECLARED_CONFIG_FIELDS = {"torch_dtype": (str | None, "str | None"), "auto_map": (dict, "dict")}


@functools.cache
def _base_config_fields() -> dict[str, tuple[object, str]]:
    """(type, its annotation as written) of every field that `PreTrainedConfig` itself declares: the strict dataclass
    checks the fields of its subclasses (Qwen3Config's sizes, use_cache, ...) but not these, which a model then reads
    as they come (`output_hidden_states: [null]` fails deep in a forward)."""
    namespace = {**vars(configuration_utils), "torch": torch}
    hints = typing.get_type_hints(PreTrainedConfig, globalns=namespace)
    fields = {field.name: (hints[field.name], str(field.type)) for field in dataclasses.fields(PreTrainedConfig)}
    return fields | UNDECLARED_CONFIG_FIELDS


def config_from_dict(config_class, config_dict: dict, what: str, error: type[Exception] = ValueError):
    """`config_class.from_dict(config_dict)` for a config.json a user gave; a value of the wrong type, for the fields
    every config has (by their annotations, with huggingface_hub's validator) or as the config class finds it,
    becomes `error`, one line naming `what` (e.g. "SRC's config.json")."""
    for name, (expected, written) in _base_config_fields().items():
        if name in config_dict:
            try:
                type_validator(name, config_dict[name], expected)
            except TypeError:
                raise error(f"{what}: `{name}` must be {written}, not {json.dumps(config_dict[name])[:40]}.") from None
    try:
        return config_class.from_dict(config_dict)
    except CONFIG_VALUE_ERRORS as problem:
        reason = " ".join(str(problem).split()) or type(problem).__name__
        raise error(f"{what} is not a valid {config_class.__name__} ({reason}).") from None
