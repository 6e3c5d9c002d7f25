"""Decode kernels of fused gated attention: one query per sequence against a (long) key/value cache, split over the
keys.

`split_kernel` gives one program a GQA group's query heads (as tile rows, so one key/value tile serves the whole
group) and one chunk of the keys; it writes the chunk's normalised output and base-2 logsumexp. `combine_kernel`
merges the chunks of a (sequence, query head) with weights exp2(lse_chunk − max lse), which stays exact for any
cache length (every weight is ≤ 1 and the largest is 1), applies the gate and writes the output and the logsumexp the
backward needs. A single query row sees every key under bottom-right causal alignment, so only length masks apply.
Imported only where Triton is installed.
"""

import functools

import torch

from .inputs import flag_heuristics
from .jit_helpers import lse_offset, program_coords, reciprocal, row_offset, sequence_bounds, sigmoid
from .launch import FP_FUSION, INTERPRET, LOG2E, grid_2d, lse_strides, strides4, tl, triton

MAX_SPLITS = 128


@triton.heuristics(flag_heuristics(gate=None)
                   | {"BLOCK_H": lambda args: max(16, triton.next_power_of_2(args["group"]))})
@triton.jit
def split_kernel(
    Q, K, V, PartO, PartLse, cu_seqlens_q, cu_seqlens_k,
    q_strides, k_strides, v_strides,
    n_batch, seqlen_q, seqlen_k, group, chunk, qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, UPCAST: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (split, sequence b, key/value head hk): query heads hk·group + [0, group) against the keys
    [split · chunk, (split + 1) · chunk). Writes `PartO[split, b, hq, :]` (fp32, normalised) and `PartLse[split, b,
    hq]` (-inf when the chunk is empty).

    The tiles are transposed (keys and head dims in the rows, the group's heads in the columns): the few query heads
    of a group would be too few rows for Hopper's wgmma (64 per warpgroup), BLOCK_N keys and BLOCK_D dims are not."""
    split, b, hk = program_coords(n_batch, False)
    q_start, q_len, k_start, k_len = sequence_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, IS_VARLEN)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    h_mask = offs_h < group * q_len  # q_len is 0 or 1 on this path
    q_t = tl.load(Q + row_offset(q_strides, b, q_start, hk * group) + offs_d[:, None] * q_strides[3]
                  + offs_h[None, :] * q_strides[2], mask=d_mask[:, None] & h_mask[None, :], other=0.0)
    if UPCAST:
        q_t = q_t.to(tl.float32)
    k_ptr = K + row_offset(k_strides, b, k_start, hk)
    v_ptr = V + row_offset(v_strides, b, k_start, hk)
    k_tile = offs_n[:, None] * k_strides[1] + offs_d[None, :] * k_strides[3]  # [BLOCK_N, BLOCK_D]
    v_tile_t = offs_d[:, None] * v_strides[3] + offs_n[None, :] * v_strides[1]  # [BLOCK_D, BLOCK_N]
    lo = split * chunk
    hi = tl.minimum(lo + chunk, k_len)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_D, BLOCK_H], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        key_mask = start_n + offs_n < hi
        start = tl.cast(start_n, tl.int64)
        k = tl.load(k_ptr + start * k_strides[1] + k_tile, mask=key_mask[:, None] & d_mask[None, :], other=0.0)
        v_t = tl.load(v_ptr + start * v_strides[1] + v_tile_t, mask=d_mask[:, None] & key_mask[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v_t = v_t.to(tl.float32)
        s_t = tl.where(key_mask[:, None], tl.dot(k, q_t) * qk_scale, float("-inf"))  # [BLOCK_N, BLOCK_H], log2
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p_t = tl.exp2(s_t - m_use[None, :])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p_t, 0)
        acc_t = acc_t * alpha[None, :] + tl.dot(v_t, p_t.to(v_t.dtype))
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o_t = acc_t * reciprocal(l_safe)[None, :]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    part = (split * n_batch + b.to(tl.int64)) * (tl.num_programs(1) * group) + hk * group + offs_h  # [split, b, hq]
    tl.store(PartO + part[None, :] * HEAD_DIM + offs_d[:, None], o_t, mask=d_mask[:, None] & h_mask[None, :])
    tl.store(PartLse + part, lse, mask=h_mask)


@triton.heuristics(flag_heuristics(upcast_from=None)
                   | {"BLOCK_S": lambda args: max(2, triton.next_power_of_2(args["num_splits"]))})
@triton.jit
def combine_kernel(
    PartO, PartLse, G, Out, Lse, cu_seqlens_q,
    g_strides, out_strides, lse_strides,
    n_batch, seqlen_q, num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_GATE: tl.constexpr, GATE_HEADWISE: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Program (sequence b, query head h): merge the chunks, apply the gate, store the output and the logsumexp."""
    _, b, h = program_coords(n_batch, False)
    q_start, q_len, _, _ = sequence_bounds(cu_seqlens_q, cu_seqlens_q, b, seqlen_q, seqlen_q, IS_VARLEN)
    if q_len == 0:
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    s_mask = offs_s < num_splits
    part = (offs_s * n_batch + b.to(tl.int64)) * tl.num_programs(1) + h
    part_lse = tl.load(PartLse + part, mask=s_mask, other=float("-inf"))
    m = tl.max(part_lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(part_lse - m_use)
    l_sum = tl.sum(w, 0)
    part_o = tl.load(PartO + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                     other=0.0)
    empty = l_sum == 0.0
    l_safe = tl.where(empty, 1.0, l_sum)
    o = tl.sum(part_o * w[:, None], 0) * reciprocal(l_safe)
    if HAS_GATE:
        g_ptr = G + row_offset(g_strides, b, q_start, h)
        if GATE_HEADWISE:
            o = o * sigmoid(tl.load(g_ptr).to(tl.float32))
        else:
            o = o * sigmoid(tl.load(g_ptr + offs_d * g_strides[3], mask=d_mask, other=0.0).to(tl.float32))
    tl.store(Out + row_offset(out_strides, b, q_start, h) + offs_d * out_strides[3], o.to(Out.dtype.element_ty),
             mask=d_mask)
    tl.store(Lse + lse_offset(lse_strides, b, q_start, h), tl.where(empty, float("inf"), m_use + tl.log2(l_safe)))


def decode_block_n(head_dim: int) -> int:
    """Keys per step of the split kernel (one fixed tile: decode is bandwidth-bound, its shape does not need tuning)."""
    if INTERPRET:
        return 64
    return 128 if head_dim <= 128 else 64


@functools.lru_cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits(q: torch.Tensor, n_batch: int, h_kv: int, max_seqlen_k: int, block_n: int) -> int:
    """Split the keys until the grid fills the GPU about twice (at least one key block per split)."""
    n_blocks = max(1, triton.cdiv(max_seqlen_k, block_n))
    if q.is_cuda:
        target = triton.cdiv(2 * _multiprocessors(q.device.index or 0), max(1, n_batch * h_kv))
    else:
        target = 4  # the interpreter: small, but enough to exercise the merge of several chunks in tests
    return int(max(1, min(n_blocks, target, MAX_SPLITS)))


def decode_forward(q, k, v, gate, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_k):
    """`forward` for one query per sequence (`q [B, 1, Hq, D]`, or packed with every sequence holding at most one
    query): same arguments and results (out like q; lse `[Hq, rows]`, +inf where a sequence has no key)."""
    packed = cu_seqlens_q is not None
    n_batch = cu_seqlens_q.numel() - 1 if packed else q.shape[0]
    seqlen_q, seqlen_k = (0, 0) if packed else (q.shape[1], k.shape[1])
    rows = q.shape[0] if packed else n_batch * seqlen_q
    h_q, h_kv, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((h_q, rows), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or n_batch == 0:
        return out, lse
    block_n = decode_block_n(head_dim)
    splits = num_splits(q, n_batch, h_kv, max_seqlen_k, block_n)
    chunk = triton.cdiv(triton.cdiv(max(max_seqlen_k, 1), splits), block_n) * block_n
    part_o = torch.empty((splits, n_batch, h_q, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((splits, n_batch, h_q), dtype=torch.float32, device=q.device)
    split_kernel[grid_2d(splits, n_batch, h_kv)](
        Q=q, K=k, V=v, PartO=part_o, PartLse=part_lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        q_strides=strides4(q, packed), k_strides=strides4(k, packed), v_strides=strides4(v, packed),
        n_batch=n_batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, group=h_q // h_kv, chunk=chunk,
        qk_scale=scale * LOG2E, HEAD_DIM=head_dim, BLOCK_N=block_n, num_warps=4, num_stages=2,
        enable_fp_fusion=FP_FUSION,
    )
    combine_kernel[grid_2d(1, n_batch, h_q)](
        PartO=part_o, PartLse=part_lse, G=gate, Out=out, Lse=lse, cu_seqlens_q=cu_seqlens_q,
        g_strides=strides4(gate, packed), out_strides=strides4(out, packed),
        lse_strides=lse_strides(lse, packed, seqlen_q),
        n_batch=n_batch, seqlen_q=seqlen_q, num_splits=splits, HEAD_DIM=head_dim, num_warps=4,
        enable_fp_fusion=FP_FUSION,
    )
    return out, lse
