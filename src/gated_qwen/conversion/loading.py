"""The load-time adapter: `from_pretrained` reads a folder of another format (the paper's release, stock Qwen3 /
Qwen3-MoE, Qwen3.5 / Qwen3-Next) directly, through Transformers' load-time weight conversion.

The code a saved folder ships reads gated_qwen folders only; `read_other_formats`, which `gated_qwen.register()`
calls, gives the package's classes (`GatedQwenConfig`, `GatedQwenPreTrainedModel` and their subclasses) a
`get_config_dict` and a `_read_pretrained` (the loading step of the shipped `from_pretrained`) that also read these
formats. For such a folder they translate config.json
(`Reading.config_fields`) and load the tensors with the format's rules turned into `WeightConverter`s.
Transformers looks conversions up by the class of the model it builds, so the folder is loaded through a *reading
class*: a subclass of the requested class, one per (class, format), whose name the format's converters are
registered under; the loaded model is then given back its own class, so it computes, saves (in the gated_qwen
layout) and reports itself as that class. A gated_qwen folder never meets a converter: it loads as Transformers loads
any model (with Qwen3-MoE's expert layout for a mixture of experts, registered in `modeling_gated_moe.py`). Either
way the shipped `from_pretrained` refuses a folder that lacks a gate tensor its config has, or holds one of another
shape, rather than starting that gate at random.

A local folder's tensors are checked against its config.json from the safetensors headers before anything is read
(`Reading.check` and the structural check of `structure.py`), so a mismatch is one error that names the
tensor, not Transformers' conversion report. Quantized loading (`quantization_config`) reads gated_qwen folders
only: Transformers' quantizers take one tensor per conversion, and these conversions make several of one (the gate
rows of a packed q_proj); such a folder is refused, naming `gated-qwen convert`.

Transformers internals this relies on (tests/model/test_transformers_compat.py runs them under every version supported):
conversions are looked up by the model class's name, and `model.__class__` may be reassigned after loading.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys
from pathlib import Path

import torch
from transformers import PreTrainedConfig
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.utils import logging

from ..model.configuration_gated import FIELDS, GATED_MODEL_TYPES, GatedQwenConfig, model_type_error
from .errors import CheckpointFormatError
from .format_types import Context, Format, Shard, TensorRule, layer_of
from .formats import FORMATS, format_of
from .io import Checkpoint
from .plans import gated_config
from .shared import A7_NOTE, source_dtype
from .structure import source_problem

logger = logging.get_logger(__name__)

# `from_pretrained` arguments that say where config.json comes from.
DOWNLOAD_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")


def read_other_formats(config_class: type, model_class: type) -> None:
    """Gives `config_class` (GatedQwenConfig) and `model_class` (GatedQwenPreTrainedModel), and so their subclasses,
    the `get_config_dict` and `_read_pretrained` of this module. Idempotent."""
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """config.json of a GatedQwen folder of this model type, or of a folder in a format the gated_qwen package
        reads (the paper's release, stock Qwen3 / Qwen3-MoE, Qwen3.5 text / Qwen3-Next with every layer full
        attention) turned into GatedQwen's fields (gate fields among `kwargs` then add a gate to a stock Qwen3 /
        Qwen3-MoE model). A folder of the other GatedQwen model type is refused, naming the class that reads it."""
        config_dict, kwargs = super(config_class, cls).get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") not in GATED_MODEL_TYPES:
            config_dict = gated_config_dict(config_dict, kwargs)
        if config_dict["model_type"] != cls.model_type:
            raise ValueError(model_type_error(cls, config_dict, str(pretrained_model_name_or_path)))
        return config_dict, kwargs

    def read_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`(model, loading info)` of Transformers' `from_pretrained`, which also reads the paper's release, stock
        Qwen3 / Qwen3-MoE and Qwen3.5 / Qwen3-Next folders (a mixture of experts only through the GatedQwenMoe*
        classes). The shipped `from_pretrained` that calls this refuses a missing or misshapen gate tensor either
        way. The loaded model saves in the gated_qwen format."""
        return (read_folder(cls, model_class, pretrained_model_name_or_path, *args, **kwargs)
                or super(model_class, cls).from_pretrained(pretrained_model_name_or_path, *args, **kwargs))

    config_class.get_config_dict = classmethod(get_config_dict)
    model_class._read_pretrained = classmethod(read_pretrained)


def gated_config_dict(config_dict: dict, kwargs: dict) -> dict:
    """GatedQwen's config.json of a folder in one of the formats whose config.json is `config_dict`; gate fields
    among `kwargs` (removed from it) add a gate to a stock Qwen3 / Qwen3-MoE model."""
    fmt = format_of(config_dict)
    gate = {field: kwargs.pop(field) for field in FIELDS if field in kwargs}
    if gate and not fmt.reading.takes_gate:
        takers = " or ".join(name for name, f in FORMATS.items() if f.imports and f.reading.takes_gate)
        raise CheckpointFormatError(
            f"gate fields {sorted(gate)} can only be added to a folder in the {takers} format; this folder is in "
            f"the {fmt.name} format ({fmt.summary}), whose gate is given by its checkpoint."
        )
    fields = fmt.reading.config_fields(config_dict, gate or None)
    if gate:
        logger.warning_once(A7_NOTE)
    dtype = source_dtype(config_dict)
    model_type = "gated_qwen_moe" if "num_experts" in fields else "gated_qwen"
    return dict(fields, model_type=model_type, **({"dtype": dtype} if dtype else {}))


def read_folder(model_class: type, base: type, pretrained_model_name_or_path, *args, **kwargs):
    """`model_class.from_pretrained(...)` (with `output_loading_info`: `(model, loading info)`) of a folder in one of
    the formats, through its reading class; None for a gated_qwen folder. `base`: the class whose own
    `from_pretrained` this is (Transformers' runs past it)."""
    config_dict, _ = PreTrainedConfig.get_config_dict(
        pretrained_model_name_or_path, **{k: kwargs[k] for k in DOWNLOAD_KWARGS if k in kwargs})
    fmt = format_of(config_dict)
    if fmt is None:
        return None
    if kwargs.get("quantization_config") is not None:
        raise CheckpointFormatError(
            f"{pretrained_model_name_or_path} is in the {fmt.name} format, read through load-time conversions that "
            "split a tensor into several (the gate rows of q_proj, a new gate), and Transformers' quantizers "
            "take one tensor per conversion. Convert it first (gated-qwen convert SRC DST --from "
            f"{fmt.name}), then load DST with quantization_config."
        )
    folder = Path(pretrained_model_name_or_path, kwargs.get("subfolder") or "")
    if folder.is_dir() and any(folder.glob("*.safetensors*")):
        config = kwargs.get("config")
        if not isinstance(config, GatedQwenConfig):  # the config the model will have (a copy of the kwargs)
            config = gated_config(gated_config_dict(config_dict, dict(kwargs)))
        check_folder(folder, fmt, config)
    model, info = super(base, reading_class(model_class, fmt)).from_pretrained(
        pretrained_model_name_or_path, *args, **kwargs)
    model.__class__ = model_class  # it computes, saves and reports itself as the class asked for
    model._weight_conversions = None  # saved with `model_class`'s own conversions: the gated_qwen layout
    return model, info


def check_folder(folder: Path, fmt: Format, config) -> None:
    """Refuses the tensors of a local folder in format `fmt` (read from the safetensors headers) where they
    disagree with its config.json: the format's own check, then the structural one (every tensor the model its
    config.json describes has, with its shape)."""
    ckpt = Checkpoint(folder)
    shapes = {tensor: info.shape for tensor, info in ckpt.tensors.items()}
    if fmt.reading.check is not None:
        fmt.reading.check(ckpt.config, config, shapes)
    problem = source_problem(fmt, ckpt.config, shapes, config)
    if problem:
        raise CheckpointFormatError(f"the weights in {str(folder)!r} do not match its config.json: {problem}.")


@functools.cache
def reading_class(model_class: type, fmt: Format) -> type:
    """The subclass of `model_class` that loads folders of format `fmt`: the format's rules registered under its
    name as converters, and the format's ignored tensors (a Qwen3.5 folder's multi-token-prediction heads) expected
    and left out."""
    reading = type(f"{model_class.__name__}From{fmt.name.title().replace('_', '')}", (model_class,), {
        "__module__": model_class.__module__,
        "__doc__": f"{model_class.__name__} reading a folder in the {fmt.name} format (gated_qwen.conversion.loading).",
        "_keys_to_ignore_on_load_unexpected": [*(model_class._keys_to_ignore_on_load_unexpected or []),
                                               *(rf"^{prefix}" for prefix in fmt.reading.ignored)],
    })
    register_checkpoint_conversion_mapping(
        reading.__name__, [WeightConverter(rule.source, list(rule.targets), [ApplyRule(rule)]) for rule in fmt.reading.rules],
        overwrite=True)
    return reading


class ApplyRule(ConversionOps):
    """One `TensorRule` as a Transformers conversion op: one source tensor in, its targets out (each as a one-tensor
    list, the form quantizers' ops take). Under tensor parallelism the tensor arrives cut like its first target
    (whole heads: rows of `q_proj`, columns of `o_proj`) and the rule is told which heads it holds."""

    def __init__(self, rule: TensorRule):
        self.rule = rule

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, config=None, full_layer_name=None, model=None,
                **kwargs):
        (value,) = input_dict.values()
        tensor = value[0] if isinstance(value, list) else value
        layer = layer_of(full_layer_name)
        prefix = full_layer_name[: full_layer_name.rindex(self.rule.targets[0])]
        context = Context(config, layer, _shard(model, config, prefix, layer),
                          lambda target: _local_shape(model, prefix + target))
        outputs = self.rule.convert(context, tensor)
        if all(output.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
               for output in outputs.values()):
            release_pages(tensor)  # copied out: its mapped pages are no longer needed
        return {target: [output] for target, output in outputs.items()}


def _local_shape(model, name: str) -> tuple[int, ...]:
    """The shape of parameter `name` on this rank: its local shard under tensor parallelism (a DTensor)."""
    param = model.get_parameter(name)
    return tuple(param.to_local().shape if hasattr(param, "to_local") else param.shape)


def _shard(model, config, prefix: str, layer: int | None) -> Shard:
    """The heads of `layer` on this rank, from its `q_proj` (all of them outside the layers, or without tensor
    parallelism)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if layer is None:
        return Shard(heads, kv_heads)
    layer_prefix = prefix[: prefix.index(f"layers.{layer}.") + len(f"layers.{layer}.")]
    share = _local_shape(model, layer_prefix + "self_attn.q_proj.weight")[0] / (heads * config.head_dim)
    return Shard(round(heads * share), round(kv_heads * share))


MADV_PAGEOUT = 21  # linux/mman.h (Linux 5.4+)


def release_pages(tensor: torch.Tensor) -> None:
    """Ask the kernel to reclaim the memory pages of a tensor that has just been copied out (the packed `q_proj` of a
    release or Qwen3.5 folder, split into two new tensors). Memory-mapped from the checkpoint, its pages would stay
    resident beside the copies for as long as the file stays mapped, which is as long as the model lives (its other
    weights are views of the same mapping). MADV_PAGEOUT keeps the contents (a later read brings the pages back from
    the file, or from swap for anonymous memory), so this is safe for any tensor; elsewhere than on Linux, or on an
    older kernel, it does nothing."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or not sys.platform.startswith("linux"):
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE  # whole pages
    if last > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_PAGEOUT)


@functools.cache
def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc
