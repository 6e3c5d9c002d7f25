"""PEFT's default targets for `model_type="gated_qwen"`, so that `LoraConfig(task_type="CAUSAL_LM")` works without
`target_modules`.

PEFT picks the modules an adapter wraps from dicts keyed by `model_type` (`peft.utils.constants`,
`TRANSFORMERS_MODELS_TO_<METHOD>_TARGET_MODULES_MAPPING`); a type missing there raises "Please specify
`target_modules`". GatedQwen takes Qwen3's entry of every such dict, adding the gate projection `g_proj` wherever
Qwen3's adapts the attention projections (LoRA: `q_proj`, `v_proj`, `g_proj`). Called when `gated_qwen` is imported;
does nothing without PEFT. A folder loaded with `trust_remote_code=True` without this package installed gets no
defaults: pass `target_modules=["q_proj", "v_proj", "g_proj"]` there.
"""

from __future__ import annotations

GATE_TARGET = "g_proj"


def register_peft_defaults() -> bool:
    """Adds `"gated_qwen"` to PEFT's default-target dicts (in place, keeping an entry already there).

    Returns False when PEFT is not installed.
    """
    try:
        from peft.utils import constants
    except ImportError:
        return False
    for name, mapping in vars(constants).items():
        if not (name.startswith("TRANSFORMERS_MODELS_TO_") and name.endswith("_MODULES_MAPPING")):
            continue
        if isinstance(mapping, dict) and "qwen3" in mapping:
            targets = list(mapping["qwen3"])
            if "q_proj" in targets:
                targets.append(GATE_TARGET)
            mapping.setdefault("gated_qwen", targets)
    return True
