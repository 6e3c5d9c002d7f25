"""Fused gated attention in Triton, the training and prefill kernel: `softmax(q kᵀ · scale + mask) v ⊙ sigmoid(gate)`,
forward and backward, as a `torch.library` custom op with its autograd, and `gated_attention`, the entry point.

The output gate of "Gated Attention for LLMs" (Qiu et al., 2025; the paper's G1 position) is applied to the fp32
accumulator, so the ungated attention output never reaches memory. Grouped-query attention of any ratio
(`Hq % Hkv == 0`; a program reads key/value head `h // group`), causal masking aligned bottom-right when
`S_q != S_k`, packed variable-length batches (`cu_seqlens`, FlashAttention's varlen convention), gates given as
arbitrary strided views (a slice of a fused projection, an `expand()` over heads), head dims up to 256 (non-powers of
two are padded inside the kernel). Rows that see no key output zeros and get zero gradients. One query per sequence
takes the split-KV decode kernel (`decoding.py`). `gated_attention` has a fake implementation and registered
autograd, so `torch.compile(fullgraph=True)` traces through it.

The backward is division-free (the ungated output is never recovered as `out / sigmoid(gate)`) and deterministic
(no atomics). With A = softmax(q kᵀ · scale + mask) v, s = σ(G), out = A ⊙ s and the incoming gradient dY:

    dA = dY ⊙ s,   Delta = rowsum(dA ⊙ A) = rowsum(dY ⊙ out),
    dG = dY ⊙ out ⊙ σ(−G) (elementwise) or σ(−G) · Delta (headwise)

`preprocess_kernel` computes Delta, dA and dG in one pass; `dkdv_kernel` (one program per key block and key/value
head, looping over the group's query heads) and `dq_kernel` (one program per query block and query head) then
consume dA where plain attention consumes dY.

Imported only where Triton is installed (`kernel/__init__.py`); what the kernel accepts is checked by `inputs.py`.
"""

import math

import torch

from .decoding import decode_forward
from .inputs import check_inputs, flag_heuristics
from .jit_helpers import (
    causal_key_range,
    lse_offset,
    program_coords,
    reciprocal,
    row_offset,
    sequence_bounds,
    sigmoid,
    tile_mask,
)
from .launch import FP_FUSION, LOG2E, TRITON_VERSION, grid_2d, lse_strides, seq_bucket, strides4, tl, triton
from .tuning import autotune_configs, prune_configs

# The tuner runs once per head dim, mask, layout, gate or none, dtype and sequence-length class (SEQ_BUCKET_*).
FORWARD_AUTOTUNE_KEY = ["HEAD_DIM", "CAUSAL", "IS_VARLEN", "HAS_GATE", "SEQ_BUCKET_Q", "SEQ_BUCKET_K"]
BACKWARD_AUTOTUNE_KEY = ["HEAD_DIM", "CAUSAL", "IS_VARLEN", "SEQ_BUCKET_Q", "SEQ_BUCKET_K"]
# Head dims above this get dK and dV in two passes of the dK/dV kernel (PART 1 and 2).
MAX_FUSED_DKDV_BLOCK_D = 128
# Rows per preprocess program: three fp32 [rows, BLOCK_D] tiles stay within the registers of four warps. Below
# Triton 3.9 (3.7.1: torch 2.13's CUDA pin) ptxas spills 8-16 B there at head dim 64 with an elementwise gate on
# sm_90; eight warps do not spill.
PREPROCESS_ELEMENTS = 4096
PREPROCESS_WARPS = 4 if TRITON_VERSION >= (3, 9) else 8


# --------------------------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------------------------


@triton.jit
def attend_keys(acc, l_i, m_i, q, k_ptr, v_ptr, k_strides, v_strides, lo, hi, rows, offs_n, offs_d, d_mask, k_len,
                diag, qk_scale, MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Online softmax over key blocks [lo, hi): updates the unnormalised output `acc [R, BLOCK_D]` (fp32), the row
    sums `l_i` and the row maxima `m_i` (base-2 units) of the query tile `q [R, BLOCK_D]`.

    `k_ptr`, `v_ptr` point at key row 0 of this (sequence, head). MASK: the blocks reach past `k_len` or cross the
    causal diagonal (`rows` are the tile's query rows within the sequence, `diag = k_len - q_len`); rows that have no
    visible key yet keep m = -inf and contribute nothing."""
    k_tile = offs_n[:, None] * k_strides[1] + offs_d[None, :] * k_strides[3]
    v_tile = offs_n[:, None] * v_strides[1] + offs_d[None, :] * v_strides[3]
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASK:
            kv_mask = (cols[:, None] < k_len) & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        start = tl.cast(start_n, tl.int64)
        k = tl.load(k_ptr + start * k_strides[1] + k_tile, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + start * v_strides[1] + v_tile, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [R, BLOCK_N], log2 units
        if MASK:
            visible = cols[None, :] < k_len
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + diag)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.heuristics(flag_heuristics(headwise=False))
@triton.autotune(configs=autotune_configs("forward"), key=FORWARD_AUTOTUNE_KEY,
                 prune_configs_by={"early_config_prune": prune_configs("forward")})
@triton.jit
def forward_kernel(
    Q, K, V, G, Out, Lse, cu_seqlens_q, cu_seqlens_k,
    q_strides, k_strides, v_strides, g_strides, out_strides, lse_strides,
    n_batch, seqlen_q, seqlen_k, group, qk_scale,
    SEQ_BUCKET_Q, SEQ_BUCKET_K,  # read by the autotuner only (its key)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_GATE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m, b, h = program_coords(n_batch, CAUSAL)
    q_start, q_len, k_start, k_len = sequence_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    hk = h // group
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows = m0 + offs_m
    row_mask = rows < q_len
    tile_mask = row_mask[:, None] & d_mask[None, :]
    first_row = q_start + m0
    q = tl.load(Q + row_offset(q_strides, b, first_row, h) + offs_m[:, None] * q_strides[1]
                + offs_d[None, :] * q_strides[3], mask=tile_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_ptr = K + row_offset(k_strides, b, k_start, hk)
    v_ptr = V + row_offset(v_strides, b, k_start, hk)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diag = k_len - q_len
    full_end, end = causal_key_range(m0, q_len, k_len, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = attend_keys(acc, l_i, m_i, q, k_ptr, v_ptr, k_strides, v_strides, 0, full_end, rows, offs_n,
                                offs_d, d_mask, k_len, diag, qk_scale, False, CAUSAL, UPCAST, BLOCK_N)
    acc, l_i, m_i = attend_keys(acc, l_i, m_i, q, k_ptr, v_ptr, k_strides, v_strides, full_end, end, rows, offs_n,
                                offs_d, d_mask, k_len, diag, qk_scale, True, CAUSAL, UPCAST, BLOCK_N)

    empty = l_i == 0.0  # rows with no visible key: output 0, lse = +inf so the backward gives them p = 0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc * reciprocal(l_safe)[:, None]
    if HAS_GATE:
        # A headwise gate has dim stride 0: the same 2-D load reads its one logit per row. (A 1-D load broadcast
        # afterwards took about 50 more registers on sm_80 and made tiles spill that fit with this one.)
        g = tl.load(G + row_offset(g_strides, b, first_row, h) + offs_m[:, None] * g_strides[1]
                    + offs_d[None, :] * g_strides[3], mask=tile_mask, other=0.0).to(tl.float32)
        o = o * sigmoid(g)
    tl.store(Out + row_offset(out_strides, b, first_row, h) + offs_m[:, None] * out_strides[1]
             + offs_d[None, :] * out_strides[3], o.to(Out.dtype.element_ty), mask=tile_mask)
    lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
    tl.store(Lse + lse_offset(lse_strides, b, first_row, h) + offs_m, lse, mask=row_mask)


def forward(q, k, v, gate, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Launch the forward on `q [B, S_q, Hq, D]` / `k, v [B, S_k, Hkv, D]` (or packed `[T, H, D]` with cu_seqlens),
    `gate [..., Hq, D or 1]` or None.

    Returns `(out like q, contiguous; lse [Hq, rows] fp32, base-2 units, +inf for rows that see no key)`."""
    packed = cu_seqlens_q is not None
    n_batch = cu_seqlens_q.numel() - 1 if packed else q.shape[0]
    seqlen_q, seqlen_k = (0, 0) if packed else (q.shape[1], k.shape[1])
    rows = q.shape[0] if packed else n_batch * seqlen_q
    h_q = q.shape[-2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((h_q, rows), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or max_seqlen_q == 0:
        return out, lse
    forward_kernel[lambda meta: grid_2d(triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), n_batch, h_q)](
        Q=q, K=k, V=v, G=gate, Out=out, Lse=lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        q_strides=strides4(q, packed), k_strides=strides4(k, packed), v_strides=strides4(v, packed),
        g_strides=strides4(gate, packed), out_strides=strides4(out, packed),
        lse_strides=lse_strides(lse, packed, seqlen_q),
        n_batch=n_batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, group=h_q // k.shape[-2], qk_scale=scale * LOG2E,
        SEQ_BUCKET_Q=seq_bucket(max_seqlen_q), SEQ_BUCKET_K=seq_bucket(max_seqlen_k),
        HEAD_DIM=q.shape[-1], CAUSAL=causal, enable_fp_fusion=FP_FUSION,
    )
    return out, lse


# --------------------------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------------------------


@triton.heuristics(flag_heuristics(upcast_from=None)
                   | {"BLOCK_M": lambda args: max(16, PREPROCESS_ELEMENTS // args["BLOCK_D"])})
@triton.jit
def preprocess_kernel(
    Out, DY, G, DA, Delta, DG, cu_seqlens_q,
    out_strides, dy_strides, g_strides, da_strides, dg_strides, lse_strides,
    n_batch, seqlen_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_GATE: tl.constexpr, GATE_HEADWISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Delta = rowsum(dY ⊙ out); with a gate also dA = dY ⊙ σ(G) and dG (never divides by σ(G))."""
    pid_m, b, h = program_coords(n_batch, False)
    q_start, q_len, _, _ = sequence_bounds(cu_seqlens_q, cu_seqlens_q, b, seqlen_q, seqlen_q, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    first_row = q_start + m0
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = m0 + offs_m < q_len
    mask = tile_mask(row_mask, offs_d, HEAD_DIM, BLOCK_D)
    o = tl.load(Out + row_offset(out_strides, b, first_row, h) + offs_m[:, None] * out_strides[1]
                + offs_d[None, :] * out_strides[3], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row_offset(dy_strides, b, first_row, h) + offs_m[:, None] * dy_strides[1]
                 + offs_d[None, :] * dy_strides[3], mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(dy * o, 1)
    tl.store(Delta + lse_offset(lse_strides, b, first_row, h) + offs_m, delta, mask=row_mask)
    if HAS_GATE:
        g_ptr = G + row_offset(g_strides, b, first_row, h)
        dg_ptr = DG + row_offset(dg_strides, b, first_row, h)
        if GATE_HEADWISE:
            g = tl.load(g_ptr + offs_m * g_strides[1], mask=row_mask, other=0.0).to(tl.float32)
            da = dy * sigmoid(g)[:, None]
            dg = sigmoid(-g) * delta
            tl.store(dg_ptr + offs_m * dg_strides[1], dg.to(DG.dtype.element_ty), mask=row_mask)
        else:
            g = tl.load(g_ptr + offs_m[:, None] * g_strides[1] + offs_d[None, :] * g_strides[3], mask=mask,
                        other=0.0).to(tl.float32)
            da = dy * sigmoid(g)
            dg = dy * o * sigmoid(-g)
            tl.store(dg_ptr + offs_m[:, None] * dg_strides[1] + offs_d[None, :] * dg_strides[3],
                     dg.to(DG.dtype.element_ty), mask=mask)
        tl.store(DA + row_offset(da_strides, b, first_row, h) + offs_m[:, None] * da_strides[1]
                 + offs_d[None, :] * da_strides[3], da.to(DA.dtype.element_ty), mask=mask)


@triton.heuristics(flag_heuristics(gate=None))
@triton.autotune(configs=autotune_configs("backward_dkdv"), key=BACKWARD_AUTOTUNE_KEY + ["PART"],
                 prune_configs_by={"early_config_prune": prune_configs("backward_dkdv")})
@triton.jit
def dkdv_kernel(
    Q, K, V, DA, Lse, Delta, DK, DV, cu_seqlens_q, cu_seqlens_k,
    q_strides, k_strides, v_strides, da_strides, dk_strides, dv_strides, lse_strides,
    n_batch, seqlen_q, seqlen_k, group, qk_scale, sm_scale,
    SEQ_BUCKET_Q, SEQ_BUCKET_K,  # read by the autotuner only (its key)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PART: tl.constexpr,
    BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (key block, sequence, key/value head): loops over the group's query heads.

    PART: 0 computes dK and dV; 1 only dK, 2 only dV (a 256-wide head dim launches both: one fp32 accumulator per
    pass fits the registers, two do not)."""
    pid_n, b, hk = program_coords(n_batch, False)
    q_start, q_len, k_start, k_len = sequence_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= k_len:
        return
    first_key = k_start + n0
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    cols = n0 + offs_n
    kv_mask = tile_mask(cols < k_len, offs_d, HEAD_DIM, BLOCK_D)
    k = tl.load(K + row_offset(k_strides, b, first_key, hk) + offs_n[:, None] * k_strides[1]
                + offs_d[None, :] * k_strides[3], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    if PART != 2:
        v = tl.load(V + row_offset(v_strides, b, first_key, hk) + offs_n[:, None] * v_strides[1]
                    + offs_d[None, :] * v_strides[3], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if PART != 1:
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # One flat loop over (query head of the group, query block): nested loops would keep a second set of pipeline
    # state live and push the tile past the register file. Under a causal mask the blocks start at the first query
    # row that sees a key of this block (query row i sees key j iff j <= i + k_len - q_len).
    diag = k_len - q_len
    lo = tl.maximum(n0 - diag, 0) // BLOCK_M * BLOCK_M if CAUSAL else 0
    steps = tl.cdiv(tl.maximum(q_len - lo, 0), BLOCK_M)
    q_tile = offs_m[:, None] * q_strides[1] + offs_d[None, :] * q_strides[3]
    da_tile = offs_m[:, None] * da_strides[1] + offs_d[None, :] * da_strides[3]
    for i in range(0, group * steps):
        h = hk * group + i // steps
        start_m = lo + (i % steps) * BLOCK_M
        rows = start_m + offs_m
        row_mask = rows < q_len
        mask = tile_mask(row_mask, offs_d, HEAD_DIM, BLOCK_D)
        first_row = q_start + start_m
        q = tl.load(Q + row_offset(q_strides, b, first_row, h) + q_tile, mask=mask, other=0.0)
        da = tl.load(DA + row_offset(da_strides, b, first_row, h) + da_tile, mask=mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            da = da.to(tl.float32)
        # Rows past the end (and rows that saw no key) carry lse = +inf, hence p = 0.
        lse = tl.load(Lse + lse_offset(lse_strides, b, first_row, h) + offs_m, mask=row_mask, other=float("inf"))
        p_t = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])  # [BLOCK_N, BLOCK_M]
        if CAUSAL:
            p_t = tl.where(cols[:, None] <= rows[None, :] + diag, p_t, 0.0)
        if PART != 1:
            dv += tl.dot(p_t.to(da.dtype), da)
        if PART != 2:
            delta = tl.load(Delta + lse_offset(lse_strides, b, first_row, h) + offs_m, mask=row_mask, other=0.0)
            ds_t = p_t * (tl.dot(v, tl.trans(da)) - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q)
    if PART != 2:
        tl.store(DK + row_offset(dk_strides, b, first_key, hk) + offs_n[:, None] * dk_strides[1]
                 + offs_d[None, :] * dk_strides[3], (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    if PART != 1:
        tl.store(DV + row_offset(dv_strides, b, first_key, hk) + offs_n[:, None] * dv_strides[1]
                 + offs_d[None, :] * dv_strides[3], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _accumulate_dq(dq, q, da, lse, delta, k_ptr, v_ptr, k_strides, v_strides, lo, hi, rows, offs_n, offs_d, d_mask,
                   k_len, diag, qk_scale, MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Add the contributions of key blocks [lo, hi) to `dq [BLOCK_M, BLOCK_D]` of the query tile `q`."""
    k_tile = offs_n[:, None] * k_strides[1] + offs_d[None, :] * k_strides[3]
    v_tile = offs_n[:, None] * v_strides[1] + offs_d[None, :] * v_strides[3]
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASK:
            kv_mask = (cols[:, None] < k_len) & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        start = tl.cast(start_n, tl.int64)
        k = tl.load(k_ptr + start * k_strides[1] + k_tile, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + start * v_strides[1] + v_tile, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        if MASK:
            visible = cols[None, :] < k_len
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + diag)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(da, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.heuristics(flag_heuristics(gate=None))
@triton.autotune(configs=autotune_configs("backward_dq"), key=BACKWARD_AUTOTUNE_KEY,
                 prune_configs_by={"early_config_prune": prune_configs("backward_dq")})
@triton.jit
def dq_kernel(
    Q, K, V, DA, Lse, Delta, DQ, cu_seqlens_q, cu_seqlens_k,
    q_strides, k_strides, v_strides, da_strides, dq_strides, lse_strides,
    n_batch, seqlen_q, seqlen_k, group, qk_scale, sm_scale,
    SEQ_BUCKET_Q, SEQ_BUCKET_K,  # read by the autotuner only (its key)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (query block, sequence, query head)."""
    pid_m, b, h = program_coords(n_batch, CAUSAL)
    q_start, q_len, k_start, k_len = sequence_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    hk = h // group
    first_row = q_start + m0
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows = m0 + offs_m
    row_mask = rows < q_len
    tile_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + row_offset(q_strides, b, first_row, h) + offs_m[:, None] * q_strides[1]
                + offs_d[None, :] * q_strides[3], mask=tile_mask, other=0.0)
    da = tl.load(DA + row_offset(da_strides, b, first_row, h) + offs_m[:, None] * da_strides[1]
                 + offs_d[None, :] * da_strides[3], mask=tile_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        da = da.to(tl.float32)
    lse = tl.load(Lse + lse_offset(lse_strides, b, first_row, h) + offs_m, mask=row_mask, other=float("inf"))
    delta = tl.load(Delta + lse_offset(lse_strides, b, first_row, h) + offs_m, mask=row_mask, other=0.0)
    k_ptr = K + row_offset(k_strides, b, k_start, hk)
    v_ptr = V + row_offset(v_strides, b, k_start, hk)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diag = k_len - q_len
    full_end, end = causal_key_range(m0, q_len, k_len, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _accumulate_dq(dq, q, da, lse, delta, k_ptr, v_ptr, k_strides, v_strides, 0, full_end, rows, offs_n, offs_d,
                        d_mask, k_len, diag, qk_scale, False, CAUSAL, UPCAST, BLOCK_N)
    dq = _accumulate_dq(dq, q, da, lse, delta, k_ptr, v_ptr, k_strides, v_strides, full_end, end, rows, offs_n,
                        offs_d, d_mask, k_len, diag, qk_scale, True, CAUSAL, UPCAST, BLOCK_N)
    dq = dq * sm_scale
    tl.store(DQ + row_offset(dq_strides, b, first_row, h) + offs_m[:, None] * dq_strides[1]
             + offs_d[None, :] * dq_strides[3], dq.to(DQ.dtype.element_ty), mask=tile_mask)


def backward(dy, q, k, v, gate, out, lse, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Launch the backward of `forward` (same shapes; `dy` like `out`, any strides).

    Returns `(dq, dk, dv, dgate or None)`, each contiguous and shaped like its input."""
    packed = cu_seqlens_q is not None
    n_batch = cu_seqlens_q.numel() - 1 if packed else q.shape[0]
    seqlen_q, seqlen_k = (0, 0) if packed else (q.shape[1], k.shape[1])
    h_q, h_kv, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # zeros: rows of empty sequences are never visited
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    dgate = None if gate is None else torch.zeros(gate.shape, dtype=gate.dtype, device=gate.device)
    if q.numel() == 0 or k.numel() == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return dq, dk, dv, dgate
    delta = torch.empty_like(lse)
    # Without a gate dA is dY itself, read through its own strides.
    da = dy if gate is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse_layout = lse_strides(lse, packed, seqlen_q)
    preprocess_kernel[lambda meta: grid_2d(triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), n_batch, h_q)](
        Out=out, DY=dy, G=gate, DA=da, Delta=delta, DG=dgate, cu_seqlens_q=cu_seqlens_q,
        out_strides=strides4(out, packed), dy_strides=strides4(dy, packed), g_strides=strides4(gate, packed),
        da_strides=strides4(da, packed), dg_strides=strides4(dgate, packed), lse_strides=lse_layout,
        n_batch=n_batch, seqlen_q=seqlen_q, HEAD_DIM=head_dim, num_warps=PREPROCESS_WARPS,
        enable_fp_fusion=FP_FUSION,
    )
    shared = dict(
        Q=q, K=k, V=v, DA=da, Lse=lse, Delta=delta, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        q_strides=strides4(q, packed), k_strides=strides4(k, packed), v_strides=strides4(v, packed),
        da_strides=strides4(da, packed), lse_strides=lse_layout,
        n_batch=n_batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, group=h_q // h_kv, qk_scale=scale * LOG2E,
        sm_scale=scale, SEQ_BUCKET_Q=seq_bucket(max_seqlen_q), SEQ_BUCKET_K=seq_bucket(max_seqlen_k),
        HEAD_DIM=head_dim, CAUSAL=causal, enable_fp_fusion=FP_FUSION,
    )
    block_d = max(16, triton.next_power_of_2(head_dim))
    for part in (0,) if block_d <= MAX_FUSED_DKDV_BLOCK_D else (1, 2):
        dkdv_kernel[lambda meta: grid_2d(triton.cdiv(max_seqlen_k, meta["BLOCK_N"]), n_batch, h_kv)](
            DK=dk, DV=dv, dk_strides=strides4(dk, packed), dv_strides=strides4(dv, packed), PART=part, **shared)
    dq_kernel[lambda meta: grid_2d(triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), n_batch, h_q)](
        DQ=dq, dq_strides=strides4(dq, packed), **shared)
    return dq, dk, dv, dgate


# --------------------------------------------------------------------------------------------------------------------
# Custom op (torch.compile traces the fake implementations) and autograd
# --------------------------------------------------------------------------------------------------------------------

# The top-level package this copy of the kernel is imported as: "gated_qwen" for the package's, the Hub kernel's own
# module name (its metadata id, e.g. "_gated_qwen_kernel_<hash>") for a copy loaded by `kernels`, so that the two
# copies in one process register separate ops and each runs its own code.
_OP_NAMESPACE = __name__.split(".")[0]


def _define_ops():
    """Register the custom ops once per process.

    Folders saved by gated_qwen 0.1 ship a copy of the kernel that registers the same ops (same names, same
    schema) when loaded as remote code; whichever is imported second reuses the ops of the first.
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
# Entry point
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
    check_inputs(q, k, v, gate, cu_seqlens_q, cu_seqlens_k, check_device=True)
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
