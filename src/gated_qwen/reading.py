"""What the package reads from files a user gives (`convert`, `analyze`, `eval-ppl`, `card`, `from_pretrained` of
another format): a JSON object, and a config.json's values, each refused with one line that names the file, the
field and what would be right, never a traceback from deep inside Transformers. `outputs.py` is its counterpart
for what the package writes.

Standard library only at import (Transformers only when a config.json is read): the command-line parser imports
this module without the model stack.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path


def read_json_object(path: Path, what: str, error: type[Exception] = ValueError) -> dict:
    """The JSON object in `path`, or `error` saying in one line what is wrong with it (`what` names the file)."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as problem:
        raise error(f"{what} ({path}) is not valid JSON ({' '.join(str(problem).split())}).") from None
    if not isinstance(data, dict):
        raise error(f"{what} ({path}) must hold a JSON object, not a {type(data).__name__}.")
    return data


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
    import dataclasses
    import typing

    import torch
    from transformers import PreTrainedConfig, configuration_utils

    namespace = {**vars(configuration_utils), "torch": torch}
    hints = typing.get_type_hints(PreTrainedConfig, globalns=namespace)
    fields = {field.name: (hints[field.name], str(field.type)) for field in dataclasses.fields(PreTrainedConfig)}
    return fields | UNDECLARED_CONFIG_FIELDS


def config_from_dict(config_class, config_dict: dict, what: str, error: type[Exception] = ValueError):
    """`config_class.from_dict(config_dict)` for a config.json a user gave; a value of the wrong type, for the fields
    every config has (by their annotations, with huggingface_hub's validator) or as the config class finds it,
    becomes `error`, one line naming `what` (e.g. "SRC's config.json")."""
    from huggingface_hub.dataclasses import type_validator

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
