"""Plain PyTorch reference for gated attention: the specification the fused Triton kernel is tested against.

`out = softmax(q kᵀ · scale + mask) v ⊙ sigmoid(gate)` per query head, with grouped-query attention (a key/value head
serves `Hq // Hkv` consecutive query heads), an optional causal mask aligned bottom-right (query row `i` of a sequence
with `S_q` queries and `S_k` keys sees keys `j <= i + S_k - S_q`), and packed variable-length batches described by
`cu_seqlens` offsets (the FlashAttention varlen convention). A query row that sees no key outputs zeros and receives
zero gradients.

Same signature as `gated_attention` (`parallel.py`); slow (materialises the score matrix), differentiable
with ordinary autograd, computed in fp32 (fp64 when the inputs are fp64) and returned in the dtype of `q`.
This module imports nothing but torch.
"""

import math

import torch


def naive_gated_attention(
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
    """Gated scaled-dot-product attention, reference implementation.

    Args:
        q: `[B, S_q, Hq, D]`, or `[T_q, Hq, D]` packed when `cu_seqlens_q` is given.
        k: `[B, S_k, Hkv, D]`, or `[T_k, Hkv, D]` packed; `Hq` must be a multiple of `Hkv` (GQA, not expanded).
        v: same shape as `k`.
        gate: pre-activation gate logits, `[..., Hq, D]` (elementwise) or `[..., Hq, 1]` (headwise) with the leading
            dims of `q`; any strides. `None` means no gate.
        causal: causal mask, aligned bottom-right when `S_q != S_k`.
        scale: softmax scale, default `1 / sqrt(D)`.
        cu_seqlens_q, cu_seqlens_k: int32 `[N + 1]` offsets of the N packed sequences (both or neither).
        max_seqlen_q, max_seqlen_k: accepted for signature parity with the kernel; unused here.

    Returns:
        `[B, S_q, Hq, D]` (or `[T_q, Hq, D]`), dtype of `q`.
    """
    del max_seqlen_q, max_seqlen_k  # the reference loops over sequences and needs no bound
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (both packed) or not at all")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if cu_seqlens_q is None:
        return _attend(q, k, v, gate, causal, scale)
    starts_q = cu_seqlens_q.tolist()
    starts_k = cu_seqlens_k.tolist()
    pieces = []
    for i in range(len(starts_q) - 1):
        sq = slice(starts_q[i], starts_q[i + 1])
        sk = slice(starts_k[i], starts_k[i + 1])
        g = None if gate is None else gate[sq][None]
        pieces.append(_attend(q[sq][None], k[sk][None], v[sk][None], g, causal, scale)[0])
    return torch.cat(pieces, dim=0) if pieces else q.new_zeros(q.shape)


def _attend(q, k, v, gate, causal, scale):
    """One dense batch: q `[B, S_q, Hq, D]`, k/v `[B, S_k, Hkv, D]`, gate `[B, S_q, Hq, D or 1]` or None."""
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    _batch, s_q, h_q, _ = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    group = h_q // h_kv
    qf = q.to(compute_dtype).transpose(1, 2)  # [B, Hq, S_q, D]
    kf = k.to(compute_dtype).transpose(1, 2).repeat_interleave(group, dim=1)  # [B, Hq, S_k, D]
    vf = v.to(compute_dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, Hq, S_q, S_k]
    visible = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    if causal:
        rows = torch.arange(s_q, device=q.device)[:, None]
        cols = torch.arange(s_k, device=q.device)[None, :]
        visible = cols <= rows + (s_k - s_q)
    # A finite fill keeps fully masked rows free of NaN; multiplying by the mask then zeroes their output and gradient.
    scores = scores.masked_fill(~visible, torch.finfo(compute_dtype).min)
    probs = torch.softmax(scores, dim=-1) * visible
    out = torch.matmul(probs, vf).transpose(1, 2)  # [B, S_q, Hq, D]
    if gate is not None:
        # sigmoid written as exp(logsigmoid): same value, but autograd then computes the derivative as σ(g)·σ(−g)
        # instead of σ(g)·(1 − σ(g)), which is exactly 0 once σ(g) rounds to 1 (g ≳ 17 in fp32, ≳ 37 in fp64).
        out = out * torch.exp(torch.nn.functional.logsigmoid(gate.to(compute_dtype)))
    return out.to(q.dtype)
