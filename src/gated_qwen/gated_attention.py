"""Fused gated attention in Triton: `softmax(q kᵀ · scale + mask) v ⊙ sigmoid(gate)`, forward and backward, as a
`torch.library` custom op. This is the entry point; the kernels live beside it, one algorithm per module:

    gated_attention_forward.py    forward (gate in the epilogue of a FlashAttention-style kernel)
    gated_attention_backward.py   division-free backward: Delta/dA/dG pre-pass, dK/dV, dQ
    gated_attention_decode.py     split-KV decode for one query per sequence
    gated_attention_prologue.py   `@triton.jit` helpers they share (program coordinates, sequence bounds, addressing)
    gated_attention_common.py     optional Triton import, block configurations per GPU architecture, launch helpers
    gated_attention_naive.py      the plain PyTorch reference (the specification), same signature

The output gate of "Gated Attention for LLMs" (Qiu et al., 2025; the paper's G1 position) is applied to the fp32
accumulator, so the ungated attention output never reaches memory. Features: grouped-query attention of any ratio
(`Hq % Hkv == 0`), causal masking aligned bottom-right when `S_q != S_k`, packed variable-length batches
(`cu_seqlens`, FlashAttention's varlen convention), a split-KV decode path, gates given as arbitrary strided views
(a slice of a fused projection, an `expand()` over heads), head dims up to 256 (non-powers of two are padded inside
the kernel). Rows that see no key output zeros and get zero gradients. The backward uses no atomics, so it is
deterministic. `gated_attention` has a fake implementation and registered autograd, so `torch.compile(fullgraph=True)`
traces through it.

Inputs: fp16 or bf16 on a CUDA GPU (the kernels are compiled for tensor cores; fp32 inputs are refused there with a
message, SDPA is the fallback for fp32 models); fp16, bf16 and fp32 under the Triton interpreter on a CPU
(`TRITON_INTERPRET=1`, set before this module is imported; bf16 is computed in fp32 there, one fixed block
configuration replaces autotuning).

This module knows nothing about Transformers and uses relative imports only, so it can be copied beside a modeling
file onto the Hugging Face Hub. Triton is optional: without it the module still imports and `triton_available()`
returns False.
"""

import math

import torch

from .gated_attention_common import INTERPRET, TRITON_IMPORT_ERROR, triton, triton_available
from .gated_attention_naive import naive_gated_attention

if triton is not None:  # the kernel modules define their @triton.jit functions at import
    from .gated_attention_backward import backward
    from .gated_attention_decode import decode_forward
    from .gated_attention_forward import forward

__all__ = [
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
    "gated_attention",
    "gated_attention_supported",
    "gated_attention_unsupported_reason",
    "naive_gated_attention",
    "triton_available",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------------------------------


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def _check_inputs(q, k, v, gate, cu_seqlens_q, cu_seqlens_k, *, check_device: bool) -> None:
    """Raise ValueError (TypeError for non-tensors) naming what is wrong with the inputs and what would be right."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (packed varlen input) or not at all")
    packed = cu_seqlens_q is not None
    want = 3 if packed else 4
    layout = "[T, H, D] (packed, with cu_seqlens)" if packed else "[B, S, H, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not packed and (q.shape[0] != k.shape[0]):
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    h_q, d = q.shape[-2], q.shape[-1]
    h_kv = k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"q and k must have the same head dim, got {d} and {k.shape[-1]}")
    if h_kv == 0 or h_q % h_kv != 0:
        raise ValueError(f"the number of query heads ({h_q}) must be a multiple of the number of key/value heads "
                         f"({h_kv})")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is not supported: the Triton kernel supports head dims 1..{MAX_HEAD_DIM} "
                         f"(64 and 128 are the tuned ones)")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; use one of {[str(t) for t in SUPPORTED_DTYPES]}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if gate is not None:
        if not isinstance(gate, torch.Tensor):
            raise TypeError(f"gate must be a torch.Tensor or None, got {type(gate).__name__}")
        if gate.shape[:-1] != q.shape[:-1] or gate.shape[-1] not in (d, 1):
            expected_lead = tuple(q.shape[:-1])
            raise ValueError(f"gate must have shape {expected_lead + (d,)} (elementwise) or {expected_lead + (1,)} "
                             f"(headwise), got {tuple(gate.shape)}")
        if gate.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"gate dtype {gate.dtype} is not supported; use one of "
                             f"{[str(t) for t in SUPPORTED_DTYPES]}")
        if gate.device != q.device:
            raise ValueError(f"gate is on {gate.device} but q is on {q.device}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if packed:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
                raise ValueError(f"{name} must be a 1-D int32 tensor of N + 1 offsets")
            if cu.device != q.device:
                raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel() or cu_seqlens_q.numel() < 1:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both hold N + 1 offsets, got "
                             f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    if check_device:
        if triton is None:
            raise RuntimeError(f"Triton is not installed ({TRITON_IMPORT_ERROR}); use naive_gated_attention or "
                               f"install the `triton` extra")
        if not (_on_gpu(q) or INTERPRET):
            raise ValueError(f"the Triton kernel needs CUDA tensors (got {q.device}); on CPU set TRITON_INTERPRET=1 "
                             f"before importing this module, or use naive_gated_attention")
        if _on_gpu(q) and q.dtype == torch.float32 and not INTERPRET:
            raise ValueError("fp32 inputs are not supported on the GPU (the kernel is compiled for bf16/fp16 tensor "
                             "cores): use torch.bfloat16 or torch.float16 inputs (a model loaded with "
                             "dtype=torch.bfloat16), or attn_implementation='sdpa' for an fp32 model")


def gated_attention_unsupported_reason(q, k, v, gate=None, *, cu_seqlens_q=None, cu_seqlens_k=None) -> str | None:
    """None when `gated_attention` accepts these inputs on this machine, else a sentence saying why not.

    Shapes as in `gated_attention`. Cheap: looks at shapes, dtypes and devices only.
    """
    if not triton_available():
        return "Triton is not installed" if triton is None else "no CUDA device and TRITON_INTERPRET is not set"
    try:
        _check_inputs(q, k, v, gate, cu_seqlens_q, cu_seqlens_k, check_device=True)
    except (TypeError, ValueError, RuntimeError) as err:
        return str(err)
    return None


def gated_attention_supported(q, k, v, gate=None, *, cu_seqlens_q=None, cu_seqlens_k=None) -> bool:
    """True when `gated_attention` can run on these inputs here (see `gated_attention_unsupported_reason`)."""
    return gated_attention_unsupported_reason(q, k, v, gate, cu_seqlens_q=cu_seqlens_q,
                                              cu_seqlens_k=cu_seqlens_k) is None


# --------------------------------------------------------------------------------------------------------------------
# Custom op (torch.compile traces the fake implementations) and autograd
# --------------------------------------------------------------------------------------------------------------------

_OP_NAMESPACE = "gated_qwen"


def _define_ops():
    """Register the custom ops once per process.

    The module can be imported twice under different names (the installed package and a copy loaded as Hub remote
    code); the second import reuses the ops registered by the first, which run the same kernels.
    """
    ns = getattr(torch.ops, _OP_NAMESPACE)
    if hasattr(ns, "gated_attention_fwd") and hasattr(ns, "gated_attention_bwd"):
        return ns.gated_attention_fwd.default, ns.gated_attention_bwd.default

    @torch.library.custom_op(f"{_OP_NAMESPACE}::gated_attention_fwd", mutates_args=())
    def gated_attention_fwd(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, causal: bool,
        scale: float, cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
        max_seqlen_q: int, max_seqlen_k: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if max_seqlen_q == 1:
            return decode_forward(q, k, v, gate, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_k)
        return forward(q, k, v, gate, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

    @gated_attention_fwd.register_fake
    def _(q, k, v, gate, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        rows = q.shape[0] if cu_seqlens_q is not None else q.shape[0] * q.shape[1]
        return q.new_empty(q.shape), q.new_empty((q.shape[-2], rows), dtype=torch.float32)

    @torch.library.custom_op(f"{_OP_NAMESPACE}::gated_attention_bwd", mutates_args=())
    def gated_attention_bwd(
        dy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
        out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float, cu_seqlens_q: torch.Tensor | None,
        cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv, dgate = backward(dy, q, k, v, gate, out, lse, causal, scale, cu_seqlens_q, cu_seqlens_k,
                                      max_seqlen_q, max_seqlen_k)
        # A custom op cannot return None; without a gate an empty tensor stands in for dgate.
        return dq, dk, dv, (dgate if dgate is not None else q.new_empty(0))

    @gated_attention_bwd.register_fake
    def _(dy, q, k, v, gate, out, lse, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        dgate = gate.new_empty(gate.shape) if gate is not None else q.new_empty(0)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dgate

    def setup_context(ctx, inputs, output):
        q, k, v, gate, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, gate, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.causal, ctx.scale = causal, scale
        ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k

    def autograd_backward(ctx, grad_out, grad_lse):
        del grad_lse  # lse is an internal by-product, not differentiated
        q, k, v, gate, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv, dgate = getattr(torch.ops, _OP_NAMESPACE).gated_attention_bwd(
            grad_out, q, k, v, gate, out, lse, ctx.causal, ctx.scale, cu_seqlens_q, cu_seqlens_k,
            ctx.max_seqlen_q, ctx.max_seqlen_k)
        return dq, dk, dv, (dgate if gate is not None else None), None, None, None, None, None, None

    gated_attention_fwd.register_autograd(autograd_backward, setup_context=setup_context)
    return ns.gated_attention_fwd.default, ns.gated_attention_bwd.default


_gated_attention_fwd_op, _gated_attention_bwd_op = _define_ops()


# --------------------------------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------------------------------


def gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Fused gated attention: `softmax(q kᵀ · scale + causal mask) v ⊙ sigmoid(gate)`, differentiable.

    Args:
        q: `[B, S_q, Hq, D]`, or `[T_q, Hq, D]` packed when `cu_seqlens_q` is given. fp16 or bf16 (fp32 too
            under the interpreter).
        k: `[B, S_k, Hkv, D]`, or `[T_k, Hkv, D]` packed; `Hq % Hkv == 0` (GQA, not expanded). Same dtype as q.
        v: same shape and dtype as `k`.
        gate: pre-activation gate logits with the leading dims of `q`: `[..., Hq, D]` (elementwise) or
            `[..., Hq, 1]` (headwise); any strides (a slice of a fused projection, an expand() over heads), never
            copied. `None`: no gate (plain attention).
        causal: causal mask, aligned bottom-right when a sequence has `S_q != S_k` (query i sees keys
            `j <= i + S_k - S_q`); query rows that see no key output zeros.
        scale: softmax scale, default `1 / sqrt(D)`.
        cu_seqlens_q, cu_seqlens_k: int32 `[N + 1]` offsets of N packed sequences (FlashAttention varlen layout).
        max_seqlen_q, max_seqlen_k: longest packed sequence; computed from `cu_seqlens` (a device sync) if omitted.

    Returns:
        `[B, S_q, Hq, D]` (or `[T_q, Hq, D]`), dtype of q, contiguous.

    One query per sequence (`S_q == 1`, or `max_seqlen_q == 1` packed) takes the split-KV decode kernel.
    """
    _check_inputs(q, k, v, gate, cu_seqlens_q, cu_seqlens_k, check_device=True)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if cu_seqlens_q is not None:
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if cu_seqlens_q.numel() > 1 else 0
        if max_seqlen_k is None:
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item()) if cu_seqlens_k.numel() > 1 else 0
    else:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    out, _ = _gated_attention_fwd_op(q, k, v, gate, bool(causal), scale, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k)
    return out
