"""The Transformers APIs that the model files use and that moved between the versions they run on: 5.17 and later
(5.19 is what vLLM 0.32 pins, under which its Transformers backend runs a saved folder's code). The model files import
these names from here and nowhere else; each is chosen once, at import, by what the installed Transformers has (not by
its version number, which says nothing about the releases in between).

| name                          | 5.25                                              | 5.17 - 5.19                                    |
|-------------------------------|---------------------------------------------------|------------------------------------------------|
| `ALL_PARALLEL_STYLES`         | `transformers.distributed.parallel_utils`         | `transformers.distributed.tensor_parallel`     |
| `slice_logits_to_keep`        | `transformers.modeling_utils`                     | absent: Qwen3's own slice, defined here        |
| the cache argument of masks   | `create_causal_mask(cache=...)`                   | `create_causal_mask(past_key_values=...)`      |
| the cache field of outputs    | `BaseModelOutputWithPast.cache`                   | `BaseModelOutputWithPast.past_key_values`      |
| `hub_attention_kernel_loader` | 5.25 with kernels 0.19: Transformers' own loader  | None: the model files load it with `kernels`   |
| `derived_plan`                | the config's plan as derived                      | keeps the tied-embedding rule they assign      |

Forwards take the cache as `cache` in every version: `@deprecate_kwarg("past_key_values", ..., new_name="cache")`
renames what older `generate` passes.

This file is copied to the Hugging Face Hub beside `modeling_gated.py`: relative imports only.
"""

import inspect
from importlib.util import find_spec

import torch
from transformers import masking_utils, modeling_utils
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils import is_torch_distributed_available

# The name under which model outputs hold the cache ("cache", or "past_key_values" before 5.2x).
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
# The name of the cache argument of `create_causal_mask` and `create_sliding_window_causal_mask`.
MASK_CACHE_ARGUMENT = (
    "cache" if "cache" in inspect.signature(masking_utils.create_causal_mask).parameters else "past_key_values"
)


def _qwen3_slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """`hidden_states: [B, S, hidden]` -> the last `logits_to_keep` positions (an int, 0 keeps all), or the positions
    a 1-D index tensor names: what Qwen3's causal LM slices before `lm_head` in the releases without the helper."""
    positions = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden_states[:, positions, :]


slice_logits_to_keep = getattr(modeling_utils, "slice_logits_to_keep", _qwen3_slice_logits_to_keep)


def create_causal_mask(*, cache, **kwargs):
    """`masking_utils.create_causal_mask` with the cache passed under the name the installed version takes."""
    return masking_utils.create_causal_mask(**{MASK_CACHE_ARGUMENT: cache}, **kwargs)


def create_sliding_window_causal_mask(*, cache, **kwargs):
    """`masking_utils.create_sliding_window_causal_mask`, the cache passed as in `create_causal_mask`."""
    return masking_utils.create_sliding_window_causal_mask(**{MASK_CACHE_ARGUMENT: cache}, **kwargs)


def derived_plan(derive):
    """A config's `base_model_tp_plan` as a property computed from its fields by `derive(config)`. 5.17 - 5.19 assign
    their rule for tied input embeddings ("embed_tokens": "embedding_rowwise") to the config's plan (later releases add
    it to the model's): what an assignment holds beyond the derived rules is kept in the instance dict under the
    property's name, which Transformers leaves out of config.json, and added to what the property gives."""
    name = derive.__name__

    def get(config) -> dict[str, str]:
        return derive(config) | config.__dict__.get(name, {})

    def assign(config, plan: dict[str, str]) -> None:
        config.__dict__[name] = {}
        derived = get(config)
        config.__dict__[name] = {rule: style for rule, style in plan.items() if derived.get(rule) != style}

    return property(get, assign, doc=derive.__doc__)


def hub_attention_kernel_loader():
    """Transformers' own route for a Hub attention kernel, `load_and_register_attn_kernel("repo@revision:function",
    allow_all_kernels=...)`, where the installed Transformers has it and accepts the installed `kernels` (5.25 with
    kernels 0.19); else None. Asked at each use: whether `kernels` fits is Transformers' own (cached) answer."""
    try:  # 5.25 and later
        from transformers.integrations.hub_kernels import load_and_register_attn_kernel
        from transformers.utils.import_utils import is_kernels_available
    except ImportError:
        return None
    takes_trust = "allow_all_kernels" in inspect.signature(load_and_register_attn_kernel).parameters
    return load_and_register_attn_kernel if takes_trust and is_kernels_available() else None


__all__ = ["CACHE_FIELD", "MASK_CACHE_ARGUMENT", "create_causal_mask", "create_sliding_window_causal_mask",
           "derived_plan", "hub_attention_kernel_loader", "slice_logits_to_keep"]

if is_torch_distributed_available():
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    if find_spec("transformers.distributed.parallel_utils") is not None:
        from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    else:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    __all__ += ["ALL_PARALLEL_STYLES", "TensorParallelLayer"]
