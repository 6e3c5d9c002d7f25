"""Fused gated attention in Triton: `softmax(q kᵀ · scale + mask) v ⊙ sigmoid(gate)` forward and backward.

The output gate of "Gated Attention for LLMs" (Qiu et al., 2025; the paper's G1 position) is applied to the fp32
accumulator in the epilogue of a FlashAttention-style kernel, so the ungated attention output never reaches memory.
The backward pass uses the division-free scheme (never recovers the ungated output as `out / sigmoid(gate)`):

    s = σ(G), out = A ⊙ s, dA = dY ⊙ s, Delta = rowsum(dA ⊙ A) = rowsum(dY ⊙ out),
    dG = dY ⊙ out ⊙ σ(−G) (elementwise) or σ(−G) · Delta (headwise)

computed by one pre-pass, after which the usual dK/dV and dQ passes consume dA in place of dY.

Features: grouped-query attention of any ratio (`Hq % Hkv == 0`; the dK/dV program loops over its group's query
heads, so no per-query-head copies of dK/dV), causal masking aligned bottom-right when `S_q != S_k`, packed
variable-length batches (`cu_seqlens`, FlashAttention's varlen convention), a split-KV decode path for one query per
sequence with a GQA group's query heads in the tile rows, gates given as arbitrary strided views (a slice of a fused
projection, an `expand()` over heads), fp16 / bf16 / fp32 inputs with fp32 accumulation, and head dims up to 256
(non-powers of two are padded inside the kernel). Rows that see no key output zeros and get zero gradients.
`gated_attention` is a `torch.library` custom op with a fake implementation and registered autograd, so
`torch.compile(fullgraph=True)` traces through it.

On a machine without a GPU the kernels run under the Triton interpreter (`TRITON_INTERPRET=1`, which must be set
before this module is imported). The interpreter mishandles bf16 arithmetic, so bf16 tiles are upcast to fp32 right
after loading there; one fixed block configuration replaces autotuning.

This module knows nothing about Transformers and uses relative imports only, so it can be copied beside a modeling
file onto the Hugging Face Hub. Triton is optional: without it the module still imports and `triton_available()`
returns False.
"""

import math
import os

import torch

from .naive_gated_attention import naive_gated_attention

try:
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: BaseException | None = None
except ImportError as _err:  # the module must import on machines without Triton
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = _err

__all__ = [
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
    "gated_attention",
    "gated_attention_supported",
    "gated_attention_unsupported_reason",
    "naive_gated_attention",
    "triton_available",
]

# Read once at import: `@triton.jit` captures the interpreter switch when the kernels are defined.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634


def triton_available() -> bool:
    """True when Triton is importable and the kernels can run somewhere: on a CUDA GPU, or under the interpreter."""
    return triton is not None and (INTERPRET or torch.cuda.is_available())


# --------------------------------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------------------------------


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
            raise RuntimeError(f"Triton is not installed ({_TRITON_IMPORT_ERROR}); use naive_gated_attention or "
                               f"install the `triton` extra")
        if not (q.is_cuda or INTERPRET):
            raise ValueError(f"the Triton kernel needs CUDA tensors (got {q.device}); on CPU set TRITON_INTERPRET=1 "
                             f"before importing this module, or use naive_gated_attention")


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
# Kernels
# --------------------------------------------------------------------------------------------------------------------

if triton is not None:

    def _configs(block_pairs, warps, stages, interpret_pair=(64, 64)):
        """Autotune candidates on a GPU; exactly one config under the interpreter (more than one fails there)."""
        if INTERPRET:
            return [triton.Config({"BLOCK_M": interpret_pair[0], "BLOCK_N": interpret_pair[1]}, num_warps=4,
                                  num_stages=1)]
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
                for bm, bn in block_pairs for w in warps for s in stages]

    _FWD_CONFIGS = _configs([(128, 64), (128, 128), (64, 64), (128, 32)], [4, 8], [2, 3, 4])
    _BWD_CONFIGS = _configs([(64, 64), (32, 64), (64, 128), (128, 64), (32, 128)], [4, 8], [2, 3])
    _AUTOTUNE_KEY = ["HEAD_DIM", "CAUSAL", "IS_VARLEN", "HAS_GATE", "GATE_HEADWISE", "SEQ_BUCKET_Q", "SEQ_BUCKET_K"]

    @triton.jit
    def _seq_bounds(CuQ, CuK, b, SEQLEN_Q, SEQLEN_K, IS_VARLEN: tl.constexpr):
        """(start row, length) of sequence `b` (an int32 program index) for queries and keys."""
        if IS_VARLEN:
            q_start = tl.load(CuQ + b)
            q_len = tl.load(CuQ + b + 1) - q_start
            k_start = tl.load(CuK + b)
            k_len = tl.load(CuK + b + 1) - k_start
        else:
            q_start = b * 0
            q_len = SEQLEN_Q
            k_start = b * 0
            k_len = SEQLEN_K
        # Starts in int64: a packed batch can hold more than 2**31 elements.
        return q_start.to(tl.int64), q_len, k_start.to(tl.int64), k_len

    @triton.jit
    def _sigmoid(x):
        # exp(-x) overflows to inf for x < -88 and then gives exactly 0: no NaN at any logit.
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _query_block_kv_range(m0, q_len, k_len, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr):
        """Key range for query rows [m0, m0 + BLOCK_M): blocks in [0, full_end) need no mask, [full_end, end) do."""
        if CAUSAL:
            diag = k_len - q_len  # bottom-right: row i sees key j iff j <= i + diag
            end = tl.minimum(k_len, m0 + BLOCK_M + diag)
            full_end = tl.minimum(k_len, m0 + 1 + diag)
        else:
            end = k_len
            full_end = k_len
        end = tl.maximum(end, 0)
        full_end = tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N
        return full_end, end

    @triton.jit
    def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, sks, skd, svs, svd, lo, hi, offs_m, offs_n, offs_d, d_mask,
                   k_len, diag, qk_scale, MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                   DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr):
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + offs_n
            if MASK:
                kv_mask = (cols[:, None] < k_len) & d_mask[None, :]
            else:
                kv_mask = d_mask[None, :]
            k = tl.load(k_base + cols[:, None] * sks + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
            v = tl.load(v_base + cols[:, None] * svs + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
            if MASK:
                visible = cols[None, :] < k_len
                if CAUSAL:
                    visible = visible & (cols[None, :] <= offs_m[:, None] + diag)
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_use = m_new
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
        return acc, l_i, m_i

    @triton.autotune(configs=_FWD_CONFIGS, key=_AUTOTUNE_KEY)
    @triton.jit
    def _fwd_kernel(
        Q, K, V, G, Out, Lse, CuQ, CuK,
        sqb, sqs, sqh, sqd,
        skb, sks, skh, skd,
        svb, svs, svh, svd,
        sgb, sgs, sgh, sgd,
        sob, sos, soh, sod,
        slh, slb,
        H_Q, GROUP, SEQLEN_Q, SEQLEN_K, qk_scale,
        SEQ_BUCKET_Q, SEQ_BUCKET_K,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_GATE: tl.constexpr, GATE_HEADWISE: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H_Q
        hq = pid_bh % H_Q
        hk = hq // GROUP
        q_start, q_len, k_start, k_len = _seq_bounds(CuQ, CuK, b, SEQLEN_Q, SEQLEN_K, IS_VARLEN)
        m0 = pid_m * BLOCK_M
        if m0 >= q_len:
            return
        b64 = b.to(tl.int64)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        row_mask = offs_m < q_len
        q_base = Q + b64 * sqb + q_start * sqs + hq * sqh
        q = tl.load(q_base + offs_m[:, None] * sqs + offs_d[None, :] * sqd,
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_base = K + b64 * skb + k_start * sks + hk * skh
        v_base = V + b64 * svb + k_start * svs + hk * svh

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        diag = k_len - q_len
        full_end, end = _query_block_kv_range(m0, q_len, k_len, CAUSAL, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, sks, skd, svs, svd, 0, full_end, offs_m,
                                   offs_n, offs_d, d_mask, k_len, diag, qk_scale, False, CAUSAL, UPCAST, DOT_PREC,
                                   BLOCK_N)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, sks, skd, svs, svd, full_end, end, offs_m,
                                   offs_n, offs_d, d_mask, k_len, diag, qk_scale, True, CAUSAL, UPCAST, DOT_PREC,
                                   BLOCK_N)

        empty = l_i == 0.0  # rows with no visible key: output 0, lse = +inf so the backward gives them p = 0
        l_safe = tl.where(empty, 1.0, l_i)
        o = acc / l_safe[:, None]
        if HAS_GATE:
            g_base = G + b64 * sgb + q_start * sgs + hq * sgh
            if GATE_HEADWISE:
                g = tl.load(g_base + offs_m * sgs, mask=row_mask, other=0.0).to(tl.float32)
                o = o * _sigmoid(g)[:, None]
            else:
                g = tl.load(g_base + offs_m[:, None] * sgs + offs_d[None, :] * sgd,
                            mask=row_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
                o = o * _sigmoid(g)
        o_base = Out + b64 * sob + q_start * sos + hq * soh
        tl.store(o_base + offs_m[:, None] * sos + offs_d[None, :] * sod, o.to(Out.dtype.element_ty),
                 mask=row_mask[:, None] & d_mask[None, :])
        lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
        tl.store(Lse + hq * slh + b64 * slb + q_start + offs_m, lse, mask=row_mask)

    @triton.jit
    def _bwd_preprocess_kernel(
        Out, DY, G, DA, Delta, DG, CuQ, CuK,
        sob, sos, soh, sod,
        syb, sys, syh, syd,
        sgb, sgs, sgh, sgd,
        sab, sas, sah, sad,
        sdgb, sdgs, sdgh, sdgd,
        slh, slb,
        H_Q, SEQLEN_Q,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        IS_VARLEN: tl.constexpr, HAS_GATE: tl.constexpr, GATE_HEADWISE: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Delta = rowsum(dY ⊙ out); with a gate also dA = dY ⊙ σ(G) and dG (never divides by σ(G))."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H_Q
        hq = pid_bh % H_Q
        q_start, q_len, _k_start, _k_len = _seq_bounds(CuQ, CuQ, b, SEQLEN_Q, SEQLEN_Q, IS_VARLEN)
        m0 = pid_m * BLOCK_M
        if m0 >= q_len:
            return
        b64 = b.to(tl.int64)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_mask = offs_m < q_len
        mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        o = tl.load(Out + b64 * sob + q_start * sos + hq * soh + offs_m[:, None] * sos + offs_d[None, :] * sod,
                    mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + b64 * syb + q_start * sys + hq * syh + offs_m[:, None] * sys + offs_d[None, :] * syd,
                     mask=mask, other=0.0).to(tl.float32)
        delta = tl.sum(dy * o, 1)
        tl.store(Delta + hq * slh + b64 * slb + q_start + offs_m, delta, mask=row_mask)
        if HAS_GATE:
            g_base = G + b64 * sgb + q_start * sgs + hq * sgh
            dg_base = DG + b64 * sdgb + q_start * sdgs + hq * sdgh
            if GATE_HEADWISE:
                g = tl.load(g_base + offs_m * sgs, mask=row_mask, other=0.0).to(tl.float32)
                da = dy * _sigmoid(g)[:, None]
                dg = _sigmoid(-g) * delta
                tl.store(dg_base + offs_m * sdgs, dg.to(DG.dtype.element_ty), mask=row_mask)
            else:
                g = tl.load(g_base + offs_m[:, None] * sgs + offs_d[None, :] * sgd, mask=mask,
                            other=0.0).to(tl.float32)
                da = dy * _sigmoid(g)
                dg = dy * o * _sigmoid(-g)
                tl.store(dg_base + offs_m[:, None] * sdgs + offs_d[None, :] * sdgd, dg.to(DG.dtype.element_ty),
                         mask=mask)
            tl.store(DA + b64 * sab + q_start * sas + hq * sah + offs_m[:, None] * sas + offs_d[None, :] * sad,
                     da.to(DA.dtype.element_ty), mask=mask)

    @triton.jit
    def _bwd_kv_inner(dk, dv, k, v, q_base, da_base, lse_base, delta_base, sqs, sqd, sas, sad, lo, hi, offs_n,
                      offs_m, offs_d, d_mask, q_len, diag, qk_scale, MASK: tl.constexpr, UPCAST: tl.constexpr,
                      DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr):
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + offs_m
            row_mask = rows < q_len
            tile_mask = row_mask[:, None] & d_mask[None, :]
            q = tl.load(q_base + rows[:, None] * sqs + offs_d[None, :] * sqd, mask=tile_mask, other=0.0)
            da = tl.load(da_base + rows[:, None] * sas + offs_d[None, :] * sad, mask=tile_mask, other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                da = da.to(tl.float32)
            # Rows past the end (and rows that saw no key) carry lse = +inf, hence p = 0.
            lse = tl.load(lse_base + rows, mask=row_mask, other=float("inf"))
            delta = tl.load(delta_base + rows, mask=row_mask, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # [BLOCK_N, BLOCK_M]
            p_t = tl.exp2(s_t - lse[None, :])
            if MASK:
                p_t = tl.where(offs_n[:, None] <= rows[None, :] + diag, p_t, 0.0)
            dv += tl.dot(p_t.to(da.dtype), da, input_precision=DOT_PREC)
            dp_t = tl.dot(v, tl.trans(da), input_precision=DOT_PREC)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PREC)
        return dk, dv

    @triton.autotune(configs=_BWD_CONFIGS, key=_AUTOTUNE_KEY)
    @triton.jit
    def _bwd_dkdv_kernel(
        Q, K, V, DA, Lse, Delta, DK, DV, CuQ, CuK,
        sqb, sqs, sqh, sqd,
        skb, sks, skh, skd,
        svb, svs, svh, svd,
        sab, sas, sah, sad,
        sdkb, sdks, sdkh, sdkd,
        sdvb, sdvs, sdvh, sdvd,
        slh, slb,
        H_KV, GROUP, SEQLEN_Q, SEQLEN_K, qk_scale, sm_scale,
        SEQ_BUCKET_Q, SEQ_BUCKET_K,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_GATE: tl.constexpr, GATE_HEADWISE: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One program per (key block, kv head): loops over the group's query heads, so no atomics or copies."""
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H_KV
        hk = pid_bh % H_KV
        q_start, q_len, k_start, k_len = _seq_bounds(CuQ, CuK, b, SEQLEN_Q, SEQLEN_K, IS_VARLEN)
        n0 = pid_n * BLOCK_N
        if n0 >= k_len:
            return
        b64 = b.to(tl.int64)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        kv_mask = (offs_n < k_len)[:, None] & d_mask[None, :]
        k = tl.load(K + b64 * skb + k_start * sks + hk * skh + offs_n[:, None] * sks + offs_d[None, :] * skd,
                    mask=kv_mask, other=0.0)
        v = tl.load(V + b64 * svb + k_start * svs + hk * svh + offs_n[:, None] * svs + offs_d[None, :] * svd,
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

        diag = k_len - q_len
        if CAUSAL:
            # Query row i sees key j iff i >= j - diag; it sees the whole key block iff i >= n0 + BLOCK_N - 1 - diag.
            lo = tl.maximum(n0 - diag, 0) // BLOCK_M * BLOCK_M
            mid = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M
            mask_hi = tl.minimum(mid, q_len)
        else:
            lo = 0
            mid = 0
            mask_hi = 0
        for g in range(GROUP):
            hq = hk * GROUP + g
            q_base = Q + b64 * sqb + q_start * sqs + hq * sqh
            da_base = DA + b64 * sab + q_start * sas + hq * sah
            lse_base = Lse + hq * slh + b64 * slb + q_start
            delta_base = Delta + hq * slh + b64 * slb + q_start
            dk, dv = _bwd_kv_inner(dk, dv, k, v, q_base, da_base, lse_base, delta_base, sqs, sqd, sas, sad, lo,
                                   mask_hi, offs_n, offs_m, offs_d, d_mask, q_len, diag, qk_scale, True, UPCAST,
                                   DOT_PREC, BLOCK_M)
            dk, dv = _bwd_kv_inner(dk, dv, k, v, q_base, da_base, lse_base, delta_base, sqs, sqd, sas, sad, mid,
                                   q_len, offs_n, offs_m, offs_d, d_mask, q_len, diag, qk_scale, False, UPCAST,
                                   DOT_PREC, BLOCK_M)
        dk = dk * sm_scale
        tl.store(DK + b64 * sdkb + k_start * sdks + hk * sdkh + offs_n[:, None] * sdks + offs_d[None, :] * sdkd,
                 dk.to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + b64 * sdvb + k_start * sdvs + hk * sdvh + offs_n[:, None] * sdvs + offs_d[None, :] * sdvd,
                 dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _bwd_q_inner(dq, q, da, lse, delta, k_base, v_base, sks, skd, svs, svd, lo, hi, offs_m, offs_n, offs_d,
                     d_mask, k_len, diag, qk_scale, MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                     DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr):
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + offs_n
            if MASK:
                kv_mask = (cols[:, None] < k_len) & d_mask[None, :]
            else:
                kv_mask = d_mask[None, :]
            k = tl.load(k_base + cols[:, None] * sks + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
            v = tl.load(v_base + cols[:, None] * svs + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            p = tl.exp2(s - lse[:, None])
            if MASK:
                visible = cols[None, :] < k_len
                if CAUSAL:
                    visible = visible & (cols[None, :] <= offs_m[:, None] + diag)
                p = tl.where(visible, p, 0.0)
            dp = tl.dot(da, tl.trans(v), input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
        return dq

    @triton.autotune(configs=_BWD_CONFIGS, key=_AUTOTUNE_KEY)
    @triton.jit
    def _bwd_dq_kernel(
        Q, K, V, DA, Lse, Delta, DQ, CuQ, CuK,
        sqb, sqs, sqh, sqd,
        skb, sks, skh, skd,
        svb, svs, svh, svd,
        sab, sas, sah, sad,
        sdqb, sdqs, sdqh, sdqd,
        slh, slb,
        H_Q, GROUP, SEQLEN_Q, SEQLEN_K, qk_scale, sm_scale,
        SEQ_BUCKET_Q, SEQ_BUCKET_K,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_GATE: tl.constexpr, GATE_HEADWISE: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H_Q
        hq = pid_bh % H_Q
        hk = hq // GROUP
        q_start, q_len, k_start, k_len = _seq_bounds(CuQ, CuK, b, SEQLEN_Q, SEQLEN_K, IS_VARLEN)
        m0 = pid_m * BLOCK_M
        if m0 >= q_len:
            return
        b64 = b.to(tl.int64)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        row_mask = offs_m < q_len
        tile_mask = row_mask[:, None] & d_mask[None, :]
        q = tl.load(Q + b64 * sqb + q_start * sqs + hq * sqh + offs_m[:, None] * sqs + offs_d[None, :] * sqd,
                    mask=tile_mask, other=0.0)
        da = tl.load(DA + b64 * sab + q_start * sas + hq * sah + offs_m[:, None] * sas + offs_d[None, :] * sad,
                     mask=tile_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            da = da.to(tl.float32)
        lse = tl.load(Lse + hq * slh + b64 * slb + q_start + offs_m, mask=row_mask, other=float("inf"))
        delta = tl.load(Delta + hq * slh + b64 * slb + q_start + offs_m, mask=row_mask, other=0.0)
        k_base = K + b64 * skb + k_start * sks + hk * skh
        v_base = V + b64 * svb + k_start * svs + hk * svh
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        diag = k_len - q_len
        full_end, end = _query_block_kv_range(m0, q_len, k_len, CAUSAL, BLOCK_M, BLOCK_N)
        dq = _bwd_q_inner(dq, q, da, lse, delta, k_base, v_base, sks, skd, svs, svd, 0, full_end, offs_m, offs_n,
                          offs_d, d_mask, k_len, diag, qk_scale, False, CAUSAL, UPCAST, DOT_PREC, BLOCK_N)
        dq = _bwd_q_inner(dq, q, da, lse, delta, k_base, v_base, sks, skd, svs, svd, full_end, end, offs_m, offs_n,
                          offs_d, d_mask, k_len, diag, qk_scale, True, CAUSAL, UPCAST, DOT_PREC, BLOCK_N)
        dq = dq * sm_scale
        tl.store(DQ + b64 * sdqb + q_start * sdqs + hq * sdqh + offs_m[:, None] * sdqs + offs_d[None, :] * sdqd,
                 dq.to(DQ.dtype.element_ty), mask=tile_mask)

    @triton.jit
    def _decode_split_kernel(
        Q, K, V, PartO, PartLse, CuQ, CuK,
        sqb, sqs, sqh, sqd,
        skb, sks, skh, skd,
        svb, svs, svh, svd,
        H_KV, GROUP, SEQLEN_Q, SEQLEN_K, CHUNK, qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, UPCAST: tl.constexpr,
        DOT_PREC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """One query per sequence: a program takes a GQA group's query heads (tile rows) and one chunk of the keys.

        Writes the chunk's normalised partial output `PartO[split, b, hq, :]` (fp32) and its base-2 logsumexp
        `PartLse[split, b, hq]` (-inf when the chunk is empty); `_decode_combine_kernel` merges the chunks.
        """
        split = tl.program_id(0)
        pid_bh = tl.program_id(1)
        n_batch = tl.num_programs(1) // H_KV
        b = pid_bh // H_KV
        hk = pid_bh % H_KV
        q_start, q_len, k_start, k_len = _seq_bounds(CuQ, CuK, b, SEQLEN_Q, SEQLEN_K, IS_VARLEN)
        b64 = b.to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        h_mask = offs_h < GROUP * q_len  # q_len is 0 or 1 on this path
        hq = hk * GROUP + offs_h
        q = tl.load(Q + b64 * sqb + q_start * sqs + hq[:, None] * sqh + offs_d[None, :] * sqd,
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_base = K + b64 * skb + k_start * sks + hk * skh
        v_base = V + b64 * svb + k_start * svs + hk * svh
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, k_len)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        # A single query row sees every key under bottom-right causal alignment, so only the length masks.
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, sks, skd, svs, svd, lo, hi, offs_h, offs_n,
                                   offs_d, d_mask, hi, 0, qk_scale, True, False, UPCAST, DOT_PREC, BLOCK_N)
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        o = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
        n_hq = H_KV * GROUP
        row = (split * n_batch + b64) * n_hq + hq
        tl.store(PartO + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=h_mask[:, None] & d_mask[None, :])
        tl.store(PartLse + row, lse, mask=h_mask)

    @triton.jit
    def _decode_combine_kernel(
        PartO, PartLse, G, Out, Lse, CuQ,
        sgb, sgs, sgh, sgd,
        sob, sos, soh, sod,
        slh, slb,
        H_Q, N_BATCH, NUM_SPLITS, SEQLEN_Q,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
        IS_VARLEN: tl.constexpr, HAS_GATE: tl.constexpr, GATE_HEADWISE: tl.constexpr,
    ):
        """Merge the chunks of one (sequence, query head), apply the gate, store the output and the logsumexp."""
        pid = tl.program_id(0)
        b = pid // H_Q
        hq = pid % H_Q
        q_start, q_len, _k_start, _k_len = _seq_bounds(CuQ, CuQ, b, SEQLEN_Q, SEQLEN_Q, IS_VARLEN)
        if q_len == 0:
            return
        b64 = b.to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        s_mask = offs_s < NUM_SPLITS
        row = (offs_s * N_BATCH + b64) * H_Q + hq
        part_lse = tl.load(PartLse + row, mask=s_mask, other=float("-inf"))
        m = tl.max(part_lse, 0)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(part_lse - m_use)
        l_sum = tl.sum(w, 0)
        part_o = tl.load(PartO + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                         other=0.0)
        empty = l_sum == 0.0
        l_safe = tl.where(empty, 1.0, l_sum)
        o = tl.sum(part_o * w[:, None], 0) / l_safe
        if HAS_GATE:
            g_base = G + b64 * sgb + q_start * sgs + hq * sgh
            if GATE_HEADWISE:
                o = o * _sigmoid(tl.load(g_base).to(tl.float32))
            else:
                o = o * _sigmoid(tl.load(g_base + offs_d * sgd, mask=d_mask, other=0.0).to(tl.float32))
        tl.store(Out + b64 * sob + q_start * sos + hq * soh + offs_d * sod, o.to(Out.dtype.element_ty),
                 mask=d_mask)
        tl.store(Lse + hq * slh + b64 * slb + q_start, tl.where(empty, float("inf"), m_use + tl.log2(l_safe)))


# --------------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------------


def _strides4(t: torch.Tensor, packed: bool) -> tuple[int, int, int, int]:
    """(batch, seq, head, dim) strides; a packed [T, H, D] tensor has batch stride 0 (rows come from cu_seqlens)."""
    if packed:
        return (0,) + tuple(t.stride())
    return tuple(t.stride())


def _gate_strides(gate: torch.Tensor | None, packed: bool) -> tuple[int, int, int, int]:
    if gate is None:
        return (0, 0, 0, 0)
    sb, ss, sh, sd = _strides4(gate, packed)
    return sb, ss, sh, (0 if gate.shape[-1] == 1 else sd)


def _bucket(n: int) -> int:
    """Autotune key for a sequence length: next power of two (tune once per size class, not per length)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def _meta(q: torch.Tensor, gate: torch.Tensor | None) -> dict:
    d = q.shape[-1]
    upcast = INTERPRET and q.dtype == torch.bfloat16  # the interpreter computes bf16 arithmetic wrongly
    return {
        "HEAD_DIM": d,
        "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "HAS_GATE": gate is not None,
        "GATE_HEADWISE": gate is not None and gate.shape[-1] == 1 and d != 1,
        "UPCAST": upcast,
        "DOT_PREC": "ieee" if (q.dtype == torch.float32 or upcast) else "tf32",
    }


def _decode_num_splits(q: torch.Tensor, n_batch: int, h_kv: int, max_seqlen_k: int, block_n: int) -> int:
    """Split the keys until the grid fills the GPU about twice (at least one key block per split)."""
    n_blocks = max(1, triton.cdiv(max_seqlen_k, block_n))
    if INTERPRET or not q.is_cuda:
        target = 4  # small, but enough to exercise the merge of several chunks in tests
    else:
        target = triton.cdiv(2 * torch.cuda.get_device_properties(q.device).multi_processor_count,
                             max(1, n_batch * h_kv))
    return int(max(1, min(n_blocks, target, 128)))


def _forward(q, k, v, gate, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Launch the forward; returns (out like q, contiguous; lse [Hq, rows] fp32 in base-2 units, +inf if no key)."""
    packed = cu_seqlens_q is not None
    if packed:
        n_batch = cu_seqlens_q.numel() - 1
        total_q = q.shape[0]
        seqlen_q = seqlen_k = 0
        slb = 0
    else:
        n_batch, seqlen_q = q.shape[0], q.shape[1]
        seqlen_k = k.shape[1]
        total_q = n_batch * seqlen_q
        slb = seqlen_q
    h_q, d = q.shape[-2], q.shape[-1]
    h_kv = k.shape[-2]
    group = h_q // h_kv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((h_q, total_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    meta = _meta(q, gate)
    qk_scale = scale * _LOG2E
    g_arg = gate if gate is not None else q
    cu_q = cu_seqlens_q if packed else lse  # unused placeholders when not packed
    cu_k = cu_seqlens_k if packed else lse
    if max_seqlen_q == 1:
        block_n = 64 if INTERPRET else 128
        n_splits = _decode_num_splits(q, n_batch, h_kv, max_seqlen_k, block_n)
        chunk = triton.cdiv(triton.cdiv(max(max_seqlen_k, 1), n_splits), block_n) * block_n
        part_o = torch.empty((n_splits, n_batch, h_q, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n_splits, n_batch, h_q), dtype=torch.float32, device=q.device)
        _decode_split_kernel[(n_splits, n_batch * h_kv)](
            q, k, v, part_o, part_lse, cu_q, cu_k,
            *_strides4(q, packed), *_strides4(k, packed), *_strides4(v, packed),
            h_kv, group, seqlen_q, seqlen_k, chunk, qk_scale,
            HEAD_DIM=d, BLOCK_D=meta["BLOCK_D"], IS_VARLEN=packed, UPCAST=meta["UPCAST"],
            DOT_PREC=meta["DOT_PREC"], BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
            num_warps=4,
        )
        _decode_combine_kernel[(n_batch * h_q,)](
            part_o, part_lse, g_arg, out, lse, cu_q,
            *_gate_strides(gate, packed), *_strides4(out, packed),
            lse.stride(0), slb,
            h_q, n_batch, n_splits, seqlen_q,
            HEAD_DIM=d, BLOCK_D=meta["BLOCK_D"], BLOCK_S=max(2, triton.next_power_of_2(n_splits)),
            IS_VARLEN=packed, HAS_GATE=meta["HAS_GATE"], GATE_HEADWISE=meta["GATE_HEADWISE"],
            num_warps=4,
        )
        return out, lse

    def grid(cfg):
        return (triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), n_batch * h_q)

    _fwd_kernel[grid](
        q, k, v, g_arg, out, lse, cu_q, cu_k,
        *_strides4(q, packed), *_strides4(k, packed), *_strides4(v, packed), *_gate_strides(gate, packed),
        *_strides4(out, packed),
        lse.stride(0), slb,
        h_q, group, seqlen_q, seqlen_k, qk_scale,
        _bucket(max_seqlen_q), _bucket(max_seqlen_k),
        CAUSAL=causal, IS_VARLEN=packed, **meta,
    )
    return out, lse


def _backward(dy, q, k, v, gate, out, lse, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Launch the backward; returns (dq, dk, dv, dgate or None), each contiguous and shaped like its input."""
    packed = cu_seqlens_q is not None
    if packed:
        n_batch = cu_seqlens_q.numel() - 1
        seqlen_q = seqlen_k = 0
        slb = 0
    else:
        n_batch, seqlen_q = q.shape[0], q.shape[1]
        seqlen_k = k.shape[1]
        slb = seqlen_q
    h_q, d = q.shape[-2], q.shape[-1]
    h_kv = k.shape[-2]
    group = h_q // h_kv
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # zeros: rows of empty sequences are never visited
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    dgate = None if gate is None else torch.zeros(gate.shape, dtype=gate.dtype, device=gate.device)
    if q.numel() == 0 or k.numel() == 0:
        return dq, dk, dv, dgate
    meta = _meta(q, gate)
    qk_scale = scale * _LOG2E
    delta = torch.empty_like(lse)
    cu_q = cu_seqlens_q if packed else lse
    cu_k = cu_seqlens_k if packed else lse
    if gate is not None:
        da = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dg_arg = dgate
    else:
        da = dy  # without a gate dA is dY itself, read through its own strides
        dg_arg = delta
    pre_block = 64
    _bwd_preprocess_kernel[(triton.cdiv(max_seqlen_q, pre_block), n_batch * h_q)](
        out, dy, gate if gate is not None else q, da, delta, dg_arg, cu_q, cu_q,
        *_strides4(out, packed), *_strides4(dy, packed), *_gate_strides(gate, packed), *_strides4(da, packed),
        *(_strides4(dgate, packed) if gate is not None else (0, 0, 0, 0)),
        lse.stride(0), slb,
        h_q, seqlen_q,
        HEAD_DIM=d, BLOCK_D=meta["BLOCK_D"], IS_VARLEN=packed, HAS_GATE=meta["HAS_GATE"],
        GATE_HEADWISE=meta["GATE_HEADWISE"], BLOCK_M=pre_block, num_warps=4,
    )
    common = dict(CAUSAL=causal, IS_VARLEN=packed, **meta)
    _bwd_dkdv_kernel[lambda cfg: (triton.cdiv(max_seqlen_k, cfg["BLOCK_N"]), n_batch * h_kv)](
        q, k, v, da, lse, delta, dk, dv, cu_q, cu_k,
        *_strides4(q, packed), *_strides4(k, packed), *_strides4(v, packed), *_strides4(da, packed),
        *_strides4(dk, packed), *_strides4(dv, packed),
        lse.stride(0), slb,
        h_kv, group, seqlen_q, seqlen_k, qk_scale, scale,
        _bucket(max_seqlen_q), _bucket(max_seqlen_k),
        **common,
    )
    _bwd_dq_kernel[lambda cfg: (triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), n_batch * h_q)](
        q, k, v, da, lse, delta, dq, cu_q, cu_k,
        *_strides4(q, packed), *_strides4(k, packed), *_strides4(v, packed), *_strides4(da, packed),
        *_strides4(dq, packed),
        lse.stride(0), slb,
        h_q, group, seqlen_q, seqlen_k, qk_scale, scale,
        _bucket(max_seqlen_q), _bucket(max_seqlen_k),
        **common,
    )
    return dq, dk, dv, dgate


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
        return _forward(q, k, v, gate, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

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
        dq, dk, dv, dgate = _backward(dy, q, k, v, gate, out, lse, causal, scale, cu_seqlens_q, cu_seqlens_k,
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

    def backward(ctx, grad_out, grad_lse):
        del grad_lse  # lse is an internal by-product, not differentiated
        q, k, v, gate, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv, dgate = getattr(torch.ops, _OP_NAMESPACE).gated_attention_bwd(
            grad_out, q, k, v, gate, out, lse, ctx.causal, ctx.scale, cu_seqlens_q, cu_seqlens_k,
            ctx.max_seqlen_q, ctx.max_seqlen_k)
        return dq, dk, dv, (dgate if gate is not None else None), None, None, None, None, None, None

    gated_attention_fwd.register_autograd(backward, setup_context=setup_context)
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
        q: `[B, S_q, Hq, D]`, or `[T_q, Hq, D]` packed when `cu_seqlens_q` is given. fp16, bf16 or fp32.
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
