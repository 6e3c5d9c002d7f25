"""The streaming adapter of `gated-qwen convert`: a format (`format.py`) -> a plan, `{output tensor name:
TensorPlan}` that `io.write_weights` computes shard by shard.

An import plan (`plan_import`) applies the format's tensor rules to the source's tensors: each output's shape and
dtype come from running its rule on a `meta` tensor (no data read), its value from running the same rule on the real
tensor when its shard is written; tensors no rule names pass through. An export is planned by the format itself
(its `FolderWriting.plan`) from the steps of `export_steps.py`, on a `TensorMap` (below) that `copy_rest` completes.
"""

from __future__ import annotations

import torch

from ..model.configuration_gated import GatedQwenConfig
from ..model.configuration_gated_moe import GatedQwenMoeConfig
from ..model.modeling_gated import GatedQwenForCausalLM
from ..model.modeling_gated_moe import GatedQwenMoeForCausalLM
from .errors import ConversionError
from .format import Context, Format, Shard, layer_of, rule_for
from .io import Checkpoint, TensorPlan


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
            tmap.used.add(name)
            for target, output in outputs.items():
                tmap.put(prefix + target, TensorPlan(
                    tuple(output.shape), output.dtype,
                    lambda name=name, rule=rule, context=context, target=target: rule.convert(
                        context, ckpt.get(name))[target]))
    copy_rest(tmap, config)
    return tmap.finish()


class TensorMap:
    """Builds an output plan from a source checkpoint and checks that every source tensor is used exactly once."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.used: set[str] = set()
        self.plan: dict[str, TensorPlan] = {}

    def info(self, name: str):
        if name not in self.ckpt.tensors:
            raise ConversionError(f"SRC has no tensor {name!r}, which this format needs.")
        return self.ckpt.tensors[name]

    def take(self, name: str) -> TensorPlan:
        """The source tensor `name`, unchanged."""
        info = self.info(name)
        self.used.add(name)
        return TensorPlan(info.shape, info.dtype, lambda: self.ckpt.get(name))

    def has(self, name: str) -> bool:
        return name in self.ckpt.tensors

    def get(self, name: str) -> torch.Tensor:
        self.info(name)
        self.used.add(name)
        return self.ckpt.get(name)

    def drop(self, name: str) -> None:
        self.used.add(name)

    def put(self, name: str, plan: TensorPlan) -> None:
        self.plan[name] = plan

    def finish(self) -> dict[str, TensorPlan]:
        unused = sorted(set(self.ckpt.tensors) - self.used)
        if unused:
            more = f" and {len(unused) - 8} more" if len(unused) > 8 else ""
            raise ConversionError(f"SRC has tensors this format does not define: {unused[:8]}{more}.")
        return self.plan


def copy_rest(tmap: TensorMap, config, rename=lambda name: name) -> None:
    """Passes every not yet used tensor through (renamed); a tied `lm_head.weight` is dropped (the model ties it)."""
    for name in tmap.ckpt.tensors:
        if name in tmap.used:
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            tmap.drop(name)  # tied models read the embedding matrix, whatever a saved lm_head holds
            continue
        if name.startswith("model.") or name == "lm_head.weight":
            tmap.put(rename(name), tmap.take(name))
    if not config.tie_word_embeddings and "lm_head.weight" not in tmap.plan:
        raise ConversionError(
            "SRC has no lm_head.weight and tie_word_embeddings is false: the output layer is missing."
        )
