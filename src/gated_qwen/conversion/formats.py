"""The checkpoint formats GatedQwen reads and writes besides its own, in one registry.

`FORMATS` says, per format, what the command line needs to know (standard library only: `gated-qwen convert --help`
reads it without the model stack): its summary, the `model_type`s of the config.json it reads, whether it can be
imported (`--from`) and exported (`--to`), and whether an import can add a gate. What the format *is* — its config
translation and its per-tensor rules, as plain functions — is described once, in its own module (`release.py`,
`qwen3.py`, `qwen3_5.py`), and `description(name)` returns it. Two thin adapters read that description:
`loading.py` (`from_pretrained` reads such a folder directly, through Transformers' load-time weight conversion) and
`plans.py` (`gated-qwen convert` streams it into a gated_qwen folder, or a gated_qwen folder into it).

A *model kind* is what a folder holds, for the structural check and `--verify`: a Transformers `model_type` with its
stock class (`model_class`), or `"release"` (the paper's release layout, which no Transformers class reads).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    name: str
    summary: str
    reads: tuple[str, ...]  # the model_types of the config.json an import reads
    imports: bool  # `--from NAME`: this format -> GatedQwen
    exports: bool  # `--to NAME`: GatedQwen -> this format
    writes: str | None = None  # the model kind an export writes
    takes_gate: bool = False  # the import can add a function-preserving gate (`add_gate`)


FORMATS = {f.name: f for f in (
    Format("release", "the paper's released checkpoints (QwQZh/gated_attention); byte-identical round trip",
           ("qwen3",), imports=True, exports=True, writes="release"),
    Format("qwen3", "stock Transformers Qwen3, optionally with a gate added that changes nothing yet",
           ("qwen3",), imports=True, exports=False, takes_gate=True),
    Format("qwen3_5", "Transformers' Qwen3.5 text model (and dense Qwen3-Next), every layer full attention",
           ("qwen3_5_text", "qwen3_next", "qwen3_5"), imports=True, exports=True, writes="qwen3_5_text"),
    Format("qwen3_next", "Qwen3-Next, every layer full attention, dense or mixture-of-experts",
           ("qwen3_next",), imports=True, exports=True, writes="qwen3_next"),
    Format("qwen3_moe", "stock Transformers Qwen3-MoE, optionally with a gate added that changes nothing yet",
           ("qwen3_moe",), imports=True, exports=False, takes_gate=True),
)}
FROM_FORMATS = tuple(name for name, f in FORMATS.items() if f.imports)
TO_FORMATS = tuple(name for name, f in FORMATS.items() if f.exports)


def description(name: str):
    """The `FormatDescription` (`rules.py`) of format `name`: its config translation and per-tensor rules."""
    from . import qwen3, qwen3_5, release

    return {"release": release.RELEASE, "qwen3": qwen3.QWEN3, "qwen3_moe": qwen3.QWEN3_MOE,
            "qwen3_5": qwen3_5.QWEN3_5, "qwen3_next": qwen3_5.QWEN3_NEXT}[name]


def format_of(config: dict) -> str | None:
    """The format `from_pretrained` reads a folder with this config.json in: None for gated_qwen / gated_qwen_moe,
    else one of `FORMATS` (a Qwen3-Next folder is read as "qwen3_next", dense or not). Raises
    `CheckpointFormatError` for a model type no format reads."""
    from ..configuration_gated import GATED_MODEL_TYPES
    from .errors import CheckpointFormatError
    from .qwen3 import RELEASE_KEYS

    model_type = config.get("model_type")
    if model_type in GATED_MODEL_TYPES:
        return None
    if model_type == "qwen3":
        official = any(str(ref).startswith(("configuration_qwen3.", "modeling_qwen3."))
                       for ref in (config.get("auto_map") or {}).values())
        return "release" if official or any(k in config for k in RELEASE_KEYS) else "qwen3"
    for name in ("qwen3_moe", "qwen3_next", "qwen3_5"):
        if model_type in FORMATS[name].reads:
            return name
    raise CheckpointFormatError(
        f"config.json has model_type={model_type!r}; GatedQwen reads gated_qwen folders, gated_qwen_moe ones, the "
        "paper's released checkpoints (model_type 'qwen3' with headwise_attn_output_gate / "
        "elementwise_attn_output_gate / qkv_bias), stock Qwen3 and Qwen3-MoE, and Qwen3.5 text / Qwen3-Next with "
        "every layer full attention. Convert other checkpoints to one of these first."
    )


def model_class(kind: str):
    """The class that reads a folder of model kind `kind` (for the structural check and `--verify`)."""
    import transformers

    from ..modeling_gated import GatedQwenForCausalLM
    from ..modeling_gated_moe import GatedQwenMoeForCausalLM

    return {"gated_qwen": GatedQwenForCausalLM, "gated_qwen_moe": GatedQwenMoeForCausalLM,
            "qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
            "qwen3_5_text": transformers.Qwen3_5ForCausalLM, "qwen3_next": transformers.Qwen3NextForCausalLM}[kind]
