"""attn_implementation="gated_triton": a tiny GatedQwen with the fused Triton kernel equals the same model with sdpa.

Logits and every parameter gradient in fp32, for each gate layout the kernel fuses (and for layouts it does not,
where it acts as plain attention), with left padding, with packed sequences (DataCollatorWithFlattening's
`cu_seq_lens_*` and restarting `position_ids`), and in cached generation (the decode kernel). Without a GPU the
kernel runs under the Triton interpreter (tests/conftest.py). The backend falls back to SDPA + gate when the kernel
fails its self-check, which gives sdpa's results too: every test also asserts, with `helpers.kernel_launches`, that
the kernel ran for each layer of the call under test, with the gate and layout the test is about.
"""

import copy

import pytest
import torch

pytest.importorskip("triton", reason="needs the triton extra: pip install 'gated-qwen[triton]'")

from transformers import DataCollatorWithFlattening

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, kernel
from gated_qwen.integrations import gated_triton
from gated_qwen.kernel import attention
from tests.helpers import SMALL, KernelLaunch, kernel_launches, sizes

if not kernel.triton_available():
    pytest.skip("no CUDA device and TRITON_INTERPRET was not set before import", allow_module_level=True)

VOCAB = 101
LAYERS = 2
TOL = 2e-5  # fp32; the fused kernel multiplies its fp32 accumulator, sdpa the rounded output: not bit-equal


def tiny(**overrides) -> GatedQwenConfig:
    return GatedQwenConfig(**sizes(SMALL, vocab_size=VOCAB, num_hidden_layers=LAYERS, **overrides))


def model_pair(seed=0, **overrides):
    """(sdpa model, gated_triton model) with identical random weights, fp32, eval mode."""
    torch.manual_seed(seed)
    sdpa = GatedQwenForCausalLM(tiny(**overrides))
    sdpa.set_attn_implementation("sdpa")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sdpa.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(base + 0.1 * torch.randn(param.shape, generator=generator))
    fused = copy.deepcopy(sdpa)
    fused.set_attn_implementation("gated_triton")
    assert fused.config._attn_implementation == "gated_triton" and sdpa.config._attn_implementation == "sdpa"
    return sdpa.eval(), fused.eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(model, keep=None, **inputs):
    """Logits, and the gradients of a cross-entropy over the positions in `keep` (bool [B, S]; default all)."""
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits
    labels = inputs["input_ids"].roll(-1, dims=1)
    weights = torch.ones(labels.shape) if keep is None else keep.float()
    loss = (torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none") * weights).sum()
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(sdpa, fused, keep=None, **inputs):
    logits_s, grads_s = run(sdpa, keep, **inputs)
    logits_f, grads_f = run(fused, keep, **inputs)
    mask = torch.ones(logits_s.shape[:2], dtype=torch.bool) if keep is None else keep
    assert rel_err(logits_f[mask], logits_s[mask]) <= TOL
    assert grads_s.keys() == grads_f.keys()
    bad = {n: e for n in grads_s if (e := rel_err(grads_f[n], grads_s[n])) > TOL}
    assert not bad, f"gradients differ: {bad}"
    return logits_f


def ids(batch=2, length=24, seed=1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------------------------


SLOW = pytest.mark.slow  # the fast set keeps the elementwise gate


@pytest.mark.parametrize(
    "overrides,fused_gate",
    [
        ({}, "elementwise"),  # the paper's best: elementwise G1, head-specific, input-dependent
        pytest.param({"gate_granularity": "headwise"}, "headwise", marks=SLOW),
        pytest.param({"gate_shared_across_heads": True}, "elementwise", marks=SLOW),  # an expand()ed view over heads
        # a learned [heads, width] logit, expand()ed over batch and time
        pytest.param({"gate_input_dependent": False}, "elementwise", marks=SLOW),
        pytest.param({"num_key_value_heads": 4}, "elementwise", marks=SLOW),  # MHA
        pytest.param({"gate_position": "value"}, None, marks=SLOW),  # not fusable: the backend runs plain attention
        pytest.param({"gate_activation": "silu"}, None, marks=SLOW),
        pytest.param({"gate_position": None}, None, marks=SLOW),
    ],
    ids=["elementwise", "headwise", "head-shared", "input-independent", "mha", "value-gate", "silu-gate", "no-gate"],
)
def test_equals_sdpa(overrides, fused_gate):
    sdpa, fused = model_pair(**overrides)
    with kernel_launches() as launches:
        assert_same(sdpa, fused, input_ids=ids())
    assert launches == [KernelLaunch(fused_gate, packed=False, max_queries=24)] * LAYERS


def test_left_padding():
    sdpa, fused = model_pair()
    input_ids = ids(batch=3, length=20)
    mask = torch.ones_like(input_ids)
    mask[0, :7] = 0
    mask[2, :1] = 0
    position_ids = (mask.cumsum(1) - 1).clamp_min(0)
    keep = mask.bool()
    with kernel_launches() as launches:
        logits = assert_same(sdpa, fused, keep=keep, input_ids=input_ids, attention_mask=mask,
                             position_ids=position_ids)
    assert launches == [KernelLaunch("elementwise", packed=True, max_queries=20)] * LAYERS  # the kept tokens
    assert torch.isfinite(logits).all()  # padded query rows see no key: zeros from the kernel, finite logits
    # Independent of sdpa's mask: the padded row equals the same tokens run alone without padding.
    with kernel_launches() as launches:
        alone = fused(input_ids=input_ids[:1, 7:]).logits.detach()
    assert launches == [KernelLaunch("elementwise", packed=False, max_queries=13)] * LAYERS
    assert rel_err(logits[0, 7:], alone[0]) <= TOL


@pytest.mark.parametrize("flash_kwargs", [True, pytest.param(False, marks=SLOW)], ids=["cu_seq_lens", "position_ids"])
def test_packed_sequences(flash_kwargs):
    sdpa, fused = model_pair(gate_granularity="headwise", seed=2)
    lengths = [9, 17, 1, 12]
    sequences = [ids(batch=1, length=n, seed=10 + i)[0].tolist() for i, n in enumerate(lengths)]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs, return_position_ids=True)
    batch = collator([{"input_ids": s} for s in sequences])
    assert ("cu_seq_lens_q" in batch) == flash_kwargs
    # use_cache=False: with a cache, Transformers' sdpa mask ignores packed position_ids (it only looks for packing
    # when no cache exists), and the forward creates a DynamicCache whenever use_cache is on.
    inputs = {k: v for k, v in batch.items() if k != "labels"} | {"use_cache": False}
    with kernel_launches() as launches:
        logits = assert_same(sdpa, fused, **inputs)
    assert launches == [KernelLaunch("headwise", packed=True, max_queries=17)] * LAYERS
    # Each packed sequence equals the sequence run alone (no cross-sequence attention).
    start = 0
    for s in sequences:
        alone = sdpa(input_ids=torch.tensor([s])).logits.detach()
        assert rel_err(logits[0, start:start + len(s)], alone[0]) <= TOL
        start += len(s)


def test_generation_with_left_padding_uses_the_decode_path():
    sdpa, fused = model_pair(seed=3)
    input_ids = ids(batch=2, length=12, seed=4)
    mask = torch.ones_like(input_ids)
    mask[1, :4] = 0
    kwargs = {"input_ids": input_ids, "attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = sdpa.generate(**kwargs)
        with kernel_launches() as launches:
            tokens = fused.generate(**kwargs)
    assert torch.equal(tokens, expected)
    # Each layer: the prefill, then 5 decode steps (one query per sequence: the decode kernel), all through the kernel.
    assert [launch.max_queries for launch in launches] == [12] * LAYERS + [1] * (5 * LAYERS)
    assert all(launch.gate == "elementwise" and launch.packed for launch in launches)  # the padding mask: varlen


def test_default_implementation(monkeypatch):
    config = tiny()
    assert GatedQwenForCausalLM(config).config._attn_implementation == (
        "gated_triton" if torch.cuda.is_available() else "sdpa")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gated_triton.runs_by_default(config)
    sliding = tiny(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert not gated_triton.runs_by_default(sliding)
    assert not gated_triton.runs_by_default(tiny(attention_dropout=0.1))
    monkeypatch.setattr(attention, "triton_available", lambda: False)
    assert not gated_triton.runs_by_default(config)


def test_unsupported_inputs_fall_back_to_the_reference(monkeypatch):
    sdpa, fused = model_pair()
    monkeypatch.setattr(attention, "gated_attention_unsupported_reason", lambda *a, **k: "pretend no Triton")
    with kernel_launches() as launches:
        assert_same(sdpa, fused, input_ids=ids())
    assert not launches


def test_clear_errors():
    _, fused = model_pair(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window"):
        fused(input_ids=ids())
    _, fused = model_pair()
    with pytest.raises(ValueError, match="2-D padding mask"):
        fused(input_ids=ids(), attention_mask=torch.zeros(2, 1, 24, 24))


SAVED_FOLDER_DISPATCH = r"""
import logging, sys, torch
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging as hf_logging

records = []
handler = logging.Handler()
handler.emit = records.append
hf_logging.get_logger("transformers_modules").addHandler(handler)
on_cpu = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
assert on_cpu.config._attn_implementation == "sdpa" and "gated_qwen" not in sys.modules  # no kernel on a CPU
torch.cuda.is_available = lambda: True  # the dispatch decision of a CUDA machine; the kernel runs interpreted
not_imported = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
assert not_imported.config._attn_implementation == "sdpa" and "gated_qwen" not in sys.modules
hints = [r for r in records if "then import gated_qwen" in r.getMessage()]
assert [r.levelno for r in hints] == [logging.WARNING], records  # what would give the fused kernel, said once

import gated_qwen  # registers the fused kernel in Transformers' attention registry
from tests.helpers import kernel_launches
model = type(not_imported).from_pretrained(sys.argv[1])  # the folder's own class (the Auto classes now give the package's)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
import gated_qwen.integrations.gated_triton as backend
assert model.config._attn_implementation == "gated_triton", model.config._attn_implementation
assert ALL_ATTENTION_FUNCTIONS["gated_triton"] is backend.gated_triton_attention_forward
expected = torch.load(sys.argv[2])
with torch.no_grad(), kernel_launches() as launches:
    logits = model(expected["ids"]).logits
assert len(launches) == model.config.num_hidden_layers, launches
assert (logits - expected["logits"]).abs().max() <= 2e-5 * expected["logits"].abs().max(), "logits differ"
print("package kernel ok")
"""


@pytest.mark.slow  # a fresh interpreter
def test_a_saved_folder_runs_the_packages_kernel_where_it_is_installed(tmp_path):
    """A folder's own modeling file (remote code), with the package installed: it never imports the package; on a
    CPU it runs sdpa; on a CUDA machine (simulated) it runs sdpa with one warning naming what would give the fused
    kernel until the package is imported, then takes the package's `gated_triton` kernel from Transformers'
    attention registry as its default attention (it launches, once per layer) and gives sdpa's logits."""
    import subprocess
    import sys
    from pathlib import Path

    sdpa, _ = model_pair()
    sdpa.save_pretrained(tmp_path / "model")
    x = ids()
    with torch.no_grad():
        torch.save({"ids": x, "logits": sdpa(x).logits}, tmp_path / "expected.pt")
    result = subprocess.run([sys.executable, "-c", SAVED_FOLDER_DISPATCH, str(tmp_path / "model"),
                             str(tmp_path / "expected.pt")], capture_output=True, text=True, timeout=600,
                            cwd=Path(__file__).parents[2])  # the repository: `tests` importable
    assert result.returncode == 0, result.stderr[-3000:]
    assert "package kernel ok" in result.stdout
