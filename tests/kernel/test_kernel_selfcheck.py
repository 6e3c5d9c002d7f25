"""The gated_triton backend trusts the kernel only after a self-check per combination (GATED_QWEN_KERNEL=check|trust|
off): a deliberately broken kernel (monkeypatched) makes the model fall back to SDPA + a separate gate, warn once, and
give SDPA's logits and gradients. Runs under the Triton interpreter on a CPU (tests/conftest.py)."""

import copy
import logging

import pytest
import torch

pytest.importorskip("triton", reason="needs the triton extra: pip install 'gated-qwen[triton]'")

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, kernel
from gated_qwen.kernel import attention, inputs, parallel
from gated_qwen.kernel.selfcheck import LAYOUTS, Combination, combination_of, self_check
from tests.helpers import SMALL, KernelLaunch, kernel_launches, sizes

if not kernel.triton_available():
    pytest.skip("no CUDA device and TRITON_INTERPRET was not set before import", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
VOCAB = 101
TOL = 2e-5 if DTYPE == torch.float32 else 3e-2


def model_pair(seed=0, **overrides):
    """(sdpa model, gated_triton model), same random weights, eval mode."""
    fields = sizes(SMALL, vocab_size=VOCAB, **overrides)
    torch.manual_seed(seed)
    sdpa = GatedQwenForCausalLM(GatedQwenConfig(**fields)).to(DEVICE, DTYPE)
    sdpa.set_attn_implementation("sdpa")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sdpa.named_parameters():
            param.copy_(name.endswith("norm.weight") + 0.1 * torch.randn(param.shape, generator=generator))
    fused = copy.deepcopy(sdpa)
    fused.set_attn_implementation("gated_triton")
    return sdpa.eval(), fused.eval()


def ids(batch=2, length=24, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def logits_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids).logits
    torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), input_ids.roll(-1, 1)).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_as_sdpa(sdpa, fused, input_ids):
    (logits_s, grads_s), (logits_f, grads_f) = logits_and_grads(sdpa, input_ids), logits_and_grads(fused, input_ids)
    assert rel_err(logits_f, logits_s) <= TOL
    bad = {n: e for n in grads_s if (e := rel_err(grads_f[n], grads_s[n])) > TOL}
    assert not bad, f"gradients differ from sdpa: {bad}"
    return logits_f


@pytest.fixture
def fresh_verdicts(monkeypatch):
    """No combination checked yet, the default mode, and the backend's warnings captured."""
    verdicts = {}
    monkeypatch.setattr(attention, "SELF_CHECK_VERDICTS", verdicts)
    monkeypatch.delenv(attention.KERNEL_MODE_VARIABLE, raising=False)
    return verdicts


@pytest.fixture
def kernel_calls():
    """The backend's calls of the fused kernel during the test (`helpers.kernel_launches`)."""
    with kernel_launches() as launches:
        yield launches


def break_forward(monkeypatch, how="wrong"):
    """A deliberately broken kernel: the forward launcher returns outputs 10% too large, or raises as a failed
    compilation would."""
    original = parallel.forward

    def broken(*args):
        if how == "raise":
            raise RuntimeError("PTX .version 9.9 does not support .target sm_90 (simulated compile failure)")
        out, lse = original(*args)
        return out * 1.1, lse

    monkeypatch.setattr(parallel, "forward", broken)


def self_check_warnings(caplog):
    return [r for r in caplog.records if "failed its self-check" in r.getMessage()]


# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["wrong", pytest.param("raise", marks=pytest.mark.slow)])
def test_broken_kernel_falls_back_to_sdpa_and_warns_once(monkeypatch, caplog, fresh_verdicts, kernel_calls, how):
    break_forward(monkeypatch, how)
    sdpa, fused = model_pair()
    with caplog.at_level(logging.WARNING, logger=attention.logger.name):
        for step in range(2):  # the second step reuses the verdict: no second check, no second warning
            assert_same_as_sdpa(sdpa, fused, ids(seed=step))
    warnings = self_check_warnings(caplog)
    assert len(warnings) == 1, [w.getMessage() for w in warnings]
    message = warnings[0].getMessage()
    assert "dense" in message and "causal" in message and "elementwise gate" in message
    assert ("out error" in message) if how == "wrong" else ("simulated compile failure" in message)
    assert "gpu_check.py" in message and "GATED_QWEN_KERNEL" in message  # how to report it, how to switch
    assert not kernel_calls  # the model never called the failing kernel
    (verdict,) = fresh_verdicts.values()
    assert verdict and verdict in message


def test_a_failing_combination_does_not_disable_the_others(monkeypatch, caplog, fresh_verdicts, kernel_calls):
    """Only the decode kernel is broken: prefill keeps the fused kernel, the decode steps fall back, and the tokens
    equal sdpa's."""
    original = parallel.decode_forward

    def broken_decode(*args):
        out, lse = original(*args)
        return out * 0.5, lse

    monkeypatch.setattr(parallel, "decode_forward", broken_decode)
    sdpa, fused = model_pair(seed=3)
    input_ids = ids(batch=2, length=10, seed=4)
    kwargs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "max_new_tokens": 5,
              "do_sample": False, "pad_token_id": 0}
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger=attention.logger.name):
        expected = sdpa.generate(**kwargs)
        tokens = fused.generate(**kwargs)
    assert torch.equal(tokens, expected)
    assert len(kernel_calls) == 2  # 2 layers × the prefill; the 4 decode steps of each layer fell back
    assert {c.layout.endswith("decode"): v is None for c, v in fresh_verdicts.items()} == {False: True, True: False}
    assert all("out error" in v for c, v in fresh_verdicts.items() if c.layout.endswith("decode"))
    assert len(self_check_warnings(caplog)) == 1


def test_trust_skips_the_check_and_off_never_runs_the_kernel(monkeypatch, fresh_verdicts, kernel_calls):
    break_forward(monkeypatch)
    sdpa, fused = model_pair()
    monkeypatch.setenv("GATED_QWEN_KERNEL", "trust")
    logits_trusted = logits_and_grads(fused, ids())[0]
    assert kernel_calls and not fresh_verdicts  # the broken kernel ran unchecked ...
    assert rel_err(logits_trusted, logits_and_grads(sdpa, ids())[0]) > 1e-3  # ... and its logits are wrong
    kernel_calls.clear()
    monkeypatch.setenv("GATED_QWEN_KERNEL", "off")
    assert_same_as_sdpa(sdpa, fused, ids())
    assert not kernel_calls and not fresh_verdicts
    monkeypatch.setenv("GATED_QWEN_KERNEL", "sometimes")
    with pytest.raises(ValueError, match="GATED_QWEN_KERNEL='sometimes' is not one of check, trust, off"):
        fused(input_ids=ids())


def test_working_kernel_passes_its_check_and_is_used(fresh_verdicts, kernel_calls):
    sdpa, fused = model_pair(gate_granularity="headwise")
    assert_same_as_sdpa(sdpa, fused, ids())
    assert kernel_calls == [KernelLaunch("headwise", packed=False, max_queries=24)] * 2  # both layers
    assert list(fresh_verdicts.values()) == [None]
    (combo,) = fresh_verdicts
    assert (combo.gate, combo.causal, combo.layout, combo.head_dim, combo.dtype) == (
        "headwise", True, "dense", 16, DTYPE)


@pytest.mark.parametrize("layout", [layout if layout == "dense" else pytest.param(layout, marks=pytest.mark.slow)
                                    for layout in LAYOUTS])
def test_self_check_passes_the_working_kernel_and_catches_a_wrong_gradient(monkeypatch, layout):
    """Every layout's check problem runs and matches; a kernel whose dq alone is 1% off is caught by name."""
    combo = Combination(DEVICE, DTYPE, 64, "elementwise", True, layout)
    assert self_check(combo) is None
    original = parallel.backward

    def dq_off(*args):
        dq, dk, dv, dg = original(*args)
        return dq * 1.01, dk, dv, dg

    monkeypatch.setattr(parallel, "backward", dq_off)
    failure = self_check(combo)
    assert failure is not None and failure.startswith("dq error") and "dk" not in failure


def test_combination_of_a_call():
    q = torch.empty(2, 5, 4, 64)
    assert combination_of(q, None, True, False, 5) == Combination("cpu", torch.float32, 64, None, True, "dense")
    gate = torch.empty(2, 5, 4, 1)
    assert combination_of(q, gate, False, True, 1).layout == "varlen-decode"
    assert combination_of(q, gate, False, True, 1).gate == "headwise"
    assert combination_of(q[:, :1], q, True, False, 1) == Combination("cpu", torch.float32, 64, "elementwise", True,
                                                                        "decode")


@pytest.mark.parametrize("head_dim, gate_width, kind", [(64, 64, "elementwise"), (64, 1, "headwise"),
                                                         (1, 1, "elementwise")])
def test_one_rule_names_the_gate_for_the_self_check_the_launch_and_the_tests(head_dim, gate_width, kind):
    """`inputs.gate_kind` is what the self-check's combination, the kernels' GATE_HEADWISE launch flag and the tests'
    record of a launch say: with head dim 1 a `[..., 1]` gate is elementwise (one logit per element) everywhere."""
    q, gate = torch.zeros(1, 3, 2, head_dim), torch.zeros(1, 3, 2, gate_width)
    assert inputs.gate_kind(gate, head_dim) == kind and inputs.gate_kind(None, head_dim) is None
    assert combination_of(q, gate, True, False, 3).gate == kind
    assert inputs.flag_heuristics()["GATE_HEADWISE"]({"G": gate, "HEAD_DIM": head_dim}) == (kind == "headwise")
    with kernel_launches() as launches:
        attention.gated_attention(q, q, q, gate, causal=True)
    assert launches == [KernelLaunch(kind, False, 3)]


@pytest.mark.slow  # torch.compile
def test_compiled_model_uses_the_verdicts_of_eager_calls(monkeypatch, fresh_verdicts):
    """Under torch.compile(fullgraph=True) the dispatch adds no graph break: a combination checked eagerly keeps its
    verdict (here: failed, so the compiled model runs SDPA + gate), an unchecked one runs the kernel."""
    break_forward(monkeypatch)
    sdpa, fused = model_pair()
    x = ids()
    with torch.no_grad():
        expected = sdpa(input_ids=x).logits
        assert rel_err(fused(input_ids=x).logits, expected) <= TOL  # eager: checked, failed, fell back
        torch._dynamo.reset()
        compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
        assert rel_err(compiled(input_ids=x).logits, expected) <= TOL
    torch._dynamo.reset()


@pytest.mark.skipif(DEVICE == "cuda", reason="simulates a GPU on the CPU")
def test_fp32_on_a_gpu_is_refused_with_the_dtypes_to_use_and_runs_sdpa(monkeypatch, caplog, kernel_calls):
    """The kernels are compiled for 16-bit tensor cores only: fp32 inputs on a GPU get a reason naming bf16/fp16 and
    the backend runs SDPA + gate (simulated here: the tensors count as on a GPU, the interpreter as absent)."""
    monkeypatch.setattr(inputs, "_on_gpu", lambda t: True)
    monkeypatch.setattr(inputs, "INTERPRET", False)
    q = torch.randn(1, 8, 2, 64)
    reason = inputs.gated_attention_unsupported_reason(q, q, q)
    assert "fp32" in reason and "torch.bfloat16" in reason and "torch.float16" in reason
    assert inputs.gated_attention_unsupported_reason(q.half(), q.half(), q.half()) is None
    sdpa, fused = model_pair()
    with caplog.at_level(logging.WARNING, logger=attention.logger.name):
        assert_same_as_sdpa(sdpa, fused, ids())
    assert not kernel_calls
    assert any("bfloat16" in r.getMessage() and "SDPA" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("inputs", ["left-padding", "packed"])
def test_fallback_keeps_padding_and_packing(monkeypatch, fresh_verdicts, kernel_calls, inputs):
    """The SDPA fallback masks what the kernel would: padded keys (and gives padded query rows zeros), and the
    boundaries of packed sequences (DataCollatorWithFlattening's cu_seq_lens)."""
    from transformers import DataCollatorWithFlattening

    break_forward(monkeypatch)
    sdpa, fused = model_pair(seed=5)
    if inputs == "left-padding":
        input_ids = ids(batch=3, length=20, seed=6)
        mask = torch.ones_like(input_ids)
        mask[0, :7] = 0
        batch = {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp_min(0)}
        keep = mask.bool()
    else:
        sequences = [ids(batch=1, length=n, seed=10 + n)[0].tolist() for n in (9, 17, 1, 12)]
        collated = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s} for s in sequences])
        batch = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in collated.items() if k != "labels"}
        batch["use_cache"] = False
        keep = torch.ones(batch["input_ids"].shape, dtype=torch.bool, device=DEVICE)
    with torch.no_grad():
        expected, got = sdpa(**batch).logits, fused(**batch).logits
    assert rel_err(got[keep], expected[keep]) <= TOL and torch.isfinite(got).all()
    assert not kernel_calls and fresh_verdicts and all(v is not None for v in fresh_verdicts.values())


def test_self_check_runs_under_inference_mode():
    """Pipelines call models under torch.inference_mode(): the check still builds its own graph and passes."""
    with torch.inference_mode():
        assert self_check(Combination(DEVICE, DTYPE, 32, "headwise", False, "dense")) is None
