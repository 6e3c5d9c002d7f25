"""The checkpoint formats GatedQwen reads and writes besides its own, in one registry: one line per format.

Each format is one `Format` object (`format.py`), defined in its own module (`release.py`, `qwen3.py`,
`qwen3_5.py`), which is all there is to know about it: its detection, config translation and tensor rules, export,
and the models that read and check it. Standard library only: `gated-qwen convert --help` reads the registry
without the model stack. `GATED` is this package's own format, the other end of every conversion.
"""

from __future__ import annotations

from . import gguf_format, mlx_format, onnx_format, qwen3, qwen3_5, release
from .errors import CheckpointFormatError
from .format import Format

# The order in which `format_of` asks the formats (the release before stock Qwen3: both are model_type qwen3).
FORMATS: dict[str, Format] = {fmt.name: fmt for fmt in (
    release.RELEASE,
    qwen3.QWEN3,
    qwen3_5.QWEN3_5,
    qwen3_5.QWEN3_NEXT,
    qwen3.QWEN3_MOE,
    gguf_format.GGUF,
    mlx_format.MLX,
    onnx_format.ONNX,
)}
FROM_FORMATS = tuple(name for name, fmt in FORMATS.items() if fmt.imports)
TO_FORMATS = tuple(name for name, fmt in FORMATS.items() if fmt.exports)

GATED = Format("gated_qwen", "this package's own folders, dense or mixture-of-experts",
               reads=("gated_qwen", "gated_qwen_moe"))


def format_of(config: dict) -> Format | None:
    """The format `from_pretrained` reads a folder with this config.json in: None for a gated_qwen or
    gated_qwen_moe folder, else the first of `FORMATS` that detects it. Raises `CheckpointFormatError` for a model
    type no format reads."""
    if GATED.reads_folder(config):
        return None
    found = next((fmt for fmt in FORMATS.values() if fmt.reads_folder(config)), None)
    if found is None:
        raise CheckpointFormatError(
            f"config.json has model_type={config.get('model_type')!r}; GatedQwen reads gated_qwen folders, "
            "gated_qwen_moe ones, the paper's released checkpoints (model_type 'qwen3' with "
            "headwise_attn_output_gate / elementwise_attn_output_gate / qkv_bias), stock Qwen3 and Qwen3-MoE, and "
            "Qwen3.5 text / Qwen3-Next with every layer full attention. Convert other checkpoints to one of these "
            "first."
        )
    return found


def model_class(model_type: str) -> type:
    """The causal LM class that reads a folder of `model_type`: Transformers' (`AutoModelForCausalLM`'s mapping),
    in which the gated_qwen package has registered its own (`gated_qwen.register`, which runs as soon as
    Transformers is imported beside the package)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]
