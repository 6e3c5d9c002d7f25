"""The checkpoint formats `convert` knows, in one registry: `FROM_FORMATS`, `TO_FORMATS` and the command line's
choices are derived from it. Standard library only (the command-line parser reads it without the model stack).

A format names the function that plans its import into GatedQwen and/or its export from GatedQwen (`module:function`
in `gated_qwen.conversion`, imported when used). Every planner takes a `Checkpoint` (and, where `takes_gate`, the
`add_gate` variant) and returns `(config to write, {name: TensorPlan})`. A *model kind* is what a folder holds,
for the structural check and `--verify`: a Transformers `model_type` with its stock class, or `"release"` (the
paper's release layout, which no Transformers class reads).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    name: str
    summary: str
    import_planner: str | None = None  # SRC in this format -> GatedQwen
    export_planner: str | None = None  # GatedQwen SRC -> this format
    writes: str | None = None  # the model kind an export writes
    takes_gate: bool = False  # the import can add a function-preserving gate (`add_gate`)

    def planner(self, export: bool) -> Callable:
        module, function = (self.export_planner if export else self.import_planner).split(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), function)


FORMATS = {f.name: f for f in (
    Format("release", "the paper's released checkpoints (QwQZh/gated_attention); byte-identical round trip",
           "release:plan_release_to_gated", "release:plan_gated_to_release", writes="release"),
    Format("qwen3", "stock Transformers Qwen3, optionally with a gate added that changes nothing yet",
           "qwen3:plan_qwen3_to_gated", takes_gate=True),
    Format("qwen3_5", "Transformers' Qwen3.5 text model (and dense Qwen3-Next), every layer full attention",
           "qwen3_5:plan_qwen3_5_to_gated", "qwen3_5:plan_gated_to_qwen3_5", writes="qwen3_5_text"),
    Format("qwen3_next", "Qwen3-Next, every layer full attention, dense or mixture-of-experts",
           "qwen3_next:plan_qwen3_next_to_gated", "qwen3_next:plan_gated_to_qwen3_next", writes="qwen3_next"),
    Format("qwen3_moe", "stock Transformers Qwen3-MoE, optionally with a gate added that changes nothing yet",
           "qwen3_moe:plan_qwen3_moe_to_gated", takes_gate=True),
)}
FROM_FORMATS = tuple(name for name, f in FORMATS.items() if f.import_planner)
TO_FORMATS = tuple(name for name, f in FORMATS.items() if f.export_planner)

# Model kind -> the class that reads it (`module:class`), for the structural check and `--verify`.
MODEL_CLASSES = {
    "gated_qwen": "gated_qwen:GatedQwenForCausalLM",
    "qwen3": "transformers:Qwen3ForCausalLM",
    "qwen3_moe": "transformers:Qwen3MoeForCausalLM",
    "qwen3_5_text": "transformers:Qwen3_5ForCausalLM",
    "qwen3_next": "transformers:Qwen3NextForCausalLM",
}


def model_class(kind: str):
    module, name = MODEL_CLASSES[kind].split(":")
    return getattr(importlib.import_module(module), name)
