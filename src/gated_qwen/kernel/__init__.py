"""The fused gated-attention kernel in Triton: `softmax(q kᵀ · scale + mask) v ⊙ sigmoid(gate)`, the G1 gate of
Qiu et al. (2025) applied in the kernel's epilogue. It knows nothing about Transformers; `integrations/gated_triton.py`
plugs it in as `attn_implementation="gated_triton"`. One file per part, as flash-linear-attention lays out
`fla/ops/attn/`:

    parallel.py     training and prefill: forward, division-free backward, the custom op with its autograd, and
                    `gated_attention`, the entry point
    decoding.py     split-KV decode, one query per sequence against a long cache
    naive.py        `naive_gated_attention`, the plain PyTorch reference (the specification), same signature
    tuning.py       the tiles the autotuner may try, per GPU architecture, head dim and Triton version
    inputs.py       what the kernel accepts (shapes, dtypes, devices), checked without Triton
    launch.py       the optional Triton import, the interpreter switch, launch arguments the kernels share
    jit_helpers.py  the `@triton.jit` helpers the kernels share (program coordinates, addressing, sigmoid)
    selfcheck.py    the first-use check of one combination against the reference

Triton is optional (`pip install "gated-qwen[triton]"`): without it this package imports, `triton_available()` is
False and `gated_attention` raises a RuntimeError that says so; the kernel modules are not imported.
"""

from .inputs import MAX_HEAD_DIM, SUPPORTED_DTYPES, gated_attention_supported, gated_attention_unsupported_reason
from .launch import TRITON_IMPORT_ERROR, triton, triton_available
from .naive import naive_gated_attention

if triton is not None:  # the kernel modules define their @triton.jit functions at import
    from .parallel import gated_attention
else:

    def gated_attention(q, k, v, gate=None, **kwargs):
        """Stands in for `parallel.gated_attention` where Triton is not installed: raises a RuntimeError."""
        raise RuntimeError(f"Triton is not installed ({TRITON_IMPORT_ERROR}): pip install 'gated-qwen[triton]', or "
                           "use naive_gated_attention")


__all__ = [
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
    "gated_attention",
    "gated_attention_supported",
    "gated_attention_unsupported_reason",
    "naive_gated_attention",
    "triton_available",
]
