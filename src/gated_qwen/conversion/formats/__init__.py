"""The checkpoint formats GatedQwen reads and writes besides its own, in one registry: one entry per format.

Each format is one `Format` object (`format_types.py`), defined in the module of its family here (`release.py`,
`qwen3.py` with Qwen3-MoE, `qwen3_5.py` with Qwen3-Next, `gguf.py`, `mlx.py`, `onnx.py`, `megatron.py`,
`olmo_core.py`), which is all there is to know about it: its reading (detection, config translation, tensor
rules), its writing (an export made of the steps of `export_steps.py`, and its options), and the models that read
and check it. Every list of formats or options in a message or help text is made from this
registry. `GATED` is this package's own format, the other end of every conversion."""

from __future__ import annotations

from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..errors import CheckpointFormatError
from ..format_types import ExportOption, Format
from . import gguf, megatron, mlx, olmo_core, onnx, qwen3, qwen3_5, release

# The order in which `format_of` asks the formats (the release before stock Qwen3: both are model_type qwen3).
FORMATS: dict[str, Format] = {fmt.name: fmt for fmt in (
    release.RELEASE,
    qwen3.QWEN3,
    qwen3_5.QWEN3_5,
    qwen3_5.QWEN3_NEXT,
    qwen3.QWEN3_MOE,
    gguf.GGUF,
    mlx.MLX,
    onnx.ONNX,
    megatron.MEGATRON,
    olmo_core.OLMO_CORE,
)}
FROM_FORMATS = tuple(name for name, fmt in FORMATS.items() if fmt.imports)
TO_FORMATS = tuple(name for name, fmt in FORMATS.items() if fmt.exports)

GATED = Format("gated_qwen", "this package's own folders, dense or mixture-of-experts")
GATED_TYPES = ("gated_qwen", "gated_qwen_moe")  # the model_types of GATED's folders


def described(names) -> str:
    """The formats `names` with what each is, for a message or help text: "release (the paper's ...); qwen3 (...)"."""
    return "; ".join(f"{name} ({FORMATS[name].summary})" for name in names)


def export_options() -> dict[str, ExportOption]:
    """Every export option of every format, by name (formats that share one share the object)."""
    return {option.name: option for fmt in FORMATS.values() for option in fmt.export_options}


def taking(option: str) -> tuple[str, ...]:
    """The export formats that take the export option named `option`."""
    return tuple(name for name in TO_FORMATS if any(o.name == option for o in FORMATS[name].export_options))


def format_of(config: dict) -> Format | None:
    """The format `from_pretrained` reads a folder with this config.json in: None for a gated_qwen or
    gated_qwen_moe folder, else the first of `FORMATS` that detects it. Raises `CheckpointFormatError` for a model
    type no format reads."""
    if config.get("model_type") in GATED_TYPES:
        return None
    found = next((fmt for fmt in FORMATS.values() if fmt.reading and fmt.reading.reads_folder(config)), None)
    if found is None:
        raise CheckpointFormatError(
            f"config.json has model_type={config.get('model_type')!r}; GatedQwen reads gated_qwen and "
            f"gated_qwen_moe folders and these formats: {described(FROM_FORMATS)}. Convert other checkpoints to one "
            "of these first."
        )
    return found


def model_class(model_type: str) -> type:
    """The causal LM class that reads a folder of `model_type`: Transformers' (`AutoModelForCausalLM`'s mapping),
    in which the gated_qwen package has registered its own (`gated_qwen.register`, which runs as soon as
    Transformers is imported beside the package)."""
    return MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]
