"""What a format description is: its config translation and its per-tensor rules, as plain functions.

A format module (`release.py`, `qwen3.py`, `qwen3_5.py`) describes each of its formats once as a `FormatDescription`;
`loading.py` turns its tensor rules into Transformers `WeightConverter`s for `from_pretrained`, `plans.py` into the
streaming plans of `gated-qwen convert`. A `TensorRule` reads one source tensor (a name suffix such as
`self_attn.q_proj.weight`, matched wherever it ends a name) and gives the GatedQwen tensors it becomes, named by the
same prefix: `convert(context, tensor) -> {target: tensor}`, some of `targets` (which lists every name it may give,
its own first) or, where the config needs no change, `{source: tensor}` itself. Tensors no rule reads pass through
unchanged, so a format that only translates config fields has no rule at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
class FormatDescription:
    """One format. For an import (`--from`, `from_pretrained`): `config_fields(config.json, gate) -> GatedQwen
    fields` (gate: gate fields to add, only where the format `takes_gate`; refusals raise `CheckpointFormatError`),
    `check(config.json, config, shapes)` (refusals from the tensor shapes alone, before any tensor is read), the
    tensor `rules`, and `ignored` source name prefixes that are not part of the model. For an export (`--to`):
    `export(checkpoint) -> (config to write, {name: TensorPlan})`."""

    name: str
    config_fields: Callable[[dict, dict | None], dict] | None = None
    check: Callable[[dict, Any, dict[str, tuple[int, ...]]], None] | None = None
    rules: tuple[TensorRule, ...] = ()
    ignored: tuple[str, ...] = ()
    export: Callable[[Checkpoint], tuple[Any, dict[str, TensorPlan]]] | None = None


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor name lies in (`model.layers.3.self_attn...` -> 3), or None."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


def rule_for(rules: Iterable[TensorRule], name: str) -> TensorRule | None:
    """The rule that reads the source tensor `name`, or None (it passes through)."""
    return next((rule for rule in rules if name.endswith(rule.source)), None)
