"""PEFT's default targets for `model_type="gated_qwen"` and `"gated_qwen_moe"`, so that
`LoraConfig(task_type="CAUSAL_LM")` works without `target_modules`.

PEFT picks the modules an adapter wraps from dicts keyed by `model_type` (`peft.utils.constants`,
`TRANSFORMERS_MODELS_TO_<METHOD>_TARGET_MODULES_MAPPING`); a type missing there raises "Please specify
`target_modules`". GatedQwen takes Qwen3's entry of every such dict, and GatedQwen-MoE Qwen3-MoE's, adding the gate
projection `g_proj` wherever that entry adapts the attention projections (LoRA: `q_proj`, `v_proj`, `g_proj`). PEFT
(0.21) has no Qwen3-MoE entries; until it has, GatedQwen-MoE takes Qwen3's entries that name no MLP projection (the
experts of a sparse layer are parameters, not modules an adapter can wrap). Called when `gated_qwen` is imported;
does nothing without PEFT. A folder loaded with `trust_remote_code=True` without this package installed gets no
defaults: pass `target_modules=["q_proj", "v_proj", "g_proj"]` there.
"""

from __future__ import annotations

from transformers import Qwen3Config, Qwen3MoeConfig

GATE_TARGET = "g_proj"
MLP_PROJECTIONS = {"gate_proj", "up_proj", "down_proj"}  # a dense MLP's modules; a sparse layer has none of them


def with_gate(targets: list[str]) -> list[str]:
    """`targets` plus the gate projection when they adapt the attention projections."""
    return [*targets, GATE_TARGET] if "q_proj" in targets else list(targets)


def register_peft_defaults() -> bool:
    """Adds `"gated_qwen"` and `"gated_qwen_moe"` to PEFT's default-target dicts (in place, keeping an entry already
    there).

    Returns False when PEFT is not installed.
    """
    try:
        from peft.utils import constants
    except ImportError:
        return False

    qwen3, qwen3_moe = Qwen3Config.model_type, Qwen3MoeConfig.model_type  # the keys of PEFT's dicts
    for name, mapping in vars(constants).items():
        if not (name.startswith("TRANSFORMERS_MODELS_TO_") and name.endswith("_MODULES_MAPPING")):
            continue
        if isinstance(mapping, dict) and qwen3 in mapping:
            mapping.setdefault("gated_qwen", with_gate(mapping[qwen3]))
            if qwen3_moe in mapping:
                mapping.setdefault("gated_qwen_moe", with_gate(mapping[qwen3_moe]))
            elif not MLP_PROJECTIONS & set(mapping[qwen3]):
                mapping.setdefault("gated_qwen_moe", with_gate(mapping[qwen3]))
    return True
