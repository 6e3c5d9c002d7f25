"""What the fused gated-attention kernel accepts: shapes, dtypes, devices and head dims, checked without Triton; the
kind of a gate (`gate_kind`, the one rule) and the launch flags the kernels derive from their inputs
(`flag_heuristics`).

`check_inputs` raises with what is wrong and what would be right; `gated_attention_unsupported_reason` gives the
same as a sentence (None when the kernel runs these inputs here), for callers that fall back instead of failing.
Inputs: fp16 or bf16 on a CUDA GPU (the kernels are compiled for tensor cores; fp32 inputs are refused there, SDPA
is the fallback for fp32 models); fp16, bf16 and fp32 under the Triton interpreter on a CPU (`TRITON_INTERPRET=1`,
set before this package is imported; bf16 is computed in fp32 there, one fixed block configuration replaces
autotuning).
"""

import torch

from .launch import INTERPRET, TRITON_IMPORT_ERROR, triton, triton_available

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def gate_kind(gate: torch.Tensor | None, head_dim: int) -> str | None:
    """The kind of `gate` (`[..., Hq, D]` or `[..., Hq, 1]`) for heads of `head_dim`: None (no gate), "headwise" (one
    logit per head, broadcast over the head dim) or "elementwise" (one per output element; with head dim 1 the two
    shapes are one, and elementwise). The one rule of the kernels, their self-check and the tests."""
    if gate is None:
        return None
    return "headwise" if gate.shape[-1] == 1 and head_dim != 1 else "elementwise"


def flag_heuristics(*, gate: str | None = "G", headwise: bool = True, upcast_from: str | None = "Q") -> dict:
    """`triton.heuristics` values derived from the launch arguments: BLOCK_D (the head dim padded to a power of two,
    at least 16 for tl.dot), IS_VARLEN (cu_seqlens given), HAS_GATE / GATE_HEADWISE (a gate given; one logit per
    head, for kernels that treat it apart), UPCAST (bf16 tiles are computed in fp32 under the interpreter, whose bf16
    arithmetic is wrong)."""
    values = {
        "BLOCK_D": lambda args: max(16, triton.next_power_of_2(args["HEAD_DIM"])),
        "IS_VARLEN": lambda args: args["cu_seqlens_q"] is not None,
    }
    if upcast_from is not None:
        values["UPCAST"] = lambda args: INTERPRET and args[upcast_from].dtype == torch.bfloat16
    if gate is not None:
        values["HAS_GATE"] = lambda args: args[gate] is not None
    if gate is not None and headwise:
        values["GATE_HEADWISE"] = lambda args: gate_kind(args[gate], args["HEAD_DIM"]) == "headwise"
    return values


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def check_inputs(q, k, v, gate, cu_seqlens_q, cu_seqlens_k, *, check_device: bool) -> None:
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
            raise RuntimeError(f"Triton is not installed ({TRITON_IMPORT_ERROR}): pip install 'gated-qwen[triton]', "
                               f"or use naive_gated_attention")
        if not (_on_gpu(q) or INTERPRET):
            raise ValueError(f"the Triton kernel needs CUDA tensors (got {q.device}); on CPU set TRITON_INTERPRET=1 "
                             f"before importing gated_qwen, or use naive_gated_attention")
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
        check_inputs(q, k, v, gate, cu_seqlens_q, cu_seqlens_k, check_device=True)
    except (TypeError, ValueError, RuntimeError) as err:
        return str(err)
    return None


def gated_attention_supported(q, k, v, gate=None, *, cu_seqlens_q=None, cu_seqlens_k=None) -> bool:
    """True when `gated_attention` can run on these inputs here (see `gated_attention_unsupported_reason`)."""
    return gated_attention_unsupported_reason(q, k, v, gate, cu_seqlens_q=cu_seqlens_q,
                                              cu_seqlens_k=cu_seqlens_k) is None
