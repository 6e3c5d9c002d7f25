"""What a checkpoint format is: one `Format` object carries everything about it, in the format's own module under
`formats/` (`release.py`, `qwen3.py`, `qwen3_5.py`, `gguf.py`, `mlx.py`, `onnx.py`), and `formats.FORMATS`
registers it with one line.

Standard library only, like the format modules' top level, so that `gated-qwen convert --help` lists the formats
without the model stack. `loading.py` turns a format's tensor rules into Transformers `WeightConverter`s for
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

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
    and `convert(src, dst, to_format=FORMAT, NAME=value)` takes it; either way it reaches the format's `export` (or
    `write_file`) as the keyword argument `name`. `metavar` None: a flag (True when given); else a value, read from
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
class Format:
    """One checkpoint format, everything about it.

    - `name`, `summary`: the value of `--from` / `--to` and its one-line description.
    - Detection: `reads`, the `model_type`s of a config.json in this format (what `--from NAME` accepts), and
      `detect(config.json) -> bool`, which narrows them for `from_pretrained` (whether a folder of one of those
      model types is in this format; default: yes). `formats.format_of` asks the formats in registry order.
    - Import (`--from`, `from_pretrained`), where `config_fields` is given: `config_fields(config.json, gate) ->
      GatedQwen's fields` (gate: fields to add, only where the format `takes_gate`; refusals raise
      `CheckpointFormatError`), `check(config.json, config, shapes)` (refusals from the tensor shapes alone, before a
      tensor is read), the tensor `rules`, and `ignored` source name prefixes that are not part of the model.
    - Export (`--to`), where `export` is given: `export(checkpoint, **options) -> (config to write, {name:
      TensorPlan})`, the config a config object or, for a format no Transformers class reads, a dict;
      `export_options`: the `ExportOption`s it takes (given ones only reach it as keyword arguments); `files(config)
      -> {name: text}`, other files it writes beside config.json (the model file mlx-lm runs).
    - Export to one file, not a folder (GGUF), where `write_file` is given: `write_file(checkpoint, path, **options)
      -> (vocab size, a line for the report)` writes the file from the gated_qwen checkpoint (and checks it), and
      `file_logits(path, input_ids [B, S]) -> [B, S, vocab]` is the format's reference for `--verify`.
    - Export to a folder of the format's own files, not safetensors (ONNX), where `write_folder` is given:
      `write_folder(checkpoint, folder, **options) -> (vocab size, a line for the report)` writes them into the new
      folder (SRC's tokenizer and generation files are carried beside them), and `file_logits(folder, input_ids)` is
      the reference for `--verify`.
    - The models: a folder of the format is read by Transformers' causal LM of its `model_type` (the structural
      check builds it, `--verify` runs it as the reference). A format that no Transformers class reads gives instead
      `tensor_shapes(config.json) -> {name: shape}` and `logits(checkpoint, input_ids [B, S]) -> [B, S, vocab]`.
    """

    name: str
    summary: str
    reads: tuple[str, ...]
    detect: Callable[[dict], bool] | None = None
    config_fields: Callable[[dict, dict | None], dict] | None = None
    check: Callable[[dict, Any, dict[str, tuple[int, ...]]], None] | None = None
    rules: tuple[TensorRule, ...] = ()
    ignored: tuple[str, ...] = ()
    takes_gate: bool = False
    export: Callable[..., tuple[Any, dict[str, TensorPlan]]] | None = None
    export_options: tuple[ExportOption, ...] = ()
    files: Callable[[Any], dict[str, str]] | None = None
    tensor_shapes: Callable[[dict], dict[str, tuple[int, ...]]] | None = None
    logits: Callable[[Checkpoint, torch.Tensor], torch.Tensor] | None = None
    write_file: Callable[[Checkpoint, Path], tuple[int, str]] | None = None
    file_logits: Callable[[Path, torch.Tensor], torch.Tensor] | None = None
    write_folder: Callable[[Checkpoint, Path], tuple[int, str]] | None = None

    @property
    def imports(self) -> bool:
        """`--from NAME`: this format -> GatedQwen (and `from_pretrained` reads it)."""
        return self.config_fields is not None

    @property
    def exports(self) -> bool:
        """`--to NAME`: GatedQwen -> this format."""
        return self.export is not None or self.write_file is not None or self.write_folder is not None

    def reads_folder(self, config: dict) -> bool:
        """Whether `from_pretrained` reads a folder with this config.json in this format."""
        return config.get("model_type") in self.reads and (self.detect is None or self.detect(config))


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor name lies in (`model.layers.3.self_attn...` -> 3), or None."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


def rule_for(rules: Iterable[TensorRule], name: str) -> TensorRule | None:
    """The rule that reads the source tensor `name`, or None (it passes through)."""
    return next((rule for rule in rules if name.endswith(rule.source)), None)
