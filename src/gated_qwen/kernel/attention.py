"""The kernel as an attention function with Transformers' calling convention, `gated_attention_forward`, and the one
decision whether it is a model's default attention, `runs_by_default`. Nothing here imports Transformers: the
gated_qwen package registers this function as `attn_implementation="gated_triton"` (`integrations/gated_triton.py`),
and a saved folder's own code registers the same function from the Hub kernel built from this subpackage
(`integrations/kernel_hub.py`), where the package is not installed.

The kernel applies the G1 sigmoid gate to its fp32 accumulator, so the attention module hands it the gate logits
(this function `applies_output_gate`) instead of multiplying afterwards. Masks are FlashAttention-style
(a 2-D padding mask or None). `kernel_inputs` puts a call into the kernel's layouts once (padding,
DataCollatorWithFlattening's `cu_seq_lens_*` and packed `position_ids` become packed rows); then the kernel or its
fallback, `sdpa_gated_attention` (same arguments), runs them.

The kernel runs only where it is checked and, on a CUDA GPU, measured faster. `GATED_QWEN_KERNEL` chooses:
  check (default)  the first call of each (device, dtype, head dim, gate kind, causal, layout) combination runs the
                   kernel on a small problem against the PyTorch reference, forward and backward
                   (`selfcheck.py`); a combination that fails uses SDPA + a separate sigmoid gate,
                   with one warning saying what failed and how to report it. On a CUDA GPU the first call of a
                   checked combination in each length bucket (keys up to a power of two) then times the kernel
                   against SDPA + gate on the call's own inputs, forward (and backward where gradients are
                   needed), and the faster runs from then on, with one log line (`choice.py`: the rule, and the
                   cache file that keeps the choices across runs);
  trust            the kernel without the check or the timing;
  off              never the kernel: SDPA + a separate sigmoid gate.
Where the kernel cannot run at all (no Triton; CPU tensors without TRITON_INTERPRET; fp32 on a GPU) the same SDPA
path is used, with one warning giving the reason. Under `torch.compile` and while a CUDA graph is captured nothing
is checked or timed: a combination checked by an earlier eager call keeps its verdict, and on a CUDA GPU the kernel
runs only where a choice measured it faster (in this process or the cache file), else SDPA + gate; on a CPU (the
interpreter) an unchecked combination uses the kernel. Packed sequences must arrive as `cu_seq_lens_*` under
`torch.compile` (restarting `position_ids` are found only in eager mode).
"""

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import choice
from .inputs import gated_attention_unsupported_reason
from .launch import TRITON_IMPORT_ERROR, triton, triton_available
from .selfcheck import Combination, combination_of, self_check

if triton is not None:  # the kernel modules define their @triton.jit functions at import
    from .parallel import gated_attention
else:

    def gated_attention(q, k, v, gate=None, **kwargs):
        """Stands in for `parallel.gated_attention` where Triton is not installed: raises a RuntimeError."""
        raise RuntimeError(f"Triton is not installed ({TRITON_IMPORT_ERROR}): pip install 'gated-qwen[triton]', or "
                           "use naive_gated_attention")


logger = logging.getLogger(__name__)

# The name the function is registered under in Transformers' attention registry (model/gating.py's
# FUSED_ATTENTION; a test checks that they agree): what the messages tell a user to pass or avoid.
ATTENTION_NAME = "gated_triton"
KERNEL_MODE_VARIABLE = "GATED_QWEN_KERNEL"
KERNEL_MODES = ("check", "trust", "off")
# Self-check verdicts of this process: None = passed, else what failed.
SELF_CHECK_VERDICTS: dict[Combination, str | None] = {}
_SAID: set[str] = set()
_SAID_CHOICES: set[choice.ChoiceKey] = set()


def _warn_once(message: str) -> None:
    """A warning logged once per process (Transformers' `warning_once`, without Transformers)."""
    if message not in _SAID:
        _SAID.add(message)
        logger.warning(message)


def kernel_mode() -> str:
    """`GATED_QWEN_KERNEL` (check | trust | off; default check)."""
    mode = os.environ.get(KERNEL_MODE_VARIABLE, "check").strip().lower() or "check"
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNEL_MODE_VARIABLE}={mode!r} is not one of {', '.join(KERNEL_MODES)}")
    return mode


def _self_check_verdict(combo: Combination) -> str | None:
    """None when `combo` passed its self-check (run now if it has not), else what failed (warned once)."""
    if combo not in SELF_CHECK_VERDICTS:
        SELF_CHECK_VERDICTS[combo] = failure = self_check(combo)
        if failure is not None:
            logger.warning(
                f"{ATTENTION_NAME}: the fused Triton kernel failed its self-check for ({combo.describe()}): {failure}. "
                f"Using SDPA + a separate sigmoid gate for these inputs (same results, more memory traffic). Please "
                f"report this with the output of `python benchmarks/gpu_check.py --out DIR` (DIR/results.md) and "
                f"this message; {KERNEL_MODE_VARIABLE}=trust skips the check, =off never uses the kernel.")
    return SELF_CHECK_VERDICTS[combo]


def _kernel_verdict(inputs: "KernelInputs", combo: Combination, causal: bool, scale: float | None) -> str | None:
    """None when the kernel may run this call, else why not: the switch, the self-check, and on a CUDA GPU the
    measured choice (`choice.py`)."""
    mode = kernel_mode()
    if mode == "off":
        return f"{KERNEL_MODE_VARIABLE}=off"
    if mode == "trust":
        return None
    blind = torch.compiler.is_compiling() or choice.capturing(combo.device)  # nothing can be checked or timed
    if not choice.measured_on(combo.device):  # the interpreter on a CPU: the self-check alone
        return None if blind and combo not in SELF_CHECK_VERDICTS else _self_check_verdict(combo)
    key = choice.ChoiceKey(combo, choice.length_bucket(inputs.longest_key), _needs_backward(inputs))
    if blind:  # never chosen blind: the kernel only where it passed (not failed here) and was measured faster
        if SELF_CHECK_VERDICTS.get(combo) is None and choice.known_kernel(key):
            return None
        return "not measured faster than SDPA + gate before a torch.compile trace or CUDA graph capture"
    failure = _self_check_verdict(combo)
    if failure is not None:
        return failure
    chosen = choice.known(key)
    if chosen is None:
        from .parallel import gated_attention as kernel  # the kernel itself, not what the module name points to

        chosen = choice.measure(key, _timed_run(kernel, inputs, causal, scale, key.backward),
                                _timed_run(sdpa_gated_attention, inputs, causal, scale, key.backward))
    if key not in _SAID_CHOICES:
        _SAID_CHOICES.add(key)
        _say_choice(key, chosen)
    return None if chosen.kernel else chosen.failure or "measured slower than SDPA + gate"


def _needs_backward(inputs: "KernelInputs") -> bool:
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (inputs.q, inputs.k, inputs.v, inputs.gate))


def _timed_run(attend, inputs: "KernelInputs", causal: bool, scale: float | None, backward: bool):
    """One call of `attend` on the call's inputs, detached from the caller's graph (its gradients stay untouched):
    the forward, and the backward of a gradient of ones where `backward`."""
    def run():
        leaves = [None if t is None else t.detach().requires_grad_(backward)
                  for t in (inputs.q, inputs.k, inputs.v, inputs.gate)]
        with torch.set_grad_enabled(backward):
            out = attend(*leaves, causal=causal, scale=scale, **inputs.varlen)
            if backward:
                out.backward(torch.ones_like(out))

    return run


def _say_choice(key: "choice.ChoiceKey", chosen: "choice.Choice") -> None:
    """The one log line of a choice: which path runs and the two times."""
    if chosen.failure is not None:
        logger.warning(f"{ATTENTION_NAME}: {key.describe()}: {chosen.failure}; running SDPA + a separate sigmoid gate")
        return
    ran = "the fused kernel" if chosen.kernel else "SDPA + a separate sigmoid gate"
    where = f" (measured in an earlier run: {choice.cache_file(key.combo.device)})" if chosen.from_file else ""
    logger.info(f"{ATTENTION_NAME}: {key.describe()}: fused kernel {chosen.kernel_ms:.4g} ms, SDPA + gate "
                f"{chosen.sdpa_ms:.4g} ms{where}; running {ran}")


# --------------------------------------------------------------------------------------------------------------------
# Transformers' inputs -> the kernel's layouts
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class KernelInputs:
    """One attention call in the layouts the kernel takes, normalised once: dense `q: [B, S_q, Hq, D]`, `k, v:
    [B, S_k, Hkv, D]`, `gate: [B, S_q, Hq, D or 1]` or None; or packed `[T, H, D]` rows with `varlen` (the kernel's
    `cu_seqlens_q/k`, `max_seqlen_q/k`). `rows_q`: where padded inputs' kept query rows go back in the flattened
    `[B * S_q]` output (None: every row is kept); `shape`: the output's `(B, S_q, Hq, D)`."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gate: torch.Tensor | None
    shape: tuple[int, int, int, int]
    varlen: dict = field(default_factory=dict)
    rows_q: torch.Tensor | None = None

    @property
    def longest_query(self) -> int:
        return self.varlen["max_seqlen_q"] if self.varlen else self.q.shape[1]

    @property
    def longest_key(self) -> int:
        return self.varlen["max_seqlen_k"] if self.varlen else self.k.shape[1]

    def restore(self, out: torch.Tensor) -> torch.Tensor:
        """The attention output in Transformers' `[B, S_q, Hq, D]` (padded query rows are zeros)."""
        if self.rows_q is not None:
            out = out.new_zeros(self.shape[0] * self.shape[1], *out.shape[1:]).index_copy(0, self.rows_q, out)
        return out.view(self.shape) if self.varlen else out


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    """`[B, S, ...]` -> `[B * S, ...]`."""
    return None if t is None else t.reshape(-1, *t.shape[2:])


def _varlen(cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int | None, max_k: int | None) -> dict:
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    max_q = int(cu_q.diff().max()) if max_q is None else int(max_q)
    return {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q,
            "max_seqlen_k": max_q if max_k is None else int(max_k)}


def _varlen_from_padding_mask(mask: torch.Tensor, q_len: int):
    """`mask: [B, S_k]` bool, True = token; queries are its last `q_len` columns.

    -> `(rows_q [T_q], rows_k [T_k])` indices of the kept tokens in the flattened `[B * S]` layouts, and the kernel's
    varlen arguments (int32 `[B + 1]` offsets, longest lengths)."""
    q_mask = mask[:, -q_len:]
    rows_q, rows_k = q_mask.flatten().nonzero().squeeze(1), mask.flatten().nonzero().squeeze(1)
    lens_q, lens_k = q_mask.sum(1, dtype=torch.int32), mask.sum(1, dtype=torch.int32)
    cu_q, cu_k = (F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0)) for lens in (lens_q, lens_k))
    return (rows_q, rows_k), _varlen(cu_q, cu_k, int(lens_q.max()), int(lens_k.max()))


def _varlen_from_position_ids(position_ids: torch.Tensor, batch: int, seq_len: int):
    """Packed rows, `position_ids: [B or 1, S]`: a sequence starts at each row start and wherever the position does
    not grow by one (the rule of Transformers' `masking_utils.find_packed_sequence_indices`, which sdpa's mask follows).

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


def kernel_inputs(q, k, v, gate, attention_mask, kwargs) -> KernelInputs:
    """The call's `q: [B, S_q, Hq, D]`, `k, v: [B, S_k, Hkv, D]` (views), `gate` and its padding mask or packed
    sequences (`cu_seq_lens_q/k` + `max_length_q/k`, DataCollatorWithFlattening's, or restarting `position_ids`)
    in the kernel's layouts: padded batches and packed sequences become packed rows, the rest stays dense."""
    batch, q_len = q.shape[:2]
    if attention_mask is not None:  # padding: attend over the kept tokens only, scattered back afterwards
        mask = attention_mask.bool()
        k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]  # a static cache is longer than the tokens seen
        (rows_q, rows_k), varlen = _varlen_from_padding_mask(mask, q_len)
        return KernelInputs(_flat(q)[rows_q], _flat(k)[rows_k], _flat(v)[rows_k],
                            None if gate is None else _flat(gate)[rows_q], q.shape, varlen, rows_q)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    position_ids = kwargs.get("position_ids")
    # Finding restarts in position_ids is data-dependent: not done under torch.compile (pass cu_seq_lens there).
    if (cu_q is None and position_ids is not None and q_len > 1 and q_len == k.shape[1]
            and not torch.compiler.is_compiling()):
        found = _varlen_from_position_ids(position_ids, batch, q_len)
        if found is not None:
            cu_q, max_q = cu_k, max_k = found
    if cu_q is None:
        return KernelInputs(q, k, v, gate, q.shape)
    varlen = _varlen(cu_q, cu_q if cu_k is None else cu_k, max_q, max_k)
    return KernelInputs(_flat(q), _flat(k), _flat(v), _flat(gate), q.shape, varlen)


# --------------------------------------------------------------------------------------------------------------------
# The fallback: SDPA, then the gate
# --------------------------------------------------------------------------------------------------------------------


def _sdpa_then_gate(q, k, v, gate, causal, scale, visible=None):
    """PyTorch SDPA, then `* sigmoid(gate)` as the attention module applies it without a fused backend.

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


def _padded(rows: torch.Tensor, cu: torch.Tensor, longest: int):
    """Packed `rows: [T, ...]` of the sequences `cu` delimits -> `([N, longest, ...], kept [N, longest] bool)`; the
    rows past a sequence's end hold other rows' values (masked where they are used)."""
    position = torch.arange(longest, device=rows.device)
    kept = position[None, :] < cu.diff().long()[:, None]
    index = (cu[:-1].long()[:, None] + position[None, :]).clamp(max=max(rows.shape[0] - 1, 0))
    return (rows[index] if rows.shape[0] else rows.new_zeros(*index.shape, *rows.shape[1:])), kept


def sdpa_gated_attention(q, k, v, gate=None, *, causal=True, scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
                         max_seqlen_q=None, max_seqlen_k=None) -> torch.Tensor:
    """What the kernel computes (`gated_attention`, same arguments and shapes), with PyTorch SDPA and a separate
    sigmoid gate: where the kernel cannot or may not run. Packed sequences are attended as a zero-padded batch of
    `N` sequences (memory `N · max_seqlen_q · max_seqlen_k` for the mask)."""
    if cu_seqlens_q is None:
        return _sdpa_then_gate(q, k, v, gate, causal, scale)
    (q, kept_q), (k, kept_k), (v, _) = (_padded(t, cu, n) for t, cu, n in (
        (q, cu_seqlens_q, max_seqlen_q), (k, cu_seqlens_k, max_seqlen_k), (v, cu_seqlens_k, max_seqlen_k)))
    gate = None if gate is None else _padded(gate, cu_seqlens_q, max_seqlen_q)[0]
    visible = kept_q[:, :, None] & kept_k[:, None, :]
    if causal:  # bottom-right within each sequence: query i sees key j <= i + len_k - len_q
        offset = (cu_seqlens_k.diff() - cu_seqlens_q.diff()).long()
        position_q, position_k = (torch.arange(n, device=q.device) for n in (max_seqlen_q, max_seqlen_k))
        visible &= position_k[None, None, :] <= position_q[None, :, None] + offset[:, None, None]
    return _sdpa_then_gate(q, k, v, gate, causal, scale, visible)[kept_q]


# --------------------------------------------------------------------------------------------------------------------
# The attention function, and whether it is the default
# --------------------------------------------------------------------------------------------------------------------


def _refuse_what_the_kernel_lacks(attention_mask: torch.Tensor | None, dropout: float, kwargs: dict) -> None:
    if dropout:
        raise ValueError(f"attn_implementation={ATTENTION_NAME!r} has no attention dropout (got {dropout}); set "
                         "config.attention_dropout=0.0 or use 'sdpa'")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"attn_implementation={ATTENTION_NAME!r} does not support sliding-window layers; use 'sdpa' or "
                         "'flash_attention_2' for configs with use_sliding_window=True")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attn_implementation={ATTENTION_NAME!r} takes a 2-D padding mask [B, S_k], got shape "
                         f"{tuple(attention_mask.shape)}; use 'sdpa' or 'eager' for custom 4-D masks")


def _attention_for(inputs: KernelInputs, causal: bool, scale: float | None):
    """The kernel (`gated_attention`) where it can run these inputs and may (`GATED_QWEN_KERNEL`, the self-check, on a
    CUDA GPU the measured choice), else `sdpa_gated_attention`."""
    reason = gated_attention_unsupported_reason(inputs.q, inputs.k, inputs.v, inputs.gate,
                                                cu_seqlens_q=inputs.varlen.get("cu_seqlens_q"),
                                                cu_seqlens_k=inputs.varlen.get("cu_seqlens_k"))
    if reason is None:
        combo = combination_of(inputs.q, inputs.gate, causal, bool(inputs.varlen), inputs.longest_query)
        reason = _kernel_verdict(inputs, combo, causal, scale)
    elif not torch.compiler.is_compiling():
        _warn_once(f"{ATTENTION_NAME}: the Triton kernel cannot run here ({reason}); using SDPA + a separate "
                   "sigmoid gate instead")
    return gated_attention if reason is None else sdpa_gated_attention


def gated_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    output_gate: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """An attention function of Transformers' attention interface (`AttentionInterface.register(name, this)`):
    `query: [B, Hq, S, D]`, `key, value: [B, Hkv, S_k, D]` (GQA not expanded), `attention_mask: [B, S_k]` bool
    (True = token) or None, `output_gate`: G1 gate logits `[B, S, Hq, D]` or `[B, S, Hq, 1]` (any strides) or None
    -> `(out [B, S, Hq, D] = attention ⊙ sigmoid(output_gate), None)`. Causal, aligned bottom-right with a cache.

    Packed sequences arrive as `cu_seq_lens_q/k` + `max_length_q/k` (DataCollatorWithFlattening) or as restarting
    `position_ids`; padded query rows come back as zeros."""
    _refuse_what_the_kernel_lacks(attention_mask, dropout, kwargs)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D] views, no copy
    inputs = kernel_inputs(q, k, v, output_gate, attention_mask, kwargs)
    attend = _attention_for(inputs, causal, scaling)
    out = attend(inputs.q, inputs.k, inputs.v, inputs.gate, causal=causal, scale=scaling, **inputs.varlen)
    return inputs.restore(out), None


def runs_by_default(config) -> bool:
    """Whether this kernel is the default attention of a model with `config` (a Transformers config: its
    `layer_types` and `attention_dropout` are read): where it runs natively (a CUDA GPU and Triton) and the config
    needs nothing it lacks (sliding windows, attention dropout); elsewhere the default stays `sdpa` (on a CUDA GPU
    without Triton with one warning saying how to get the kernel)."""
    if not torch.cuda.is_available():
        return False
    if not triton_available():
        _warn_once(f"{ATTENTION_NAME}: Triton is not installed, so attention runs as SDPA with a separate sigmoid "
                   "gate; pip install triton (or 'gated-qwen[triton]') for the fused kernel")
        return False
    return "sliding_attention" not in (getattr(config, "layer_types", None) or []) and not config.attention_dropout


# What the model's attention module asks of an attention function (model/gating.py, `applies_output_gate`; model/
# modeling_gated.py, `fused_attention`): it applies the G1 gate itself, and whether it is the default for a config.
gated_attention_forward.applies_output_gate = True
gated_attention_forward.runs_by_default = runs_by_default
