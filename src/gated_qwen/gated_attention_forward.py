"""Forward kernel of fused gated attention: `out = softmax(q kᵀ · scale + mask) v ⊙ sigmoid(gate)` and the
logsumexp the backward needs, one program per (query block, sequence, query head).

The gate multiplies the fp32 accumulator in the epilogue, so the ungated attention output never reaches memory.
Grouped-query attention of any ratio reads the key/value head `h // group`. Imported only where Triton is installed.
"""

import torch

from .gated_attention_common import (
    LOG2E,
    autotune_configs,
    flag_heuristics,
    grid_2d,
    lse_strides,
    prune_configs,
    seq_bucket,
    strides4,
    tl,
    triton,
)
from .gated_attention_prologue import (
    causal_key_range,
    lse_offset,
    program_coords,
    reciprocal,
    row_offset,
    sequence_bounds,
    sigmoid,
)

# The tuner runs once per head dim, mask, layout, gate or none, dtype and sequence-length class (SEQ_BUCKET_*).
AUTOTUNE_KEY = ["HEAD_DIM", "CAUSAL", "IS_VARLEN", "HAS_GATE", "SEQ_BUCKET_Q", "SEQ_BUCKET_K"]


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
@triton.autotune(configs=autotune_configs("forward"), key=AUTOTUNE_KEY,
                 prune_configs_by={"early_config_prune": prune_configs("forward")})
@triton.jit
def gated_attention_forward_kernel(
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
    gated_attention_forward_kernel[lambda meta: grid_2d(triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), n_batch, h_q)](
        Q=q, K=k, V=v, G=gate, Out=out, Lse=lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        q_strides=strides4(q, packed), k_strides=strides4(k, packed), v_strides=strides4(v, packed),
        g_strides=strides4(gate, packed), out_strides=strides4(out, packed),
        lse_strides=lse_strides(lse, packed, seqlen_q),
        n_batch=n_batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, group=h_q // k.shape[-2], qk_scale=scale * LOG2E,
        SEQ_BUCKET_Q=seq_bucket(max_seqlen_q), SEQ_BUCKET_K=seq_bucket(max_seqlen_k),
        HEAD_DIM=q.shape[-1], CAUSAL=causal,
    )
    return out, lse
