"""What a checkpoint format is: one `Format` object, in the format's own module under `formats/` (`release.py`,
`qwen3.py`, `qwen3_5.py`, `gguf.py`, `mlx.py`, `onnx.py`), made of what the format does: its `Reading` (detection,
config translation, tensor rules), its writing (`FolderWriting`: a safetensors folder from a plan; `FileWriting`: its
own files) and, where no Transformers class reads it, its `OwnModel`. `formats.FORMATS` registers it with one line.

`loading.py` turns a format's tensor rules into Transformers `WeightConverter`s for
`from_pretrained`, `plans.py` into the streaming plans of `gated-qwen convert`; `structure.py` and `verify.py` read
its models. A `TensorRule` reads one source tensor (a name suffix such as `self_attn.q_proj.weight`, matched wherever
it ends a name) and gives the GatedQwen tensors it becomes, named by the same prefix: `convert(context, tensor) ->
{target: tensor}`, some of `targets` (which lists every name it may give, its own first) or, where the config needs
no change, `{source: tensor}` itself. Tensors no rule reads pass through unchanged, so a format that only translates
config fields has no rule at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .io import Checkpoint, TensorPlan


@dataclass(frozen=True)
class Shard:
    """The heads a tensor covers: all of them, or under tensor parallelism at load time this rank's share."""

    heads: int
    kv_heads: int


@dataclass(frozen=True)
class Context:
    """What a rule knows besides its tensor: the GatedQwen `config` it reads into, the decoder `layer` (None
    outside the layers), the `shard` of heads the tensor covers, and `shape(target)`, the shape of a target tensor
    (on this rank under tensor parallelism)."""

    config: Any
    layer: int | None
    shard: Shard
    shape: Callable[[str], tuple[int, ...]]


@dataclass(frozen=True)
class TensorRule:
    source: str
    targets: tuple[str, ...]
    convert: Callable[[Context, torch.Tensor], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class ExportOption:
    """An option of a format's export: `gated-qwen convert --to FORMAT` offers it as `flag` (the name with dashes)
    and `convert(src, dst, to_format=FORMAT, NAME=value)` takes it; either way it reaches the format's writing (its
    `plan` or `write`) as the keyword argument `name`. `metavar` None: a flag (True when given); else a value, read from
    the command line with `type`. Declared once, in the format's module: the command line, its help and `convert`
    read it from the registry."""

    name: str
    help: str
    metavar: str | None = None
    type: Callable[[str], Any] = str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class Reading:
    """How a folder in the format is read into GatedQwen (`--from NAME`, and `from_pretrained` of the folder).

    - Detection: `reads`, the `model_type`s of a config.json in this format (what `--from NAME` accepts), and
      `detect(config.json) -> bool`, which narrows them for `from_pretrained` (whether a folder of one of those
      model types is in this format; default: yes). `formats.format_of` asks the formats in registry order.
    - `config_fields(config.json, gate) -> GatedQwen's fields` (gate: fields to add, only where the format
      `takes_gate`; refusals raise `CheckpointFormatError`), `check(config.json, config, shapes)` (refusals from the
      tensor shapes alone, before a tensor is read), the tensor `rules`, and `ignored` source name prefixes that are
      not part of the model.
    - A format whose folders are not config.json and safetensors (an engine's torch distributed checkpoint, which
      `from_pretrained` does not read: `detect` says no): `open(folder, allow_pickle) -> Checkpoint` reads SRC (its `config`, the
      dict `config_fields` and `check` take, made of what the checkpoint says of itself), and `plan(checkpoint,
      config) -> {name: TensorPlan}` is the import, where its names are not GatedQwen's.
    """

    reads: tuple[str, ...]
    config_fields: Callable[[dict, dict | None], dict]
    detect: Callable[[dict], bool] | None = None
    check: Callable[[dict, Any, dict[str, tuple[int, ...]]], None] | None = None
    rules: tuple[TensorRule, ...] = ()
    ignored: tuple[str, ...] = ()
    takes_gate: bool = False
    open: Callable[[Path, bool], Checkpoint] | None = None
    plan: Callable[[Checkpoint, Any], dict[str, TensorPlan]] | None = None

    def reads_folder(self, config: dict) -> bool:
        """Whether `from_pretrained` reads a folder with this config.json in this format."""
        return config.get("model_type") in self.reads and (self.detect is None or self.detect(config))


@dataclass(frozen=True)
class FolderWriting:
    """How a GatedQwen checkpoint is written as a folder of config.json and safetensors in the format (`--to
    NAME`), which `gated-qwen convert` streams shard by shard: `plan(checkpoint, **options) -> (config to write,
    {name: TensorPlan})`, the config a config object or, for a format no Transformers class reads, a dict (the
    plan composes the steps of `export_steps.py`); `options`: the `ExportOption`s it takes (given ones only reach
    it as keyword arguments); `files(config) -> {name: text}`, other files it writes beside config.json (the model
    file mlx-lm runs)."""

    plan: Callable[..., tuple[Any, dict[str, TensorPlan]]]
    options: tuple[ExportOption, ...] = ()
    files: Callable[[Any], dict[str, str]] | None = None


@dataclass(frozen=True)
class FileWriting:
    """How a GatedQwen checkpoint is written in a format of its own files, not safetensors (`--to NAME`): one file
    (GGUF), or with `folder` a new folder of them (ONNX; SRC's tokenizer and generation files are carried beside
    them). `write(checkpoint, path, **options) -> (vocab size, a line for the report)` writes them from the
    gated_qwen checkpoint (and checks them), `logits(path, input_ids [B, S]) -> [B, S, vocab]` is the format's
    reference for `--verify`; `options` as `FolderWriting`'s."""

    write: Callable[..., tuple[int, str]]
    logits: Callable[[Path, torch.Tensor], torch.Tensor]
    folder: bool = False
    options: tuple[ExportOption, ...] = ()


@dataclass(frozen=True)
class OwnModel:
    """The model of a format that no Transformers class reads (a folder of a format that one reads is read by
    Transformers' causal LM of its `model_type`: the structural check builds it, `--verify` runs it as the
    reference): `tensor_shapes(config.json) -> {name: shape}` and `logits(checkpoint, input_ids [B, S]) -> [B, S,
    vocab]`."""

    tensor_shapes: Callable[[dict], dict[str, tuple[int, ...]]]
    logits: Callable[[Checkpoint, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Format:
    """One checkpoint format: `name` (the value of `--from` / `--to`), its one-line `summary`, and what it does:
    `reading` where it is read (`--from`, `from_pretrained`), `writing` where it is written (`--to`: a
    `FolderWriting` or a `FileWriting`), `model` where no Transformers class reads its folders."""

    name: str
    summary: str
    reading: Reading | None = None
    writing: FolderWriting | FileWriting | None = None
    model: OwnModel | None = None

    @property
    def imports(self) -> bool:
        """`--from NAME`: this format -> GatedQwen (and `from_pretrained` reads it)."""
        return self.reading is not None

    @property
    def exports(self) -> bool:
        """`--to NAME`: GatedQwen -> this format."""
        return self.writing is not None

    @property
    def export_options(self) -> tuple[ExportOption, ...]:
        return self.writing.options if self.writing is not None else ()


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor name lies in (`model.layers.3.self_attn...` -> 3), or None."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


def rule_for(rules: Iterable[TensorRule], name: str) -> TensorRule | None:
    """The rule that reads the source tensor `name`, or None (it passes through)."""
    return next((rule for rule in rules if name.endswith(rule.source)), None)
