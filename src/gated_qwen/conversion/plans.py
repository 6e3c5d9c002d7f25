"""The streaming adapter of `gated-qwen convert`: a format (`format_types.py`) -> a plan, `{output tensor name:
TensorPlan}` that `io.write_weights` computes shard by shard.

An import plan (`plan_import`) applies the format's tensor rules to the source's tensors: each output's shape and
dtype come from running its rule on a `meta` tensor (no data read), its value from running the same rule on the real
tensor when its shard is written; tensors no rule names pass through. An export is planned by the format itself
(its `FolderWriting.plan`) from the steps of `export_steps.py`, on a `TensorMap` (below) that `copy_rest` completes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..model.configuration_gated import GatedQwenConfig
from ..model.configuration_gated_moe import GatedQwenMoeConfig
from ..model.modeling_gated import GatedQwenForCausalLM
from ..model.modeling_gated_moe import GatedQwenMoeForCausalLM
from .errors import ConversionError
from .format_types import Context, Format, Shard, layer_of, rule_for
from .io import Checkpoint, TensorInfo, TensorPlan


def gated_config(fields: dict):
    """The GatedQwenConfig (or GatedQwenMoeConfig, when `fields` have experts) of an import's config fields."""
    return (GatedQwenMoeConfig if "num_experts" in fields else GatedQwenConfig)(**fields)


def plan_import(fmt: Format, ckpt: Checkpoint, config) -> dict[str, TensorPlan]:
    """The tensors of `ckpt` read as the GatedQwen model `config` through the format's rules: each rule's outputs
    (names, shapes and dtypes from the rule run on a meta tensor), the other tensors unchanged, the `ignored` ones
    and a tied `lm_head.weight` left out."""
    with torch.device("meta"):
        model = (GatedQwenMoeForCausalLM if isinstance(config, GatedQwenMoeConfig) else GatedQwenForCausalLM)(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    shard = Shard(config.num_attention_heads, config.num_key_value_heads)
    tmap = TensorMap(ckpt)
    for name in ckpt.tensors:
        rule = rule_for(fmt.reading.rules, name)
        if name.startswith(fmt.reading.ignored):
            tmap.drop(name)
        elif rule is not None:
            prefix = name.removesuffix(rule.source)
            context = Context(config, layer_of(name), shard, lambda target, prefix=prefix: shapes[prefix + target])
            info = tmap.info(name)
            outputs = rule.convert(context, torch.empty(info.shape, dtype=info.dtype, device="meta"))
            for target, output in outputs.items():
                tmap.put(prefix + target, tmap.take(
                    name, lambda tensor, rule=rule, context=context, target=target: rule.convert(context, tensor)[target],
                    shape=output.shape, dtype=output.dtype))
    copy_rest(tmap, config)
    return tmap.finish()


class TensorMap:
    """An export's plan, built from a source checkpoint by its steps: `take` a source tensor (as it is, or transformed
    when the plan is written), `put` an output, `drop` a source tensor the target does without; `rest` names the
    source tensors nothing has taken yet, and `finish` gives the plan, refusing one that left a source tensor unused.
    Nothing is read until the plan is written."""

    def __init__(self, ckpt: Checkpoint):
        self._ckpt = ckpt
        self._used: set[str] = set()
        self._plan: dict[str, TensorPlan] = {}

    def info(self, name: str) -> TensorInfo:
        """The shape and dtype of the source tensor `name` (nothing taken); refuses a tensor the source lacks."""
        if name not in self._ckpt.tensors:
            raise ConversionError(f"SRC has no tensor {name!r}, which this format needs.")
        return self._ckpt.tensors[name]

    def has(self, name: str) -> bool:
        return name in self._ckpt.tensors

    def take(self, name: str, transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
             shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> TensorPlan:
        """The source tensor `name`, as it is or `transform(tensor)` (of `shape` and `dtype`, the source's where not
        given), computed when the plan is written. A tensor may be taken more than once."""
        info = self.info(name)
        self._used.add(name)
        read = functools.partial(self._ckpt.get, name)
        return TensorPlan(info.shape if shape is None else tuple(shape), info.dtype if dtype is None else dtype,
                          read if transform is None else lambda: transform(read()))

    def drop(self, name: str) -> None:
        self._used.add(name)

    def put(self, name: str, plan: TensorPlan) -> None:
        self._plan[name] = plan

    def planned(self, name: str) -> bool:
        """Whether an output `name` has been put."""
        return name in self._plan

    def rest(self) -> list[str]:
        """The source tensors nothing has taken or dropped yet, in the source's order."""
        return [name for name in self._ckpt.tensors if name not in self._used]

    def finish(self) -> dict[str, TensorPlan]:
        unused = self.rest()
        if unused:
            more = f" and {len(unused) - 8} more" if len(unused) > 8 else ""
            raise ConversionError(f"SRC has tensors this format does not define: {unused[:8]}{more}.")
        return self._plan


def copy_rest(tmap: TensorMap, config, rename=lambda name: name) -> None:
    """Passes every not yet used tensor through (renamed); a tied `lm_head.weight` is dropped (the model ties it)."""
    for name in tmap.rest():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            tmap.drop(name)  # tied models read the embedding matrix, whatever a saved lm_head holds
            continue
        if name.startswith("model.") or name == "lm_head.weight":
            tmap.put(rename(name), tmap.take(name))
    if not config.tie_word_embeddings and not tmap.planned("lm_head.weight"):
        raise ConversionError(
            "SRC has no lm_head.weight and tie_word_embeddings is false: the output layer is missing."
        )
