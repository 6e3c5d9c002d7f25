"""The structural check of every conversion, whatever `--verify` says: names and shapes, no data read.

- The source holds every tensor the model its config.json describes has, each with the shape that config implies
  (`check_source`), so that a shape mismatch is refused with the tensor's name before anything is computed.
- The plan writes every parameter the target model has exactly once, with the shape the *written* config.json
  implies, and nothing else (`check_plan`); the model is built on the `meta` device from that config: the class
  that reads the format (GatedQwen or GatedQwen-MoE, or for an export the stock Transformers class), or, for a
  format no class reads, the tensors its `OwnModel.tensor_shapes` lists (the release: Qwen3's layout with the gate
  rows packed into `q_proj`).
- The files written hold exactly the plan (`check_written`: names, shapes and dtypes from the safetensors headers
  and the index).

A model's on-disk names are what `save_pretrained` writes: tied weights left out and Transformers' load-time
conversions reverted (a mixture-of-experts layer is saved one tensor per expert); the stacked in-memory layout that
Transformers also reads is accepted as well, and so are the names a load-time prefix change of the class reads
(Qwen3.5's `model.language_model.*`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import PrefixChange, revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from ..files import config_from_dict
from ..model.gating import gated_layers
from .format_types import Format
from .formats import model_class
from .io import Checkpoint, ConversionError, TensorPlan

Shape = tuple[int, ...]


def _unit(name: str) -> str:
    """The part of the model whose tensors Transformers' load-time conversions may combine: a decoder layer's
    attention, MLP or norm (`model.layers.3.self_attn`), or the tensor itself outside the layers."""
    parts = name.split(".")
    return ".".join(parts[: parts.index("layers") + 3]) if "layers" in parts else name


def model_layout(cls: type, config) -> list[list[dict[str, Shape]]]:
    """Per part of the model of class `cls` built from `config` (on the meta device; parts as `_unit` cuts them): its
    accepted on-disk forms, each `{name: shape}`: what `save_pretrained` writes first, the in-memory names and
    layout second when they differ (Transformers reads both, e.g. one tensor per expert or the stacked experts)."""
    with torch.device("meta"):
        model = cls(config)
    units: dict[str, dict] = {}
    for name, tensor in remove_tied_weights_from_state_dict(model.state_dict(), model).items():
        units.setdefault(_unit(name), {})[name] = tensor
    layout = []
    for tensors in units.values():
        native = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
        saved = {name: tuple(tensor.shape) for name, tensor in revert_weight_conversion(model, tensors).items()}
        forms = [saved, native] if saved != native else [native]
        layout.append(forms + [_prefixed(form, change) for change in _prefix_changes(model) for form in forms[:1]])
    return layout


def _prefix_changes(model) -> list[PrefixChange]:
    """The load-time prefix removals of the model's class (Qwen3.5's text model reads `model.language_model.*`)."""
    return [change for change in get_model_conversion_mapping(model, add_legacy=False)
            if isinstance(change, PrefixChange) and change.prefix_to_remove]


def _prefixed(form: dict[str, Shape], change: PrefixChange) -> dict[str, Shape]:
    """`form` under the names `change` reads: `model.X` as `model.{prefix}.X`."""
    model = f"{change.model_prefix}." if change.model_prefix else ""
    return {(model + f"{change.prefix_to_remove}." + name[len(model):] if name.startswith(model) else name): shape
            for name, shape in form.items()}


def _listing(names: list[str], limit: int = 4) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def compare(found: dict[str, Shape], layout: list[list[dict[str, Shape]]], *, unexpected_ok: bool = False,
            describe=str) -> str:
    """What is wrong with the tensors `found` (`{name: shape}`) against `layout` (`model_layout`; each part must
    be present in one of its forms), as one sentence, or `""` when nothing is; `describe(name)` says a missing
    tensor."""
    missing, mismatched, used = [], [], set()
    for forms in layout:
        present = [form for form in forms if all(name in found for name in form)]
        if not present:
            partial = max(forms, key=lambda form: sum(name in found for name in form))
            missing += [name for name in partial if name not in found]
            used.update(name for name in partial if name in found)
            continue
        used.update(present[0])
        mismatched += [f"{name} is {list(found[name])} where the config implies {list(shape)}"
                       for name, shape in present[0].items() if tuple(found[name]) != shape]
    unexpected = [] if unexpected_ok else sorted(set(found) - used)
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} tensor(s) with the wrong shape ({_listing(mismatched, 2)})")
    if missing:
        problems.append(f"{len(missing)} missing ({_listing([describe(name) for name in missing])})")
    if unexpected:
        problems.append(f"{len(unexpected)} that the model does not have ({_listing(unexpected)})")
    return "; ".join(problems)


def tensor_layout(fmt: Format, config_dict: dict) -> list[list[dict[str, Shape]]]:
    """The layout (`model_layout`) of the model of format `fmt` that `config_dict` (a config.json) describes."""
    if fmt.model is not None:  # a format no Transformers class reads
        return [[{name: shape}] for name, shape in fmt.model.tensor_shapes(config_dict).items()]
    cls = model_class(config_dict.get("model_type"))
    return model_layout(cls, config_from_dict(cls.config_class, config_dict, "SRC's config.json", ConversionError))


def source_problem(fmt: Format, config_dict: dict, found: dict[str, Shape], config=None) -> str:
    """What is wrong with a source's tensors `found` against the model of format `fmt` that its `config_dict`
    describes (`compare`; tensors the model does not use are the planner's to refuse). A missing tensor from which
    the format reads a gate of `config` (GatedQwen's config of the source: the release's and Qwen3.5's q_proj hold a
    layer's gate rows with its queries) is said to hold it, as a missing gate tensor is."""
    layers = set(gated_layers(config)) if config is not None else set()

    def describe(name: str) -> str:
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts[:-1] else None
        holds_gate = any(name.endswith(rule.source) and any(".gate." in target for target in rule.targets)
                         for rule in (fmt.reading.rules if fmt.reading else ()))
        if holds_gate and layer in layers:
            return f"{name} (which holds layer {layer}'s gate as well as its queries: without it the gate cannot be read)"
        return name

    return compare(found, tensor_layout(fmt, config_dict), unexpected_ok=True, describe=describe)


def check_source(ckpt: Checkpoint, fmt: Format, config=None) -> None:
    """Refuses a source whose tensors do not match the model of format `fmt` its config.json describes (missing or
    misshapen, `source_problem`; `config`: GatedQwen's config of the source)."""
    problem = source_problem(fmt, ckpt.config, {name: info.shape for name, info in ckpt.tensors.items()}, config)
    if problem:
        raise ConversionError(f"SRC's weights do not match its config.json: {problem}. Nothing was written.")


def check_plan(plan: dict[str, TensorPlan], fmt: Format, folder: Path) -> None:
    """Refuses a plan that does not write exactly the parameters of the model of format `fmt` that the config.json
    in `folder` (just written there) describes."""
    layout = tensor_layout(fmt, json.loads((folder / "config.json").read_text()))
    problem = compare({name: p.shape for name, p in plan.items()}, layout)
    if problem:
        raise ConversionError(
            f"the converted checkpoint would not match the model its config.json describes: {problem}. This is a "
            "conversion bug or a source this converter does not handle; nothing was written."
        )


def check_written(folder: Path, plan: dict[str, TensorPlan]) -> None:
    """Refuses written weights that differ from the plan (a tensor dropped from a shard or the index, a wrong
    shape or dtype)."""
    written = Checkpoint(folder).tensors
    wrong = sorted(name for name in set(written) | set(plan) if name not in written or name not in plan
                   or (written[name].shape, written[name].dtype) != (plan[name].shape, plan[name].dtype))
    if wrong:
        raise ConversionError(f"the written weights differ from the plan at {_listing(wrong)} (a writer bug); "
                              "nothing was written.")
