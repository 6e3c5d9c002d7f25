"""`@triton.jit` helpers shared by the gated-attention kernels: which (block, sequence, head) a program owns, where
its sequence starts and ends, 64-bit addressing, the reciprocal and the sigmoid, the causal key range.

Addressing: every scalar offset of a (sequence, head, first row) is computed in int64 (`row_offset`), so tensors
with more than 2**31 elements (B=8, S=32k, H=32, D=128 in a [B, H, S, D] layout, or a long packed batch) address
correctly; offsets inside a tile stay int32. Imported only where Triton is installed.
"""

from .launch import HAS_APPROX_FDIV, tl, triton

APPROX_FDIV = tl.constexpr(HAS_APPROX_FDIV)


@triton.jit
def program_coords(n_batch, REVERSE: tl.constexpr):
    """Grid `(blocks × n_batch, heads)` -> (block index within the sequence, sequence index, head index).

    Blocks of one (sequence, head) are neighbours on axis 0, so concurrent programs share its keys and values in L2;
    axis 0 holds up to 2**31 - 1 programs and axis 1 only the heads. REVERSE starts from the last block (under a causal
    mask the last query blocks have the most keys, so they start first)."""
    per_sequence = tl.num_programs(0) // n_batch
    pid = tl.program_id(0)
    block = pid % per_sequence
    if REVERSE:
        block = per_sequence - 1 - block
    return block, pid // per_sequence, tl.program_id(1)


@triton.jit
def sequence_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(first query row int64, query count, first key row int64, key count) of sequence `b`: from the cu_seqlens
    offsets of a packed batch, or (0, seqlen_q, 0, seqlen_k) for a dense one (rows then start at b · batch stride)."""
    if IS_VARLEN:
        q_start = tl.load(cu_seqlens_q + b)
        q_len = tl.load(cu_seqlens_q + b + 1) - q_start
        k_start = tl.load(cu_seqlens_k + b)
        k_len = tl.load(cu_seqlens_k + b + 1) - k_start
    else:
        q_start = b * 0
        q_len = seqlen_q
        k_start = b * 0
        k_len = seqlen_k
    return q_start.to(tl.int64), q_len, k_start.to(tl.int64), k_len


@triton.jit
def row_offset(strides, b, row, h):
    """int64 element offset of `row` (int64) of sequence `b`, head `h`, in a tensor with `(batch, row, head, dim)`
    strides."""
    return b.to(tl.int64) * strides[0] + row * strides[1] + h.to(tl.int64) * strides[2]


@triton.jit
def lse_offset(lse_strides, b, row, h):
    """int64 offset of (sequence `b`, `row` int64, head `h`) in a logsumexp `[Hq, rows]` with `(head, batch)`
    strides."""
    return h.to(tl.int64) * lse_strides[0] + b.to(tl.int64) * lse_strides[1] + row


@triton.jit
def tile_mask(row_mask, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """`[rows, BLOCK_D]` load/store mask from a row mask: the head dims need a mask only when BLOCK_D pads HEAD_DIM
    (a row-only mask keeps the loads vectorised and costs no registers per element)."""
    if HEAD_DIM == BLOCK_D:
        mask = row_mask[:, None]
    else:
        mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    return mask


@triton.jit
def reciprocal(x):
    """1 / x in fp32 within 2 ulp: div.approx on Triton >= 3.9, div.full on Triton 3.7 (no `approx` there). IEEE
    division would add a slow-path subroutine whose call frame ptxas reports as spilled registers."""
    if APPROX_FDIV:
        r = tl.math.fdiv(1.0, x, approx=True)
    else:
        r = tl.math.fdiv(1.0, x)
    return r


@triton.jit
def sigmoid(x):
    # exp(-x) overflows to inf for x < -88 and the reciprocal then gives exactly 0: no NaN at any logit.
    return reciprocal(1.0 + tl.exp(-x))


@triton.jit
def causal_key_range(m0, q_len, k_len, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys seen by query rows [m0, m0 + BLOCK_M): blocks in [0, full_end) need no mask, [full_end, end) do.

    Causal alignment is bottom-right: row i of a sequence with q_len queries and k_len keys sees key j iff
    j <= i + k_len - q_len."""
    if CAUSAL:
        diag = k_len - q_len
        end = tl.minimum(k_len, m0 + BLOCK_M + diag)
        full_end = tl.minimum(k_len, m0 + 1 + diag)
    else:
        end = k_len
        full_end = k_len
    end = tl.maximum(end, 0)
    full_end = tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N
    return full_end, end
