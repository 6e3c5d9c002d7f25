"""Backward kernels of fused gated attention, division-free: the ungated output is never recovered as
`out / sigmoid(gate)`.

With A = softmax(q kᵀ · scale + mask) v, s = σ(G), out = A ⊙ s and the incoming gradient dY:

    dA = dY ⊙ s,   Delta = rowsum(dA ⊙ A) = rowsum(dY ⊙ out),
    dG = dY ⊙ out ⊙ σ(−G) (elementwise) or σ(−G) · Delta (headwise)

`preprocess_kernel` computes Delta, dA and dG in one pass; `dkdv_kernel` (one program per key block and key/value
head, looping over the group's query heads: no atomics, so the backward is deterministic) and `dq_kernel` (one
program per query block and query head) then consume dA where plain attention consumes dY.
Imported only where Triton is installed.
"""

import torch

from .gated_attention_common import (
    LOG2E,
    TRITON_VERSION,
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
    row_offset,
    sequence_bounds,
    sigmoid,
    tile_mask,
)

AUTOTUNE_KEY = ["HEAD_DIM", "CAUSAL", "IS_VARLEN", "SEQ_BUCKET_Q", "SEQ_BUCKET_K"]
# Head dims above this get dK and dV in two passes of the dK/dV kernel (PART 1 and 2).
MAX_FUSED_DKDV_BLOCK_D = 128
# Rows per preprocess program: three fp32 [rows, BLOCK_D] tiles stay within the registers of four warps. Below
# Triton 3.9 (3.7.1: torch 2.13's CUDA pin) ptxas spills 8-16 B there at head dim 64 with an elementwise gate on
# sm_90; eight warps do not spill.
PREPROCESS_ELEMENTS = 4096
PREPROCESS_WARPS = 4 if TRITON_VERSION >= (3, 9) else 8


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
@triton.autotune(configs=autotune_configs("backward_dkdv"), key=AUTOTUNE_KEY + ["PART"],
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
@triton.autotune(configs=autotune_configs("backward_dq"), key=AUTOTUNE_KEY,
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
    )
    shared = dict(
        Q=q, K=k, V=v, DA=da, Lse=lse, Delta=delta, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        q_strides=strides4(q, packed), k_strides=strides4(k, packed), v_strides=strides4(v, packed),
        da_strides=strides4(da, packed), lse_strides=lse_layout,
        n_batch=n_batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, group=h_q // h_kv, qk_scale=scale * LOG2E,
        sm_scale=scale, SEQ_BUCKET_Q=seq_bucket(max_seqlen_q), SEQ_BUCKET_K=seq_bucket(max_seqlen_k),
        HEAD_DIM=head_dim, CAUSAL=causal,
    )
    block_d = max(16, triton.next_power_of_2(head_dim))
    for part in (0,) if block_d <= MAX_FUSED_DKDV_BLOCK_D else (1, 2):
        dkdv_kernel[lambda meta: grid_2d(triton.cdiv(max_seqlen_k, meta["BLOCK_N"]), n_batch, h_kv)](
            DK=dk, DV=dv, dk_strides=strides4(dk, packed), dv_strides=strides4(dv, packed), PART=part, **shared)
    dq_kernel[lambda meta: grid_2d(triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), n_batch, h_q)](
        DQ=dq, dq_strides=strides4(dq, packed), **shared)
    return dq, dk, dv, dgate
