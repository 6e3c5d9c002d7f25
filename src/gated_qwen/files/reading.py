"""What the package reads from files a user gives (`convert`, `analyze`, `eval-ppl`, `card`, `from_pretrained` of
another format): a JSON value or object (nested at most `MAX_JSON_DEPTH` deep), a config.json's values, and the
headers of a folder's safetensors files, each refused with one line that names the file, the field and what would
be right, never a traceback from deep inside Transformers or safetensors. The rest of `files/` is its counterpart
for what the package writes.

Standard library only at import (Transformers only when a config.json is read): the command-line parser imports
this module without the model stack.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from pathlib import Path

import torch
from huggingface_hub.dataclasses import type_validator
from safetensors import SafetensorError, safe_open
from transformers import PreTrainedConfig, configuration_utils

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


def check_safetensors_files(folder: Path, what: str, error: type[Exception] = ValueError) -> None:
    """Refuses (`error`, one line naming the file) a weight file of the model folder `folder` whose safetensors
    header cannot be read or lies about the data: truncated, a dtype or offsets that do not match the bytes. The files
    are those its index names (`model.safetensors.index.json`), or `model.safetensors`; `what` names the folder."""

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, f"{what}'s model.safetensors.index.json", error).get("weight_map")
        names = sorted({v for v in weight_map.values() if isinstance(v, str)}) if isinstance(weight_map, dict) else []
    else:
        names = ["model.safetensors"] if (folder / "model.safetensors").exists() else []
    for name in names:
        if not (folder / name).is_file():
            continue  # Transformers names what is missing
        try:
            with safe_open(folder / name, framework="pt") as weights:
                weights.keys()
        except (SafetensorError, OSError) as problem:
            raise error(f"{what}: {name} is not a readable safetensors file ({' '.join(str(problem).split())}); it "
                        "may be truncated or corrupt.") from None


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
