"""The attention backend `attn_implementation="gated_triton"`: the fused Triton kernel registered with Transformers.

The attention function is the kernel's own, `kernel/attention.py`'s `gated_attention_forward` (Transformers' inputs
in the kernel's layouts, SDPA + a separate gate where the kernel cannot or may not run, the first-use self-check and
its switch `GATED_QWEN_KERNEL`), with `runs_by_default(config)`, the one decision whether it is the default
attention. They live in the kernel so that the Hub kernel built from it (`kernel_hub.py`) carries them to a saved
folder's own code where the package is not installed; what is left here is the package's part: `register()`.

It belongs to the gated_qwen package, not to a saved folder: the folder's `modeling_gated.py` finds the function in
Transformers' attention registry, through two attributes of the function registered: `applies_output_gate` (the
module hands it `output_gate`, the G1 logits) and `runs_by_default(config)`.
"""

from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.modeling_utils import AttentionInterface

from ..kernel.attention import gated_attention_forward, runs_by_default
from ..model.gating import FUSED_ATTENTION

# The function registered as "gated_triton" (the name Transformers' docs would give it).
gated_triton_attention_forward = gated_attention_forward

__all__ = ["gated_triton_attention_forward", "register", "runs_by_default"]


def register() -> None:
    """Registers `attn_implementation="gated_triton"` with Transformers, with the mask it takes (without one,
    padding would be ignored)."""
    AttentionInterface.register(FUSED_ATTENTION, gated_triton_attention_forward)
    AttentionMaskInterface.register(FUSED_ATTENTION, flash_attention_mask)
