"""The fused gated-attention kernel in Triton: `softmax(q kᵀ · scale + mask) v ⊙ sigmoid(gate)`, the G1 gate of
Qiu et al. (2025) applied in the kernel's epilogue. It imports nothing of Transformers (nor of the rest of gated_qwen:
relative imports only), so the same files are the Hub kernel that `integrations/kernel_hub.py` builds;
`integrations/gated_triton.py` registers `attention.gated_attention_forward` as `attn_implementation="gated_triton"`.
One file per part, as flash-linear-attention lays out `fla/ops/attn/`:

    parallel.py     training and prefill: forward, division-free backward, the custom op with its autograd, and
                    `gated_attention`, the entry point
    decoding.py     split-KV decode, one query per sequence against a long cache
    naive.py        `naive_gated_attention`, the plain PyTorch reference (the specification), same signature
    tuning.py       the tiles the autotuner may try, per GPU architecture, head dim and Triton version
    inputs.py       what the kernel accepts (shapes, dtypes, devices), checked without Triton
    launch.py       the optional Triton import, the interpreter switch, launch arguments the kernels share
    jit_helpers.py  the `@triton.jit` helpers the kernels share (program coordinates, addressing, sigmoid)
    selfcheck.py    the first-use check of one combination against the reference
    choice.py       on a CUDA GPU, the kernel or SDPA + gate, whichever was measured faster per combination and
                    length; the cache file that keeps those choices across runs
    attention.py    `gated_attention_forward`, the kernel with Transformers' attention-function signature (inputs in
                    the kernel's layouts, SDPA + gate where the kernel cannot or may not run, the self-check
                    verdicts), and `runs_by_default(config)`, whether it is a model's default attention

Triton is optional (`pip install "gated-qwen[triton]"`): without it this package imports, `triton_available()` is
False and `gated_attention` raises a RuntimeError that says so; the kernel modules are not imported.
"""

from .attention import gated_attention, gated_attention_forward, runs_by_default
from .inputs import MAX_HEAD_DIM, SUPPORTED_DTYPES, gated_attention_supported, gated_attention_unsupported_reason
from .launch import triton_available
from .naive import naive_gated_attention

__all__ = [
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
    "gated_attention",
    "gated_attention_forward",
    "gated_attention_supported",
    "gated_attention_unsupported_reason",
    "naive_gated_attention",
    "runs_by_default",
    "triton_available",
]
