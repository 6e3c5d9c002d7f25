"""First-use self-check of the fused gated-attention kernel: run it on a small random problem of one combination
(device, dtype, head dim, gate kind, causal, layout), forward and backward, against the plain PyTorch reference.

The kernel's tests run under the Triton interpreter on a CPU; a GPU compiles other code (other tiles, tensor cores,
the compiler of the installed Triton). This check is what stands between a user's GPU and an untested combination:
the `gated_triton` backend runs it once per combination and falls back to SDPA + a separate gate when it fails.
It uses its own random generator (the caller's random state is untouched) and takes milliseconds on a GPU (plus the
kernel's compilation, which the real call would pay anyway).

Nothing from Transformers.
"""

import dataclasses

import torch

from .inputs import gate_kind
from .launch import INTERPRET
from .naive import naive_gated_attention

# Bounds on max |kernel − reference| / max |reference| per tensor (reference in fp32 on the same rounded inputs).
# Several times the errors the kernel's tests accept: the check exists to catch broken code, not rounding.
SELF_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}
LAYOUTS = ("dense", "varlen", "decode", "varlen-decode")


@dataclasses.dataclass(frozen=True)
class Combination:
    """What the kernel compiles and dispatches on; one self-check each."""

    device: str
    dtype: torch.dtype
    head_dim: int
    gate: str | None  # None | "elementwise" | "headwise"
    causal: bool
    layout: str  # one of LAYOUTS

    def describe(self) -> str:
        gate = f"{self.gate} gate" if self.gate else "no gate"
        mask = "causal" if self.causal else "non-causal"
        return f"{self.device}, {str(self.dtype).removeprefix('torch.')}, head dim {self.head_dim}, {gate}, {mask}, " \
               f"{self.layout}"


def combination_of(q: torch.Tensor, gate: torch.Tensor | None, causal: bool, packed: bool,
                   max_seqlen_q: int) -> Combination:
    """The combination of a call with `q [B, S, Hq, D]` or packed `[T, Hq, D]`, `gate [..., Hq, D or 1]` or None."""
    head_dim = q.shape[-1]
    layout = ("varlen-" if packed else "") + ("decode" if max_seqlen_q == 1 else "")
    return Combination(str(q.device), q.dtype, head_dim, gate_kind(gate, head_dim), bool(causal),
                       layout.strip("-") or "dense")


def _problem(combo: Combination, generator: torch.Generator):
    """Inputs of a small problem of this combination: several key blocks, ragged tails, GQA, a gate as a view."""
    seq = 70 if INTERPRET else 300  # > one block of the interpreter's 64 / the GPU's 128, with a ragged tail
    h_q, h_kv, d = 4, 2, combo.head_dim
    kwargs = {"causal": combo.causal}
    if combo.layout in ("varlen", "varlen-decode"):
        lens_q = [1, 1, 1] if combo.layout == "varlen-decode" else [seq // 3, 1, seq]
        lens_k = [seq // 3 + 5, 9, seq + 17]  # more keys than queries: bottom-right alignment matters
        cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32) for n in (lens_q, lens_k))
        lead_q, lead_k = (sum(lens_q),), (sum(lens_k),)
        kwargs |= {"cu_seqlens_q": cu_q.to(combo.device), "cu_seqlens_k": cu_k.to(combo.device),
                   "max_seqlen_q": max(lens_q), "max_seqlen_k": max(lens_k)}
    elif combo.layout == "decode":
        lead_q, lead_k = (2, 1), (2, seq + 37)
    else:
        lead_q = lead_k = (2, seq)

    def rnd(*shape):
        return torch.randn(*shape, generator=generator).to(combo.device, combo.dtype)

    q, k, v = rnd(*lead_q, h_q, d), rnd(*lead_k, h_kv, d), rnd(*lead_k, h_kv, d)
    gate = None
    if combo.gate == "elementwise":
        gate = rnd(*lead_q, h_q, 2 * d)[..., d:]  # a slice of a fused projection, as modeling passes it
    elif combo.gate == "headwise":
        gate = rnd(*lead_q, h_q, 1)
    return q, k, v, gate, rnd(*lead_q, h_q, d), kwargs


def self_check(combo: Combination) -> str | None:
    """None when the kernel matches the reference for `combo` (outputs and every gradient), else a sentence saying
    what failed (a mismatch, non-finite values, or the exception a compile or launch raised)."""
    # Callers may be under no_grad (generate) or inference_mode (pipelines): the check builds its own graph.
    with torch.inference_mode(False), torch.enable_grad():
        return _run_self_check(combo)


def _run_self_check(combo: Combination) -> str | None:
    from .parallel import gated_attention  # the check runs only where Triton is installed

    generator = torch.Generator().manual_seed(0)
    q, k, v, gate, dy, kwargs = _problem(combo, generator)
    names = ["out", "dq", "dk", "dv"] + (["dgate"] if gate is not None else [])
    results = []
    try:
        for attend, cast in ((gated_attention, None), (naive_gated_attention, torch.float32)):
            # The reference runs in fp32 on the same rounded inputs.
            leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (q, k, v)]
            g = None if gate is None else gate.detach().to(cast or gate.dtype).requires_grad_()
            out = attend(*leaves, g, **kwargs)
            out.backward(dy.to(out.dtype))
            results.append([out] + [t.grad for t in leaves] + ([g.grad] if g is not None else []))
        if combo.device.startswith("cuda"):
            torch.cuda.synchronize(combo.device)
    except Exception as err:  # a compile or launch failure is a verdict, reported to the user
        message = str(err).strip()
        return f"{type(err).__name__}: {message.splitlines()[0][:300] if message else ''}"
    bound = SELF_CHECK_TOLERANCE[combo.dtype]
    problems = []
    for name, got, want in zip(names, *results):
        got, want = got.float(), want.float()
        if not torch.isfinite(got).all():
            problems.append(f"{name} has non-finite values")
            continue
        error = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        if not error <= bound:
            problems.append(f"{name} error {error:.1e} > {bound:.0e}")
    return "; ".join(problems) + " against the PyTorch reference" if problems else None
