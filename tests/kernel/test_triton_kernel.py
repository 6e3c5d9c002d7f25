"""The fused Triton gated-attention kernel against the plain PyTorch reference: outputs and every gradient.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
anything imports gated_qwen); sizes are small (S ≈ 100, two 64-wide blocks) so the file runs in well under two
minutes on two CPU cores. The reference runs in fp64 on the same (rounded) inputs; errors are measured as
max |kernel − reference| / max |reference| per tensor, with a bound per input dtype (a few units of its epsilon).
"""

import math
import os

import pytest
import torch

pytest.importorskip("triton", reason="needs the triton extra: pip install 'gated-qwen[triton]'")

from gated_qwen import kernel as tga
from gated_qwen.kernel import gated_attention, naive_gated_attention
from gated_qwen.kernel.launch import INTERPRET

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("no CUDA device and TRITON_INTERPRET was not set before import", allow_module_level=True)

# Bounds on the normalised max error vs the fp64 reference: fp32 is accumulation-order noise; fp16/bf16 are about
# four units of the dtype's epsilon (inputs, P and dA are rounded to the input dtype, as in FlashAttention).
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


def make_inputs(b, s_q, s_k, h_q, h_kv, d, gate_kind, dtype=torch.float32, packed_q=None, packed_k=None, seed=0):
    """Random q [B,S_q,Hq,D], k/v [B,S_k,Hkv,D] (or packed [T,H,D] when totals are given) and a gate."""
    gen = torch.Generator().manual_seed(seed)
    lead_q = (packed_q,) if packed_q is not None else (b, s_q)
    lead_k = (packed_k,) if packed_k is not None else (b, s_k)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(DEVICE, dtype)

    q, k, v = rnd(*lead_q, h_q, d), rnd(*lead_k, h_kv, d), rnd(*lead_k, h_kv, d)
    gate = {"elementwise": lambda: rnd(*lead_q, h_q, d), "headwise": lambda: rnd(*lead_q, h_q, 1),
            None: lambda: None}[gate_kind]()
    return q, k, v, gate


def run_both(q, k, v, gate, seed=1, **kwargs):
    """Kernel and fp64 reference, forward and backward with the same random dY; returns (outs, grads) pairs."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    g_leaf = None if gate is None else gate.detach().clone().requires_grad_()
    out = gated_attention(*leaves, g_leaf, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, out.dtype)
    out.backward(dy)

    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_g = None if gate is None else gate.detach().double().requires_grad_()
    ref = naive_gated_attention(*ref_leaves, ref_g, **kwargs)
    ref.backward(dy.double())

    grads = [t.grad for t in leaves] + ([g_leaf.grad] if gate is not None else [])
    ref_grads = [t.grad for t in ref_leaves] + ([ref_g.grad] if gate is not None else [])
    return (out, ref), list(zip(grads, ref_grads))


def assert_matches(q, k, v, gate, **kwargs):
    (out, ref), grads = run_both(q, k, v, gate, **kwargs)
    tol = TOL[q.dtype]
    names = ["dq", "dk", "dv", "dgate"]
    errors = {"out": rel_err(out, ref)} | {names[i]: rel_err(a, b) for i, (a, b) in enumerate(grads)}
    for name, (a, _) in zip(names, grads):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"errors above {tol}: {bad} (all: {errors})"
    return out, ref, grads


# ------------------------------------------------------------------------------------------------------------------
# Dense batches
# ------------------------------------------------------------------------------------------------------------------


HEADS = {"mha": (2, 2), "gqa2": (4, 2), "gqa4": (4, 1), "gqa3": (3, 1)}
# `make test` (the tests not marked slow) keeps one case per gate kind, mask and GQA shape; the rest of the matrix is slow.
FAST_DENSE = {"causal-gqa2-elementwise", "full-mha-headwise", "causal-gqa3-None", "full-gqa4-elementwise"}
DENSE_CASES = [
    pytest.param(causal, heads, gate_kind, id=name, marks=() if name in FAST_DENSE else pytest.mark.slow)
    for causal in (True, False) for heads_id, heads in HEADS.items() for gate_kind in ("elementwise", "headwise", None)
    for name in [f"{'causal' if causal else 'full'}-{heads_id}-{gate_kind}"]
]


@pytest.mark.parametrize("causal,heads,gate_kind", DENSE_CASES)
def test_dense_matrix(causal, heads, gate_kind):
    h_q, h_kv = heads
    assert_matches(*make_inputs(1, 100, 100, h_q, h_kv, 64, gate_kind), causal=causal)


@pytest.mark.parametrize("d", [pytest.param(128, marks=pytest.mark.slow), pytest.param(96, marks=pytest.mark.slow),
                               pytest.param(32, marks=pytest.mark.slow), 256])
def test_other_head_dims(d):
    """128 is the main target; 96 and 32 exercise the padded head-dim path (BLOCK_D > D, or D < 64); 256 computes
    dK and dV in two passes of the dK/dV kernel."""
    assert_matches(*make_inputs(1, 80, 80, 4, 2, d, "elementwise"), causal=True)


def test_head_dim_too_large_is_a_clear_error():
    q, k, v, g = make_inputs(1, 8, 8, 2, 1, 512, "headwise")
    with pytest.raises(ValueError, match=r"head dim 512 is not supported.*1\.\.256"):
        gated_attention(q, k, v, g)
    assert not tga.gated_attention_supported(q, k, v, g)


@pytest.mark.parametrize("s_q,s_k", [(64, 150), pytest.param(130, 70, marks=pytest.mark.slow)],
                         ids=["chunked-prefill", "more-queries-than-keys"])
def test_bottom_right_causal_alignment(s_q, s_k):
    q, k, v, g = make_inputs(2, s_q, s_k, 4, 2, 64, "elementwise")
    out, _ref, grads = assert_matches(q, k, v, g, causal=True)
    if s_q > s_k:  # query rows i < S_q - S_k see no key: exactly zero output and zero gradients
        blind = s_q - s_k
        assert out[:, :blind].abs().max().item() == 0.0
        assert grads[0][0][:, :blind].abs().max().item() == 0.0  # dq
        assert grads[3][0][:, :blind].abs().max().item() == 0.0  # dgate


@pytest.mark.slow  # test_inputs_as_arbitrary_strided_views covers views in the fast set
def test_non_contiguous_qkv():
    """The Transformers adapter passes [B, H, S, D] tensors transposed to [B, S, H, D] (non-contiguous views)."""
    q, k, v, g = make_inputs(2, 90, 90, 4, 2, 64, "elementwise")
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not q.is_contiguous()
    assert_matches(q, k, v, g, causal=True)


# ------------------------------------------------------------------------------------------------------------------
# Gate layouts and values
# ------------------------------------------------------------------------------------------------------------------


def test_gate_strided_views_flow_gradients_to_the_projection():
    """Gates as views: a slice of a fused [q | gate] projection, and a head-shared gate expand()ed over heads."""
    b, s, h_q, h_kv, d = 2, 80, 4, 2, 64
    q, k, v, _ = make_inputs(b, s, s, h_q, h_kv, d, None)
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(b, s, h_q, 2 * d, generator=gen).to(DEVICE)  # per-head [q_h | gate_h] layout
    shared = torch.randn(b, s, 1, d, generator=gen).to(DEVICE)
    dy = torch.randn(b, s, h_q, d, generator=gen).to(DEVICE)
    for make_gate, base in ((lambda t: t[..., d:], fused), (lambda t: t.expand(b, s, h_q, d), shared)):
        base_k = base.clone().requires_grad_()
        gate_view = make_gate(base_k)
        assert not gate_view.is_contiguous()
        out = gated_attention(q, k, v, gate_view)
        out.backward(dy)
        base_r = base.double().requires_grad_()
        ref = naive_gated_attention(q.double(), k.double(), v.double(), make_gate(base_r))
        ref.backward(dy.double())
        assert rel_err(out, ref) <= TOL[torch.float32]
        assert rel_err(base_k.grad, base_r.grad) <= TOL[torch.float32]


@pytest.mark.parametrize("logits", [pytest.param("plus40", marks=pytest.mark.slow),
                                    pytest.param("minus40", marks=pytest.mark.slow), "mixed"])
def test_saturated_gate_logits(logits):
    """σ(±40) saturates in fp32: dG must use σ(−G) (not 1 − σ(G)) and nothing may divide by σ(G)."""
    q, k, v, g = make_inputs(1, 96, 96, 4, 2, 64, "elementwise")
    pick = torch.randn(g.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    g = {"plus40": torch.full_like(g, 40.0), "minus40": torch.full_like(g, -40.0),
         "mixed": torch.where(pick.abs() > 0.5, 40.0 * pick.sign(), g)}[logits]  # ±40 and ordinary logits
    _out, _ref, grads = assert_matches(q, k, v, g, causal=True)
    assert grads[3][0].abs().max().item() > 0.0  # dG of a saturated gate is tiny but not flushed to zero


# ------------------------------------------------------------------------------------------------------------------
# Packed variable-length batches and decode
# ------------------------------------------------------------------------------------------------------------------


def cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("causal,gate_kind", [(True, "elementwise"), pytest.param(False, "headwise", marks=pytest.mark.slow),
                                              pytest.param(True, "headwise", marks=pytest.mark.slow),
                                              pytest.param(False, "elementwise", marks=pytest.mark.slow)],
                         ids=["causal-elementwise", "full-headwise", "causal-headwise", "full-elementwise"])
def test_varlen_unequal_lengths(causal, gate_kind):
    lens = [37, 100, 1, 64]
    q, k, v, g = make_inputs(0, 0, 0, 4, 2, 64, gate_kind, packed_q=sum(lens), packed_k=sum(lens))
    assert_matches(q, k, v, g, causal=causal, cu_seqlens_q=cu(lens), cu_seqlens_k=cu(lens),
                   max_seqlen_q=max(lens), max_seqlen_k=max(lens))


def test_varlen_fully_masked_rows_are_zero_with_zero_grads():
    """Sequence 0 has 50 queries and 30 keys: bottom-right alignment leaves its first 20 rows without a key."""
    lens_q, lens_k = [50, 20, 70], [30, 70, 70]
    q, k, v, g = make_inputs(0, 0, 0, 3, 1, 64, "elementwise", packed_q=sum(lens_q), packed_k=sum(lens_k))
    out, _ref, grads = assert_matches(q, k, v, g, causal=True, cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k))
    assert out[:20].abs().max().item() == 0.0
    assert grads[0][0][:20].abs().max().item() == 0.0  # dq
    assert grads[3][0][:20].abs().max().item() == 0.0  # dgate
    assert out[20:50].abs().min().item() >= 0.0 and out[20:50].abs().max().item() > 0.0


@pytest.mark.parametrize("heads,gate_kind", [((8, 2), "elementwise"), pytest.param((3, 1), "headwise", marks=pytest.mark.slow),
                                             pytest.param((4, 1), "elementwise", marks=pytest.mark.slow),
                                             pytest.param((4, 1), "headwise", marks=pytest.mark.slow),
                                             pytest.param((3, 1), "elementwise", marks=pytest.mark.slow),
                                             pytest.param((8, 2), "headwise", marks=pytest.mark.slow)],
                         ids=["gqa4x2-elementwise", "gqa3-headwise", "gqa4-elementwise", "gqa4-headwise",
                              "gqa3-elementwise", "gqa4x2-headwise"])
def test_decode_one_query_against_long_cache(heads, gate_kind):
    """S_q = 1 takes the split-KV decode kernel (GQA group in tile rows); backward goes through the general path."""
    h_q, h_kv = heads
    assert_matches(*make_inputs(2, 1, 200, h_q, h_kv, 64, gate_kind), causal=True)


@pytest.mark.slow
def test_decode_varlen_with_empty_sequence():
    """Packed decode: one query per sequence (one sequence has none, one has an empty cache)."""
    lens_q, lens_k = [1, 0, 1, 1], [150, 40, 0, 90]
    q, k, v, g = make_inputs(0, 0, 0, 4, 2, 64, "elementwise", packed_q=sum(lens_q), packed_k=sum(lens_k))
    out, _ref, _grads = assert_matches(q, k, v, g, causal=True, cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k))
    assert out[1].abs().max().item() == 0.0  # the query of sequence 2 (empty cache) sees nothing


# ------------------------------------------------------------------------------------------------------------------
# Low precision
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,gate_kind", [pytest.param(torch.float16, "headwise", marks=pytest.mark.slow),
                                             (torch.bfloat16, "elementwise"),
                                             pytest.param(torch.float16, "elementwise", marks=pytest.mark.slow),
                                             pytest.param(torch.bfloat16, "headwise", marks=pytest.mark.slow)],
                         ids=["headwise-fp16", "elementwise-bf16", "elementwise-fp16", "headwise-bf16"])
def test_half_precision(dtype, gate_kind):
    """fp16 runs natively; bf16 is upcast to fp32 after loading under the interpreter (its bf16 math is broken)."""
    assert_matches(*make_inputs(2, 100, 100, 4, 2, 64, gate_kind, dtype=dtype), causal=True)


@pytest.mark.slow
def test_half_precision_decode_bf16():
    assert_matches(*make_inputs(1, 1, 150, 4, 1, 128, "elementwise", dtype=torch.bfloat16), causal=True)


# ------------------------------------------------------------------------------------------------------------------
# Hazards: 64-bit offsets, grid limits, ragged masks, split-KV numerics, autotune keys, strided views
# ------------------------------------------------------------------------------------------------------------------


def views_into_one_allocation(stride: int, count: int, shapes: dict, seed=0):
    """fp16 tensors {name: 4-D shape with one None} whose None axis has size `count` and element stride `stride`;
    the other axes are compact. Slot i of that axis holds every tensor's slice i, one after the other, at
    i · stride in one allocation; only the slots' pages are ever touched (the rest stays virtual)."""
    slot = sum(math.prod(d for d in shape if d is not None) for shape in shapes.values())
    big = torch.empty((count - 1) * stride + slot, dtype=torch.float16)
    gen = torch.Generator().manual_seed(seed)
    views, offset = {}, 0
    for name, shape in shapes.items():
        axis = shape.index(None)
        sizes = [count if d is None else d for d in shape]
        inner = [math.prod(d for d in shape[i + 1:] if d is not None) for i in range(4)]
        strides = [stride if i == axis else inner[i] for i in range(4)]
        view = big.as_strided(sizes, strides, offset)
        for index in range(count):
            view.select(axis, index).copy_(torch.randn(view.select(axis, index).shape, generator=gen))
        views[name] = view
        offset += math.prod(d for d in shape if d is not None)
    return views


@pytest.mark.parametrize("axis", ["batch", "head"])
def test_element_offsets_beyond_int32(axis):
    """A batch (or head) stride of 2**30 + 64 still fits int32, but the third batch (or head) starts past 2**31: only
    64-bit offsets address it. (B=8, S=32k, H=32, D=128 holds 2**30 elements per tensor; a [B, H, S, D] view of a
    long sequence has head offsets h·S·D.) Forward, decode and every gradient against the reference on compact
    copies."""
    stride, s, d = 2**30 + 64, 40, 64
    if axis == "batch":
        shapes = {"q": (None, s, 2, d), "k": (None, s, 1, d), "v": (None, s, 1, d), "g": (None, s, 2, d)}
    else:
        shapes = {"q": (1, s, None, d), "k": (1, s, None, d), "v": (1, s, None, d), "g": (1, s, None, d)}
    t = views_into_one_allocation(stride, 3, shapes)
    q, k, v, g = t["q"], t["k"], t["v"], t["g"]
    assert max(x.stride()[0 if axis == "batch" else 2] for x in (q, k, v, g)) < 2**31
    compact = [x.double() for x in (q, k, v, g)]
    op_fwd, op_bwd = torch.ops.gated_qwen.gated_attention_fwd, torch.ops.gated_qwen.gated_attention_bwd
    scale = 1 / math.sqrt(d)
    out, lse = op_fwd(q, k, v, g, True, scale, None, None, s, s)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    grads = op_bwd(dy, q, k, v, g, out, lse, True, scale, None, None, s, s)
    leaves = [x.requires_grad_() for x in compact]
    ref = naive_gated_attention(*leaves, causal=True)
    ref.backward(dy.double())
    assert rel_err(out, ref) <= TOL[torch.float16]
    for name, got, leaf in zip(("dq", "dk", "dv", "dgate"), grads, leaves):
        assert rel_err(got, leaf.grad) <= TOL[torch.float16], name
    # Decode: the last query of each sequence sees its whole cache, so it equals the last row of the forward.
    out1, _ = op_fwd(q[:, -1:], k, v, g[:, -1:], True, scale, None, None, 1, s)
    assert rel_err(out1, ref.detach()[:, -1:]) <= TOL[torch.float16]


def record_launches(monkeypatch):
    """Replace each kernel's innermost `run` by a recorder: [(kernel name, grid, launch kwargs)] (nothing runs)."""
    from gated_qwen.kernel import decoding, parallel

    calls = []
    kernels = {"forward": parallel.forward_kernel, "preprocess": parallel.preprocess_kernel,
               "dkdv": parallel.dkdv_kernel, "dq": parallel.dq_kernel, "decode_split": decoding.split_kernel,
               "decode_combine": decoding.combine_kernel}
    for name, kernel in kernels.items():
        while hasattr(getattr(kernel, "fn", None), "run"):  # Heuristics -> Autotuner -> the JIT (or interpreted) fn
            kernel = kernel.fn

        def record(*args, grid, warmup=False, _name=name, **kwargs):
            calls.append((_name, tuple(grid(kwargs)) if callable(grid) else tuple(grid), kwargs))

        monkeypatch.setattr(kernel, "run", record)
    return calls


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_launch_grids_stay_within_cuda_limits(monkeypatch, packed):
    """70,000 sequences × 32 heads (2.2 million (sequence, head) pairs): axis 0 holds blocks × sequences (limit
    2**31 − 1), axis 1 only the heads (limit 65535). Recorded on meta tensors: nothing is computed."""
    from gated_qwen.kernel.decoding import decode_forward
    from gated_qwen.kernel.parallel import backward, forward

    calls = record_launches(monkeypatch)
    n, s, h, h_kv, d = 70_000, 256, 32, 8, 64
    lead = (n * s,) if packed else (n, s)
    q, k, v, g = (torch.empty(*lead, heads, d, device="meta") for heads in (h, h_kv, h_kv, h))
    cu = torch.empty(n + 1, dtype=torch.int32, device="meta") if packed else None
    out, lse = forward(q, k, v, g, True, 0.1, cu, cu, s, s)
    backward(out, q, k, v, g, out, lse, True, 0.1, cu, cu, s, s)
    q1 = torch.empty(*(((n,) if packed else (n, 1)) + (h, d)), device="meta")
    decode_forward(q1, k, v, g[: q1.shape[0]] if packed else g[:, :1], 0.1, cu, cu, s)
    assert {name for name, _, _ in calls} == {"forward", "preprocess", "dkdv", "dq", "decode_split", "decode_combine"}
    for name, grid, _ in calls:
        assert len(grid) == 2 and grid[0] <= 2**31 - 1 and grid[1] <= 65535, (name, grid)
        assert grid[1] in (h, h_kv), (name, grid)  # heads on axis 1, never batch × heads
        assert grid[0] % n == 0, (name, grid)


def test_autotune_keys_bucket_sequence_lengths(monkeypatch):
    """The tuner keys on power-of-two length classes (SEQ_BUCKET_*), never on exact lengths: 1000 and 1020 tokens
    share tuned tiles, 3000 gets its own; the short self-check problem does not decide a long run's tiles."""
    from gated_qwen.kernel.parallel import dkdv_kernel, dq_kernel, forward, forward_kernel

    for kernel in (forward_kernel, dkdv_kernel, dq_kernel):
        keys = kernel.fn.keys
        assert "SEQ_BUCKET_Q" in keys and "SEQ_BUCKET_K" in keys
        assert not {"seqlen_q", "seqlen_k"} & set(keys)
    calls = record_launches(monkeypatch)
    for s in (1000, 1020, 3000):
        q = torch.empty(1, s, 2, 64, device="meta")
        forward(q, q, q, None, True, 0.1, None, None, s, s)
    buckets = [(kw["SEQ_BUCKET_Q"], kw["SEQ_BUCKET_K"]) for _, _, kw in calls]
    assert buckets == [(1024, 1024), (1024, 1024), (4096, 4096)]


def test_ragged_loads_are_masked(monkeypatch):
    """Packed sequences whose tensors sit inside NaN-filled buffers: NaN beyond the last row and in the padded head
    dims (D=48 in a 64-wide tile). Any load that is not masked brings NaN into an output or a gradient."""
    lens_q, lens_k = [37, 1, 70, 5], [50, 9, 70, 5]
    t_q, t_k, h_q, h_kv, d, pad = sum(lens_q), sum(lens_k), 4, 2, 48, 80

    def poisoned(rows, heads, seed):
        buf = torch.full((rows + 2 * pad, heads, 64), float("nan"))
        buf[pad: pad + rows, :, :d] = torch.randn(rows, heads, d, generator=torch.Generator().manual_seed(seed))
        return buf[pad: pad + rows, :, :d]

    q, k, v, g, dy = (poisoned(t_q, h_q, 0), poisoned(t_k, h_kv, 1), poisoned(t_k, h_kv, 2), poisoned(t_q, h_q, 3),
                      poisoned(t_q, h_q, 4))
    kwargs = {"causal": True, "cu_seqlens_q": cu(lens_q), "cu_seqlens_k": cu(lens_k)}
    leaves = [t.requires_grad_() for t in (q, k, v, g)]
    out = gated_attention(*leaves, **kwargs)
    out.backward(dy)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, g)]
    ref = naive_gated_attention(*ref_leaves, **kwargs)
    ref.backward(dy.double())
    assert rel_err(out, ref) <= TOL[torch.float32]
    for name, a, b in zip(("dq", "dk", "dv", "dgate"), leaves, ref_leaves):
        assert torch.isfinite(a.grad).all() and rel_err(a.grad, b.grad) <= TOL[torch.float32], name
    # The same through the decode kernels: one (poisoned) query per sequence against the poisoned cache.
    q1, g1, ones = poisoned(len(lens_q), h_q, 5), poisoned(len(lens_q), h_q, 6), cu([1] * len(lens_q))
    decode_kwargs = {"causal": True, "cu_seqlens_q": ones, "cu_seqlens_k": kwargs["cu_seqlens_k"]}
    out1 = gated_attention(q1, k.detach(), v.detach(), g1, **decode_kwargs)
    ref1 = naive_gated_attention(*(t.detach().double() for t in (q1, k, v, g1)), **decode_kwargs)
    assert torch.isfinite(out1).all() and rel_err(out1, ref1) <= TOL[torch.float32]


@pytest.mark.parametrize("splits", [pytest.param(1, marks=pytest.mark.slow), pytest.param(7, marks=pytest.mark.slow), 70])
def test_split_kv_decode_merges_chunks_exactly(monkeypatch, splits):
    """4000 cached keys, logits spread over about ±60 (base-2 weights between 2**-120 and 1), merged from 1, 7 or 70
    chunks (the last ones empty): equals the fp64 reference to fp32 rounding."""
    from gated_qwen.kernel import decoding

    monkeypatch.setattr(decoding, "num_splits", lambda *args: splits)
    q, k, v, g = make_inputs(1, 1, 4000, 4, 1, 64, "elementwise")
    q, k = q * 4, k * 4
    assert_matches(q, k, v, g, causal=True)


@pytest.mark.parametrize("layout", ["strided-last-dim", pytest.param("head-shared-headwise", marks=pytest.mark.slow)])
def test_inputs_as_arbitrary_strided_views(layout):
    """No contiguity assumption: q, k, v and the gate with a non-unit head-dim stride, or a headwise gate that is one
    logit per token expand()ed over heads (zero head and dim strides)."""
    b, s, h_q, h_kv, d = 2, 70, 4, 2, 64
    gen = torch.Generator().manual_seed(6)
    if layout == "strided-last-dim":
        q, k, v = (torch.randn(b, s, h, 2 * d, generator=gen)[..., ::2] for h in (h_q, h_kv, h_kv))
        g = torch.randn(b, s, h_q, 3 * d, generator=gen)[..., 1::3]
        assert q.stride(-1) == 2 and g.stride(-1) == 3
    else:
        q, k, v, _ = make_inputs(b, s, s, h_q, h_kv, d, None)
        g = torch.randn(b, s, 1, 1, generator=gen).expand(b, s, h_q, 1)
        assert g.stride(2) == 0
    assert_matches(q, k, v, g, causal=True)


# ------------------------------------------------------------------------------------------------------------------
# API: validation, custom op, torch.compile
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a | {"k": a["k"][:, :, :1].expand(-1, -1, 3, -1), "v": a["v"][:, :, :1].expand(-1, -1, 3, -1)},
         r"query heads \(4\) must be a multiple"),
        (lambda a: a | {"v": a["v"].double()}, r"dtype torch.float64 is not supported|share one dtype"),
        (lambda a: a | {"gate": a["gate"][..., :5]}, r"gate must have shape \(2, 16, 4, 64\).*\(2, 16, 4, 1\)"),
        (lambda a: a | {"q": a["q"][0]}, r"q must be \[B, S, H, D\]"),
        (lambda a: a | {"cu_seqlens_q": cu([16, 16])}, r"must be given together"),
        (lambda a: a | {"q": a["q"].int(), "k": a["k"].int(), "v": a["v"].int()}, r"dtype torch.int32"),
    ],
    ids=["bad-gqa-ratio", "mixed-dtype", "bad-gate-shape", "bad-rank", "one-cu-seqlens", "int-dtype"],
)
def test_bad_inputs_raise_clear_errors(mutate, message):
    q, k, v, g = make_inputs(2, 16, 16, 4, 2, 64, "elementwise")
    args = mutate({"q": q, "k": k, "v": v, "gate": g})
    cu_q = args.pop("cu_seqlens_q", None)
    with pytest.raises(ValueError, match=message):
        gated_attention(args["q"], args["k"], args["v"], args["gate"], cu_seqlens_q=cu_q)


def test_packed_cu_seqlens_must_be_int32():
    q, k, v, _g = make_inputs(0, 0, 0, 2, 1, 64, None, packed_q=20, packed_k=20)
    with pytest.raises(ValueError, match="int32"):
        gated_attention(q, k, v, cu_seqlens_q=cu([20]).long(), cu_seqlens_k=cu([20]).long())


def test_supported_helper():
    q, k, v, g = make_inputs(1, 16, 16, 4, 2, 64, "headwise")
    assert tga.triton_available()
    assert tga.gated_attention_supported(q, k, v, g)
    assert tga.gated_attention_unsupported_reason(q, k, v, g) is None
    k3, v3 = (t[:, :, :1].expand(-1, -1, 3, -1) for t in (k, v))
    assert "multiple" in tga.gated_attention_unsupported_reason(q, k3, v3, g)


def test_custom_op_registration_opcheck():
    """Schema, fake (meta) implementation and autograd registration of the forward op, checked by torch itself."""
    q, k, v, g = make_inputs(1, 40, 40, 2, 1, 32, "elementwise")
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), g.requires_grad_(), True, 1 / math.sqrt(32),
            None, None, 40, 40)
    torch.library.opcheck(torch.ops.gated_qwen.gated_attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("backend", [pytest.param("aot_eager", marks=pytest.mark.slow),
                                     pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_fullgraph(backend):
    """No graph break around the custom op (fullgraph=True); compiled gradients equal eager ones."""
    if backend == "inductor" and DEVICE == "cpu" and os.environ.get("GATED_QWEN_SKIP_INDUCTOR"):
        pytest.skip("GATED_QWEN_SKIP_INDUCTOR is set (inductor's C++ compile of the surrounding graph)")
    torch._dynamo.reset()
    q, k, v, g = make_inputs(1, 70, 70, 4, 2, 64, "headwise")
    proj = torch.randn(64, 64, generator=torch.Generator().manual_seed(7)).to(DEVICE)

    def loss_fn(q, k, v, g):
        out = gated_attention(q, k, v, g * 2.0, causal=True)
        return (out @ proj).square().mean()

    compiled = torch.compile(loss_fn, fullgraph=True, backend=backend)
    results = []
    for fn in (loss_fn, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, g)]
        loss = fn(*leaves)
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in leaves])
    for eager, comp in zip(*results):
        assert rel_err(comp, eager) <= 1e-5


# ------------------------------------------------------------------------------------------------------------------
# Packaging: the kernel is a subpackage of gated_qwen, and Triton is optional
# ------------------------------------------------------------------------------------------------------------------


def test_only_the_launch_module_imports_triton_and_only_in_a_try():
    """The kernel's modules reach Triton through `launch.py`'s guarded import, so the subpackage imports without it."""
    import ast
    from pathlib import Path

    for path in sorted(Path(tga.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        unguarded = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                     and getattr(node, "level", 0) == 0 and (getattr(node, "module", None) or node.names[0].name).startswith("triton")]
        assert not unguarded, f"{path.name} imports triton outside the guard"
    guarded = [node for node in ast.parse((Path(tga.__file__).parent / "launch.py").read_text()).body
               if isinstance(node, ast.Try)]
    assert any(isinstance(n, ast.Import) and n.names[0].name == "triton" for t in guarded for n in t.body)


def test_the_custom_ops_are_registered_once_and_reused():
    """A second registration (the kernel copy that folders saved by gated_qwen 0.1 ship, loaded as remote code)
    reuses the ops of the first instead of failing on a name torch already holds."""
    from gated_qwen.kernel import parallel

    assert parallel._define_ops() == (parallel._gated_attention_fwd_op, parallel._gated_attention_bwd_op)
    assert parallel._gated_attention_fwd_op is torch.ops.gated_qwen.gated_attention_fwd.default


@pytest.mark.slow  # a fresh interpreter
def test_the_kernel_and_its_backend_import_without_triton(tmp_path):
    """With `import triton` failing, the subpackage and the attention backend import, say so, and the kernel raises
    a clear error; the Triton modules are never imported and the model's default attention is SDPA."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from gated_qwen import kernel\n"
        "from gated_qwen.integrations import gated_triton\n"
        "assert not kernel.triton_available()\n"
        "assert not {'gated_qwen.kernel.parallel', 'gated_qwen.kernel.decoding'} & set(sys.modules)\n"
        "q = torch.randn(1, 4, 2, 16)\n"
        "assert kernel.gated_attention_unsupported_reason(q, q, q) == 'Triton is not installed'\n"
        "try:\n"
        "    kernel.gated_attention(q, q, q)\n"
        "except RuntimeError as e:\n"
        "    assert 'Triton is not installed' in str(e) and 'gated-qwen[triton]' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
        "from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM\n"
        "config = GatedQwenConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,\n"
        "                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)\n"
        "assert GatedQwenForCausalLM(config).config._attn_implementation == 'sdpa'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr


def test_every_launch_names_its_floating_point_fusion(monkeypatch):
    """Each kernel launch (forward, the three backward kernels, both decode kernels) gives Triton `enable_fp_fusion`
    (on): Triton 3.9 warns at every compile where a launch leaves it to the default, which turns off in 3.10."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = []
    run = InterpretedFunction.run

    def recording_run(self, *args, **kwargs):
        launches.append((self.fn.__name__, kwargs.get("enable_fp_fusion")))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    run_both(*make_inputs(1, 40, 40, 2, 1, 32, "elementwise"), causal=True)  # forward and backward
    run_both(*make_inputs(1, 1, 40, 2, 1, 32, "elementwise"), causal=True)  # decode forward
    assert {name for name, _ in launches} == {"forward_kernel", "preprocess_kernel", "dkdv_kernel", "dq_kernel",
                                              "split_kernel", "combine_kernel"}
    assert {fusion for _, fusion in launches} == {True}
