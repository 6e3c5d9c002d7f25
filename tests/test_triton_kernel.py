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

pytest.importorskip("triton")

from gated_qwen import triton_gated_attention as tga
from gated_qwen.naive_gated_attention import naive_gated_attention
from gated_qwen.triton_gated_attention import gated_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not tga.INTERPRET:
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


@pytest.mark.parametrize("gate_kind", ["elementwise", "headwise", None])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (4, 1), (3, 1)], ids=["mha", "gqa2", "gqa4", "gqa3"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dense_matrix(causal, heads, gate_kind):
    h_q, h_kv = heads
    assert_matches(*make_inputs(1, 100, 100, h_q, h_kv, 64, gate_kind), causal=causal)


@pytest.mark.parametrize("d", [128, 96, 32])
def test_other_head_dims(d):
    """128 is the main target; 96 and 32 exercise the padded head-dim path (BLOCK_D > D, or D < 64)."""
    assert_matches(*make_inputs(1, 80, 80, 4, 2, d, "elementwise"), causal=True)


def test_head_dim_too_large_is_a_clear_error():
    q, k, v, g = make_inputs(1, 8, 8, 2, 1, 512, "headwise")
    with pytest.raises(ValueError, match=r"head dim 512 is not supported.*1\.\.256"):
        gated_attention(q, k, v, g)
    assert not tga.gated_attention_supported(q, k, v, g)


@pytest.mark.parametrize("s_q,s_k", [(64, 150), (130, 70)], ids=["chunked-prefill", "more-queries-than-keys"])
def test_bottom_right_causal_alignment(s_q, s_k):
    q, k, v, g = make_inputs(2, s_q, s_k, 4, 2, 64, "elementwise")
    out, _ref, grads = assert_matches(q, k, v, g, causal=True)
    if s_q > s_k:  # query rows i < S_q - S_k see no key: exactly zero output and zero gradients
        blind = s_q - s_k
        assert out[:, :blind].abs().max().item() == 0.0
        assert grads[0][0][:, :blind].abs().max().item() == 0.0  # dq
        assert grads[3][0][:, :blind].abs().max().item() == 0.0  # dgate


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


@pytest.mark.parametrize("logits", ["plus40", "minus40", "mixed"])
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


@pytest.mark.parametrize("gate_kind", ["elementwise", "headwise"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
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


@pytest.mark.parametrize("gate_kind", ["elementwise", "headwise"])
@pytest.mark.parametrize("heads", [(4, 1), (3, 1), (8, 2)], ids=["gqa4", "gqa3", "gqa4x2"])
def test_decode_one_query_against_long_cache(heads, gate_kind):
    """S_q = 1 takes the split-KV decode kernel (GQA group in tile rows); backward goes through the general path."""
    h_q, h_kv = heads
    assert_matches(*make_inputs(2, 1, 200, h_q, h_kv, 64, gate_kind), causal=True)


def test_decode_varlen_with_empty_sequence():
    """Packed decode: one query per sequence (one sequence has none, one has an empty cache)."""
    lens_q, lens_k = [1, 0, 1, 1], [150, 40, 0, 90]
    q, k, v, g = make_inputs(0, 0, 0, 4, 2, 64, "elementwise", packed_q=sum(lens_q), packed_k=sum(lens_k))
    out, _ref, _grads = assert_matches(q, k, v, g, causal=True, cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k))
    assert out[1].abs().max().item() == 0.0  # the query of sequence 2 (empty cache) sees nothing


# ------------------------------------------------------------------------------------------------------------------
# Low precision
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("gate_kind", ["elementwise", "headwise"])
def test_half_precision(dtype, gate_kind):
    """fp16 runs natively; bf16 is upcast to fp32 after loading under the interpreter (its bf16 math is broken)."""
    assert_matches(*make_inputs(2, 100, 100, 4, 2, 64, gate_kind, dtype=dtype), causal=True)


def test_half_precision_decode_bf16():
    assert_matches(*make_inputs(1, 1, 150, 4, 1, 128, "elementwise", dtype=torch.bfloat16), causal=True)


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


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
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
# Packaging: the kernel file travels to the Hub beside the modeling file, and Triton is optional
# ------------------------------------------------------------------------------------------------------------------


def test_flat_copy_imports_and_reuses_the_registered_ops(tmp_path):
    """Copied into another package (as Hub remote code is), the module imports and runs on the same custom ops."""
    import importlib
    import shutil
    import sys
    from pathlib import Path

    src = Path(tga.__file__).parent
    pkg = tmp_path / "hub_copy_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("triton_gated_attention.py", "naive_gated_attention.py"):
        shutil.copy(src / name, pkg / name)
    assert "gated_qwen" not in (pkg / "triton_gated_attention.py").read_text().replace('"gated_qwen"', "")
    sys.path.insert(0, str(tmp_path))
    try:
        copy = importlib.import_module("hub_copy_pkg.triton_gated_attention")
        q, k, v, g = make_inputs(1, 20, 20, 2, 1, 64, "headwise")
        assert torch.equal(copy.gated_attention(q, k, v, g), gated_attention(q, k, v, g))
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("hub_copy_pkg")]:
            del sys.modules[name]


def test_module_imports_without_triton(tmp_path):
    """With `import triton` failing, the module still imports, reports it, and the kernel raises a clear error.

    Runs the two files as a flat package (as on the Hub) in a fresh interpreter, without importing Transformers."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    pkg = tmp_path / "flat_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("triton_gated_attention.py", "naive_gated_attention.py"):
        shutil.copy(Path(tga.__file__).parent / name, pkg / name)
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from flat_pkg import triton_gated_attention as t\n"
        "import torch\n"
        "assert not t.triton_available()\n"
        "q = torch.randn(1, 4, 2, 16)\n"
        "assert t.gated_attention_unsupported_reason(q, q, q) == 'Triton is not installed'\n"
        "try:\n"
        "    t.gated_attention(q, q, q)\n"
        "except RuntimeError as e:\n"
        "    assert 'Triton is not installed' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
