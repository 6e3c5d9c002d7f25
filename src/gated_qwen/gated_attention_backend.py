"""The attention backend `attn_implementation="gated_triton"`: the adapter between Transformers and the fused Triton
kernel (`gated_attention.py`, which knows nothing about Transformers).

The kernel applies the G1 sigmoid gate to its fp32 accumulator, so the attention module hands it the gate logits
(this backend is one of `gating.FUSED_GATE_BACKENDS`) instead of multiplying afterwards. Masks are FlashAttention-style (a 2-D
padding mask or None); padding, DataCollatorWithFlattening's `cu_seq_lens_*` and packed `position_ids` become the
kernel's varlen layout.

The kernel is trusted only after it has checked itself. `GATED_QWEN_KERNEL` chooses:
  check (default)  the first call of each (device, dtype, head dim, gate kind, causal, layout) combination runs the
                   kernel on a small problem against the PyTorch reference, forward and backward
                   (`gated_attention_selfcheck.py`); a combination that fails uses SDPA + a separate sigmoid gate,
                   with one warning saying what failed and how to report it;
  trust            the kernel without the check;
  off              never the kernel: SDPA + a separate sigmoid gate.
Where the kernel cannot run at all (no Triton; CPU tensors without TRITON_INTERPRET; fp32 on a GPU) the same SDPA
path is used, with one warning giving the reason. Under `torch.compile` no check runs: a combination checked by an
earlier eager call keeps its verdict, an unchecked one uses the kernel; packed sequences must arrive as
`cu_seq_lens_*` there (restarting `position_ids` are found only in eager mode).

Importing this module registers the backend. It is copied to the Hugging Face Hub beside `modeling_gated.py`:
relative imports only.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.modeling_utils import AttentionInterface
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, logging

from .gated_attention import gated_attention, gated_attention_unsupported_reason, triton_available
from .gated_attention_selfcheck import Combination, combination_of, self_check
from .gating import FUSED_GATE_BACKENDS

logger = logging.get_logger(__name__)

KERNEL_MODE_VARIABLE = "GATED_QWEN_KERNEL"
KERNEL_MODES = ("check", "trust", "off")
# Self-check verdicts of this process: None = passed, else what failed.
SELF_CHECK_VERDICTS: dict[Combination, str | None] = {}


def kernel_mode() -> str:
    """`GATED_QWEN_KERNEL` (check | trust | off; default check)."""
    mode = os.environ.get(KERNEL_MODE_VARIABLE, "check").strip().lower() or "check"
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNEL_MODE_VARIABLE}={mode!r} is not one of {', '.join(KERNEL_MODES)}")
    return mode


def _kernel_verdict(combo: Combination) -> str | None:
    """None when the kernel may run this combination, else why not (warned once per combination)."""
    mode = kernel_mode()
    if mode == "off":
        return f"{KERNEL_MODE_VARIABLE}=off"
    if mode == "trust":
        return None
    if combo not in SELF_CHECK_VERDICTS:
        if torch.compiler.is_compiling():
            return None  # a check cannot run while tracing; an earlier eager call would have run it
        SELF_CHECK_VERDICTS[combo] = failure = self_check(combo)
        if failure is not None:
            logger.warning(
                f"gated_triton: the fused Triton kernel failed its self-check for ({combo.describe()}): {failure}. "
                f"Using SDPA + a separate sigmoid gate for these inputs (same results, more memory traffic). Please "
                f"report this with the output of `python benchmarks/gpu_check.py --out DIR` (DIR/results.md) and "
                f"this message; {KERNEL_MODE_VARIABLE}=trust skips the check, =off never uses the kernel.")
    return SELF_CHECK_VERDICTS[combo]


# --------------------------------------------------------------------------------------------------------------------
# Transformers' inputs -> the kernel's layouts
# --------------------------------------------------------------------------------------------------------------------


def _varlen_from_padding_mask(mask: torch.Tensor, q_len: int):
    """`mask: [B, S_k]` bool, True = token; queries are its last `q_len` columns.

    -> `(rows_q [T_q], rows_k [T_k])` indices of the kept tokens in the flattened `[B * S]` layouts,
    `(cu_q, cu_k)` int32 `[B + 1]` offsets, `(max_q, max_k)` Python ints."""
    q_mask = mask[:, -q_len:]
    rows_q, rows_k = q_mask.flatten().nonzero().squeeze(1), mask.flatten().nonzero().squeeze(1)
    lens_q, lens_k = q_mask.sum(1, dtype=torch.int32), mask.sum(1, dtype=torch.int32)
    cu_q, cu_k = (F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0)) for lens in (lens_q, lens_k))
    return (rows_q, rows_k), (cu_q, cu_k), (int(lens_q.max()), int(lens_k.max()))


def _varlen_from_position_ids(position_ids: torch.Tensor, batch: int, seq_len: int):
    """Packed rows, `position_ids: [B or 1, S]`: a sequence starts at each row start and wherever the position does
    not grow by one (the rule of `masking_utils.find_packed_sequence_indices`, which sdpa's mask follows).

    -> `(cu [N + 1] int32 offsets into the flattened [B * S] tokens, longest length)`, or None when nothing is packed.
    """
    pos = position_ids.expand(batch, seq_len)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
    if int(starts.sum()) == batch:
        return None
    begins = starts.flatten().nonzero().squeeze(1).to(torch.int32)
    cu = torch.cat([begins, begins.new_tensor([batch * seq_len])])
    return cu, int((cu[1:] - cu[:-1]).max())


def _visible_from_cu_seqlens(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool) -> torch.Tensor:
    """`[T_q, T_k]` bool: packed query row i sees key row j (same sequence; bottom-right causal within it)."""
    lens_q, lens_k = cu_q.diff().long(), cu_k.diff().long()
    seq_q = torch.repeat_interleave(torch.arange(len(lens_q), device=cu_q.device), lens_q)
    seq_k = torch.repeat_interleave(torch.arange(len(lens_k), device=cu_k.device), lens_k)
    visible = seq_q[:, None] == seq_k[None, :]
    if causal:
        pos_q = torch.arange(len(seq_q), device=cu_q.device) - cu_q.long()[seq_q]
        pos_k = torch.arange(len(seq_k), device=cu_k.device) - cu_k.long()[seq_k]
        visible &= pos_k[None, :] <= (pos_q + lens_k[seq_q] - lens_q[seq_q])[:, None]
    return visible


def _sdpa_then_gate(q, k, v, gate, causal, scale, visible=None):
    """The fallback: PyTorch SDPA, then `* sigmoid(gate)` as the attention module applies it without a fused backend.

    `q: [B, S_q, Hq, D]`, `k, v: [B, S_k, Hkv, D]` (views), `gate: [B, S_q, Hq, D or 1]` logits or None, `visible:
    [B or 1, S_q, S_k]` bool or None (then causal aligned bottom-right, or no mask) -> `[B, S_q, Hq, D]`. Query rows
    that see no key give zeros, as the kernel does."""
    s_q, s_k = q.shape[1], k.shape[1]
    if visible is None and causal and s_q > 1:
        visible = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q)[None]
    sees_a_key = None
    if visible is not None:
        sees_a_key = visible.any(-1, keepdim=True)  # [B, S_q, 1]
        visible = (visible | ~sees_a_key)[:, None]  # fully masked rows attend anywhere, then get zeroed: no NaN
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible,
                                         scale=scale, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    if sees_a_key is not None:
        out = out * sees_a_key[..., None]
    return out if gate is None else out * torch.sigmoid(gate).to(out.dtype)


# --------------------------------------------------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------------------------------------------------


def gated_triton_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    output_gate: torch.Tensor | None = None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, None]:
    """`query: [B, Hq, S, D]`, `key, value: [B, Hkv, S_k, D]` (GQA not expanded), `attention_mask: [B, S_k]` bool
    (True = token) or None, `output_gate`: G1 gate logits `[B, S, Hq, D]` or `[B, S, Hq, 1]` (any strides) or None
    -> `(out [B, S, Hq, D] = attention ⊙ sigmoid(output_gate), None)`. Causal, aligned bottom-right with a cache.

    Packed sequences arrive as `cu_seq_lens_q/k` + `max_length_q/k` (DataCollatorWithFlattening) or as restarting
    `position_ids`; padded query rows come back as zeros."""
    if dropout:
        raise ValueError(f"attn_implementation='gated_triton' has no attention dropout (got {dropout}); set "
                         "config.attention_dropout=0.0 or use 'sdpa'")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("attn_implementation='gated_triton' does not support sliding-window layers; use 'sdpa' or "
                         "'flash_attention_2' for configs with use_sliding_window=True")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attn_implementation='gated_triton' takes a 2-D padding mask [B, S_k], got shape "
                         f"{tuple(attention_mask.shape)}; use 'sdpa' or 'eager' for custom 4-D masks")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D] views, no copy
    batch, q_len, heads, head_dim = q.shape

    mask = cu_q = cu_k = max_q = max_k = None
    if attention_mask is not None:  # padding
        mask = attention_mask.bool()
        k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]  # a static cache is longer than the tokens seen
    else:
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        position_ids = kwargs.get("position_ids")
        # Finding restarts in position_ids is data-dependent: not done under torch.compile (pass cu_seq_lens there).
        if (cu_q is None and position_ids is not None and q_len > 1 and q_len == k.shape[1]
                and not torch.compiler.is_compiling()):
            found = _varlen_from_position_ids(position_ids, batch, q_len)
            if found is not None:
                cu_q, max_q = found
                cu_k, max_k = cu_q, max_q
        if cu_q is not None:
            cu_q = cu_q.to(torch.int32)
            cu_k = cu_q if cu_k is None else cu_k.to(torch.int32)
            max_q = int(cu_q.diff().max()) if max_q is None else int(max_q)
            max_k = max_q if max_k is None else int(max_k)

    def flat(t):  # [B, S, ...] -> [B * S, ...]
        return t.reshape(-1, *t.shape[2:])

    reason = gated_attention_unsupported_reason(q, k, v, output_gate)
    if reason is None:
        combo = combination_of(q, output_gate, causal, mask is not None or cu_q is not None,
                               max_q if cu_q is not None else q_len)
        reason = _kernel_verdict(combo)
    elif not torch.compiler.is_compiling():
        logger.warning_once(f"gated_triton: the Triton kernel cannot run here ({reason}); using SDPA + a separate "
                            "sigmoid gate instead")

    if reason is not None:  # SDPA + separate gate, with the same masks
        if mask is not None:
            visible = mask[:, None, :]
            if causal:
                visible = visible & torch.ones(q_len, mask.shape[1], dtype=torch.bool, device=q.device).tril(
                    mask.shape[1] - q_len)
            visible = visible & mask[:, -q_len:, None]  # padded query rows see nothing (zeros, like the kernel)
            return _sdpa_then_gate(q, k, v, output_gate, causal, scaling, visible), None
        if cu_q is not None:
            visible = _visible_from_cu_seqlens(cu_q, cu_k, causal)[None]
            gate = None if output_gate is None else flat(output_gate)[None]
            out = _sdpa_then_gate(flat(q)[None], flat(k)[None], flat(v)[None], gate, causal, scaling, visible)
            return out.view(batch, q_len, heads, head_dim), None
        return _sdpa_then_gate(q, k, v, output_gate, causal, scaling), None

    if mask is not None:  # padding: attend over the kept tokens only, then scatter back
        (rows_q, rows_k), (cu_q, cu_k), (max_q, max_k) = _varlen_from_padding_mask(mask, q_len)
        gate = None if output_gate is None else flat(output_gate)[rows_q]
        packed = gated_attention(flat(q)[rows_q], flat(k)[rows_k], flat(v)[rows_k], gate, causal=causal, scale=scaling,
                                 cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
        out = packed.new_zeros(batch * q_len, heads, head_dim).index_copy(0, rows_q, packed)
        return out.view(batch, q_len, heads, head_dim), None
    if cu_q is not None:  # packed sequences: the flattened batch is the varlen batch
        out = gated_attention(flat(q), flat(k), flat(v), None if output_gate is None else flat(output_gate),
                              causal=causal, scale=scaling, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                              max_seqlen_k=max_k)
        return out.view(batch, q_len, heads, head_dim), None
    return gated_attention(q, k, v, output_gate, causal=causal, scale=scaling), None


AttentionInterface.register("gated_triton", gated_triton_attention_forward)
FUSED_GATE_BACKENDS.add("gated_triton")
AttentionMaskInterface.register("gated_triton", flash_attention_mask)  # without it padding would be ignored


def gated_triton_is_default(config) -> bool:
    """`gated_triton` is the default attention where it runs natively (a CUDA GPU and Triton) and the config needs
    nothing it lacks (sliding windows, attention dropout); elsewhere the default stays `sdpa`."""
    return (
        torch.cuda.is_available()
        and triton_available()
        and "sliding_attention" not in (config.layer_types or [])
        and not config.attention_dropout
    )
