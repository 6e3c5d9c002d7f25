"""The core model against independent references: stock Qwen3 / Llama / Qwen3.5 with the same weights, and the
paper's formula for every gate variant written out here in plain PyTorch."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForQuestionAnswering,
    Qwen3ForSequenceClassification,
    Qwen3ForTokenClassification,
)

from gated_qwen import (
    GatedQwenConfig,
    GatedQwenForCausalLM,
    GatedQwenForQuestionAnswering,
    GatedQwenForSequenceClassification,
    GatedQwenForTokenClassification,
    GatedQwenModel,
    GatedQwenMoeConfig,
    GatedQwenMoeForCausalLM,
)
from gated_qwen.model.gating import gate_parameters_per_layer
from tests.helpers import SMALL, bare_environment, gate_variants, randomize_, sizes

VOCAB = SMALL["vocab_size"]


def tiny(**overrides) -> dict:
    return sizes(SMALL, **overrides)


def gated(attn="sdpa", seed=0, **overrides) -> GatedQwenForCausalLM:
    torch.manual_seed(seed)
    model = GatedQwenForCausalLM(GatedQwenConfig(**tiny(**overrides)))
    model.set_attn_implementation(attn)
    return randomize_(model, seed).eval()


def ids(batch=2, length=24, seed=1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------- stock-model equivalence
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_key_value_heads=4),  # MHA
        dict(num_key_value_heads=2),  # GQA 2:1
        dict(num_key_value_heads=1, tie_word_embeddings=True),  # GQA 4:1, tied
        dict(rope_parameters=YARN),
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
        dict(attention_bias=True),
    ],
    ids=["mha", "gqa2", "gqa4-tied", "yarn", "sliding", "bias"],
)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_no_gate_equals_stock_qwen3(overrides, attn):
    reference = randomize_(Qwen3ForCausalLM(Qwen3Config(**tiny(**overrides))), seed=3).eval()
    reference.set_attn_implementation(attn)
    ours = GatedQwenForCausalLM(GatedQwenConfig(**tiny(gate_position=None, **overrides))).eval()
    ours.set_attn_implementation(attn)
    missing, unexpected = ours.load_state_dict(reference.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    x = ids(length=40)
    with torch.no_grad():
        assert (ours(x).logits - reference(x).logits).abs().max() <= 1e-5


def test_no_qk_norm_equals_stock_llama():
    """`use_qk_norm=False` is exactly a Llama decoder (same RMSNorm, RoPE, SwiGLU, GQA)."""
    reference = randomize_(LlamaForCausalLM(LlamaConfig(**tiny())), seed=4).eval()
    ours = GatedQwenForCausalLM(GatedQwenConfig(**tiny(gate_position=None, use_qk_norm=False))).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    assert not any("q_norm" in name for name, _ in ours.named_parameters())
    x = ids()
    with torch.no_grad():
        assert (ours(x).logits - reference(x).logits).abs().max() <= 1e-5


def to_qwen3_5_state_dict(ours: GatedQwenForCausalLM) -> dict[str, torch.Tensor]:
    """Hand-written Qwen3.5 layout: q_proj rows per head `[q_h | gate_h]`, RMSNorm weights zero-centred."""
    config = ours.config
    heads, dim = config.num_attention_heads, config.head_dim
    state = {}
    for name, tensor in ours.state_dict().items():
        if name.endswith("gate.g_proj.weight"):
            continue
        if name.endswith("q_proj.weight"):
            gate = ours.state_dict()[name.replace("q_proj", "gate.g_proj")]
            tensor = torch.cat([tensor.view(heads, dim, -1), gate.view(heads, dim, -1)], dim=1).reshape(2 * heads * dim, -1)
        elif "norm" in name:
            tensor = tensor - 1
        state[name] = tensor
    return state


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_default_gate_equals_stock_qwen3_5(kv_heads):
    ours = gated(num_key_value_heads=kv_heads, seed=5)
    assert ours.config.gate_position == "sdpa" and ours.config.gate_granularity == "elementwise"
    reference = Qwen3_5ForCausalLM(
        Qwen3_5TextConfig(**tiny(num_key_value_heads=kv_heads), layer_types=["full_attention"] * 2,
                          partial_rotary_factor=1.0)
    ).eval()
    missing, unexpected = reference.load_state_dict(to_qwen3_5_state_dict(ours), strict=True)
    x = ids(length=30)
    with torch.no_grad():
        assert (ours(x).logits - reference(x).logits).abs().max() <= 1e-5


HEADS = {
    "sequence": (Qwen3ForSequenceClassification, GatedQwenForSequenceClassification),
    "token": (Qwen3ForTokenClassification, GatedQwenForTokenClassification),
    "question-answering": (Qwen3ForQuestionAnswering, GatedQwenForQuestionAnswering),
}


@pytest.mark.parametrize("head", list(HEADS))
def test_task_heads_equal_stock_qwen3(head):
    """Qwen3's sequence-classification, token-classification and question-answering heads, same weights."""
    stock_class, our_class = HEADS[head]
    reference = randomize_(stock_class(Qwen3Config(**tiny(num_labels=3, pad_token_id=0))), seed=6).eval()
    ours = our_class(GatedQwenConfig(**tiny(gate_position=None, num_labels=3, pad_token_id=0))).eval()
    # Qwen3's question-answering head keeps its base model under `transformer.` (its note: for backward
    # compatibility); GatedQwen's heads all use `model.`, as every other Qwen3 head does.
    state = {re.sub(r"^transformer\.", "model.", name): tensor for name, tensor in reference.state_dict().items()}
    ours.load_state_dict(state, strict=True)
    x = ids()
    x[0, -5:] = 0  # right padding: a sequence's score is taken at its last non-pad token
    with torch.no_grad():
        expected, got = reference(x), ours(x)
    names = ("start_logits", "end_logits") if head == "question-answering" else ("logits",)
    for name in names:
        assert (getattr(got, name) - getattr(expected, name)).abs().max() <= 1e-5, name


@pytest.mark.parametrize("head", list(HEADS))
def test_task_heads_are_registered_with_their_auto_classes(head, tmp_path):
    from transformers import (
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    auto = {"sequence": AutoModelForSequenceClassification, "token": AutoModelForTokenClassification,
            "question-answering": AutoModelForQuestionAnswering}[head]
    config = GatedQwenConfig(**tiny(num_labels=3))
    assert type(auto.from_config(config)) is HEADS[head][1]
    config.save_pretrained(tmp_path)
    assert auto.__name__ in GatedQwenConfig.from_pretrained(tmp_path).auto_map


# ------------------------------------------------------------------------------- the paper's formula, by hand
ACTIVATIONS = {
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "ns_sigmoid": lambda t: 0.5 + 0.5 * torch.sigmoid(t),
    "identity": lambda t: t,
}


def rms(t, weight, eps):
    return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))


def rope(t, cos, sin):  # t: [B, S, heads, D], cos/sin: [B, S, D]
    half = t.shape[-1] // 2
    rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return t * cos[:, :, None] + rotated * sin[:, :, None]


def paper_attention(attn, config, x, cos, sin):
    """Y' = Y ⊙ act(X W) (or Y + act(X W)) at the configured position, written from the paper.

    `x: [B, S, hidden]` is the hidden state after the pre-attention norm -> `[B, S, hidden]`.
    """
    B, S, hidden = x.shape
    H, K, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    position = config.gate_position
    act = ACTIVATIONS[config.gate_activation]

    def scores(target_heads, width):
        if config.gate_input_dependent:
            logits = x @ attn.gate.g_proj.weight.T
            if config.gate_bias:
                logits = logits + attn.gate.g_proj.bias
        else:
            logits = attn.gate.logits.reshape(1, 1, -1).expand(B, S, -1)
        heads = 1 if config.gate_shared_across_heads else target_heads
        return act(logits.reshape(B, S, heads, width))

    def combine(y, s):
        return y * s if config.gate_combine == "multiply" else y + s

    width = D if config.gate_granularity == "elementwise" else 1
    q = (x @ attn.q_proj.weight.T).reshape(B, S, H, D)
    k = (x @ attn.k_proj.weight.T).reshape(B, S, K, D)
    v = (x @ attn.v_proj.weight.T).reshape(B, S, K, D)
    if position == "query":
        q = combine(q, scores(H, width))
    if position == "key":
        k = combine(k, scores(K, width))
    if position == "value":
        v = combine(v, scores(K, width))
    q = rope(rms(q, attn.q_norm.weight, config.rms_norm_eps), cos, sin)
    k = rope(rms(k, attn.k_norm.weight, config.rms_norm_eps), cos, sin)
    k, v = k.repeat_interleave(H // K, dim=2), v.repeat_interleave(H // K, dim=2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    logits = logits.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.einsum("bhqk,bkhd->bqhd", logits.softmax(-1), v)
    if position == "sdpa":
        y = combine(y, scores(H, width))
    if config.sdpa_output_transform == "rmsnorm":
        y = rms(y, attn.gate.sdpa_norm.weight, config.rms_norm_eps)
    if config.sdpa_output_transform == "silu":
        y = F.silu(y)
    out = y.reshape(B, S, H * D) @ attn.o_proj.weight.T
    if position == "dense":
        out = combine(out, scores(1, hidden).reshape(B, S, hidden))
    return out


VARIANTS = gate_variants()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_attention_output_matches_paper_formula(variant):
    model = gated(seed=7, **VARIANTS[variant])
    if model.config.gate_input_dependent is False:
        with torch.no_grad():  # a zero-initialised logit would not show the gate's broadcasting
            for layer in model.model.layers:
                layer.self_attn.gate.logits.normal_()
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(8))
    position_ids = torch.arange(11)[None].expand(2, -1)
    cos, sin = model.model.rotary_emb(x, position_ids)
    with torch.no_grad():
        out, _ = attn(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None)
        expected = paper_attention(attn, model.config, x, cos, sin)
    assert (out - expected).abs().max() <= 1e-5


def added_parameters(**gate_fields) -> int:
    config = GatedQwenConfig(**tiny(num_hidden_layers=3, **gate_fields))
    baseline = GatedQwenConfig(**tiny(num_hidden_layers=3, gate_position=None))
    with torch.device("meta"):
        return GatedQwenModel(config).num_parameters() - GatedQwenModel(baseline).num_parameters()


def test_parameter_counts_follow_the_papers_arithmetic():
    hidden, H, K, D, L = 64, 4, 2, 16, 3
    assert added_parameters() == hidden * H * D * L  # G1 elementwise
    assert added_parameters(gate_granularity="headwise") == hidden * H * L
    assert added_parameters(gate_position="value") == hidden * K * D * L  # G2 elementwise
    assert added_parameters(gate_position="value", gate_granularity="headwise") == hidden * K * L
    assert added_parameters(gate_position="key") == hidden * K * D * L
    assert added_parameters(gate_position="query") == hidden * H * D * L
    assert added_parameters(gate_position="dense") == hidden * hidden * L  # G5
    assert added_parameters(gate_shared_across_heads=True) == hidden * D * L
    assert added_parameters(gate_input_dependent=False) == H * D * L
    assert added_parameters(gate_bias=True) == (hidden + 1) * H * D * L
    assert added_parameters(gate_layers=[0, 2]) == hidden * H * D * 2
    assert added_parameters(gate_position=None, sdpa_output_transform="rmsnorm") == D * L
    assert added_parameters(gate_position=None, sdpa_output_transform="silu") == 0


def test_paper_scale_gate_parameters():
    """Table 1: G1 elementwise on the 15B MoE (24 layers, d 2048, 32 heads of 128) adds 201M; headwise 1.6M."""
    moe_attention = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_hidden_layers=24)
    assert round(gate_parameters_per_layer(GatedQwenConfig(**moe_attention)) * 24 / 1e6) == 201
    headwise = GatedQwenConfig(**moe_attention, gate_granularity="headwise")
    assert round(gate_parameters_per_layer(headwise) * 24 / 1e5) == 16
    assert round(gate_parameters_per_layer(GatedQwenConfig(**moe_attention, gate_position="value")) * 24 / 1e6) == 25
    assert round(gate_parameters_per_layer(GatedQwenConfig(**moe_attention, gate_position="dense")) * 24 / 1e6) == 101


@pytest.mark.parametrize("preset", ["dense-1.7b-28l", "dense-1.7b-48l"])
def test_paper_presets_keep_the_parameter_count(preset):
    with torch.device("meta"):
        baseline = GatedQwenForCausalLM(GatedQwenConfig.from_paper(preset, gate_position=None))
        for gate in (dict(), dict(gate_granularity="headwise"), dict(gate_position="value")):
            config = GatedQwenConfig.from_paper(preset, **gate)
            model = GatedQwenForCausalLM(config)
            # within one FFN row-triple per layer of the baseline
            assert abs(model.num_parameters() - baseline.num_parameters()) <= 3 * config.hidden_size * config.num_hidden_layers
    assert 1.5e9 < baseline.num_parameters() < 2.1e9
    assert baseline.config.tie_word_embeddings and baseline.config.use_qk_norm
    assert GatedQwenConfig.from_paper(preset, intermediate_size=999).intermediate_size == 999
    with pytest.raises(ValueError, match="dense-1.7b-28l"):
        GatedQwenConfig.from_paper("dense-9b")


# -------------------------------------------------------------------------------------------------- backends
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_backends_agree_with_left_padding(variant):
    x = ids(length=16)
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    model = gated(attn="eager", seed=9, **VARIANTS[variant])
    with torch.no_grad():
        expected = model(x, attention_mask=mask).logits
        # padding must matter: the unpadded row would differ
        assert (model(x).logits[0, 5:] - expected[0, 5:]).abs().max() > 1e-3
        for attn in ("sdpa", "flex_attention"):
            model.set_attn_implementation(attn)
            got = model(x, attention_mask=mask).logits
            assert (got - expected)[mask.bool()].abs().max() <= 2e-5, attn


def test_training_gradients_agree_between_eager_and_sdpa():
    x = ids()
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    grads = {}
    for attn in ("eager", "sdpa"):
        model = gated(attn=attn, seed=10, gate_granularity="headwise").train()
        labels = x.clone()
        labels[1, :4] = -100  # pad positions, and the first real token (it would be predicted from a pad position)
        model(x, attention_mask=mask, labels=labels).loss.backward()
        grads[attn] = {name: p.grad for name, p in model.named_parameters()}
    for name, grad in grads["eager"].items():
        assert torch.allclose(grad, grads["sdpa"][name], atol=1e-5), name


# ------------------------------------------------------------------------------------------------ generation
@pytest.mark.parametrize("variant", ["G1-elementwise", "G2-headwise", "G5", "baseline"])
def test_generation_with_cache_equals_without(variant):
    model = gated(seed=11, **VARIANTS[variant])
    prompt = ids(batch=1, length=7)
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with_cache = model.generate(prompt, **kwargs)
    without_cache = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(with_cache, without_cache)
    static = model.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(with_cache, static)


def test_cache_reaches_the_model_during_generate():
    """The 5.x trap: a forward that only takes `past_key_values` silently loses the cache in `generate`."""
    model = gated(seed=12)
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("cache") is not None), with_kwargs=True
    )
    model.generate(ids(batch=1, length=5), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert seen and all(seen)
    # the deprecated name still works on a direct call
    with torch.no_grad():
        out = model(ids(batch=1, length=5), use_cache=True)
        step = model(ids(batch=1, length=1), past_key_values=out.cache)
    assert step.cache.get_seq_length() == 6


def test_left_padded_batch_generates_like_rows_alone():
    model = gated(seed=13)
    model.generation_config.pad_token_id = 0
    rows = [ids(batch=1, length=9, seed=2)[0], ids(batch=1, length=5, seed=3)[0]]
    batch = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, 9 - len(row):] = row
        mask[i, 9 - len(row):] = 1
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    together = model.generate(batch, attention_mask=mask, **kwargs)[:, 9:]
    for i, row in enumerate(rows):
        alone = model.generate(row[None], **kwargs)[0, len(row):]
        assert torch.equal(together[i], alone)


# ------------------------------------------------------------------------------------- saving and remote code
def test_save_load_round_trip(tmp_path):
    model = gated(seed=14, gate_granularity="headwise", gate_layers=[1])
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is GatedQwenForCausalLM
    assert loaded.config.gate_layers == [1] and loaded.config.gate_granularity == "headwise"
    x = ids()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    assert type(AutoConfig.from_pretrained(tmp_path)) is GatedQwenConfig


REMOTE_CODE_CHECK = r"""
import sys, torch
sys.modules["gated_qwen"] = None  # the package is not installed on this machine
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification
path, expected = sys.argv[1], torch.load(sys.argv[2])
config = AutoConfig.from_pretrained(path, trust_remote_code=True)
assert type(config).__module__.startswith("transformers_modules"), type(config).__module__
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
assert type(model).__name__ == "GatedQwenForCausalLM" and type(model).__module__.startswith("transformers_modules")
with torch.no_grad():
    assert torch.equal(model(expected["ids"]).logits, expected["logits"])
    base = AutoModel.from_pretrained(path, trust_remote_code=True)
    assert torch.equal(base(expected["ids"]).last_hidden_state, expected["hidden"])
classifier = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=True)
assert type(classifier).__name__ == "GatedQwenForSequenceClassification"
# It trains (the package's gradients, on the same weights and batch) and generates (the package's greedy tokens).
model.train()
model(expected["ids"], labels=expected["ids"]).loss.backward()
for name, grad in expected["grads"].items():
    assert torch.equal(model.get_parameter(name).grad, grad), name
model.eval()
with torch.no_grad():
    tokens = model.generate(expected["ids"][:, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
assert torch.equal(tokens, expected["generated"]), (tokens, expected["generated"])
# Without the package on a CUDA machine (simulated): SDPA + the gate, and one warning naming it and the fused kernel's
# package; the fused kernel asked for by name is refused with the same hint.
from transformers.utils import logging as hf_logging
torch.cuda.is_available = lambda: True
records = []
handler = __import__("logging").Handler()
handler.emit = records.append
hf_logging.get_logger("transformers_modules").addHandler(handler)
on_gpu = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
assert on_gpu.config._attn_implementation == "sdpa", on_gpu.config._attn_implementation
hints = [r.getMessage() for r in records if "gated-qwen[triton]" in r.getMessage()]
assert len(hints) == 1 and "'sdpa'" in hints[0] and "separate sigmoid gate" in hints[0], hints
try:
    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, attn_implementation="gated_triton")
except ValueError as error:
    assert "pip install 'gated-qwen[triton]'" in str(error), error
else:
    raise AssertionError("gated_triton was not refused")
print("remote code ok")
"""


@pytest.mark.slow  # a fresh interpreter or several processes
def test_remote_code_load_without_the_package(tmp_path):
    import subprocess
    import sys

    model = gated(seed=15)
    model.save_pretrained(tmp_path / "model")
    for name in ("configuration_gated.py", "modeling_gated.py"):
        assert (tmp_path / "model" / name).exists()
    x = ids()
    with torch.no_grad():
        expected = {"ids": x, "logits": model(x).logits, "hidden": model.model(x).last_hidden_state,
                    "generated": model.generate(x[:, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)}
    model.train()
    model(x, labels=x).loss.backward()
    expected["grads"] = {name: p.grad for name, p in model.named_parameters()
                         if ".gate." in name or name.endswith(("q_proj.weight", "embed_tokens.weight"))}
    torch.save(expected, tmp_path / "expected.pt")
    env = bare_environment(tmp_path / "hf_home")
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_CHECK, str(tmp_path / "model"), str(tmp_path / "expected.pt")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "remote code ok" in result.stdout


# ------------------------------------------------------------------------------- checkpointing and compilation
def test_gradient_checkpointing_gives_the_same_gradients():
    x = ids()
    grads = []
    for checkpointing in (False, True):
        model = gated(seed=16, gate_position="value").train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model(x, labels=x).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


def test_torch_compile_equals_eager():
    model = gated(seed=17)
    x = ids(length=12)
    with torch.no_grad():
        expected = model(x).logits
        compiled = torch.compile(model, fullgraph=True)
        assert (compiled(x).logits - expected).abs().max() <= 1e-5


# ------------------------------------------------------------------------------------ gate logits as outputs
def test_gate_logits_are_returned_per_layer_like_the_paper_computes_them():
    """`output_gate_logits=True` (Transformers' output capturing): per layer `X W_g`, X the layer's input after the
    pre-attention RMSNorm; None for a layer without a gate; learned constants for the input-independent gate."""
    model = gated(seed=18, num_hidden_layers=3, gate_layers=[0, 2])
    x = ids(length=10)
    with torch.no_grad():
        out = model(x, output_gate_logits=True, output_hidden_states=True)
        assert len(out.gate_logits) == 3 and out.gate_logits[1] is None
        for layer in (0, 2):
            block = model.model.layers[layer]
            normed = rms(out.hidden_states[layer], block.input_layernorm.weight, model.config.rms_norm_eps)
            expected = (normed @ block.self_attn.gate.g_proj.weight.T).view(*x.shape, 4, 16)
            torch.testing.assert_close(out.gate_logits[layer], expected, rtol=1e-5, atol=1e-5)
        assert model(x).gate_logits is None  # recorded only when asked

    constant = gated(seed=19, gate_input_dependent=False)
    with torch.no_grad():
        constant.model.layers[1].self_attn.gate.logits.normal_()
        logits = constant(x, output_gate_logits=True).gate_logits
    assert torch.equal(logits[1], constant.model.layers[1].self_attn.gate.logits)


# -------------------------------------------------------------------------------- tensor-parallel plan rules
def plan_rule_matches(model, rule: str) -> bool:
    pattern = re.compile(r"model\." + re.escape(rule).replace(r"\*", r"\d+") + r"$")
    names = [name for name, _ in model.named_modules()] + [name for name, _ in model.named_parameters()]
    return any(pattern.match(name) for name in names)


@pytest.mark.parametrize("fields", [
    *VARIANTS.values(),
    dict(use_qk_norm=False),
    dict(gate_shared_across_heads=True, gate_input_dependent=False),
    dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0]),
    dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24),
], ids=[*VARIANTS, "no-qk-norm", "shared-constant", "moe", "moe-and-dense", "moe-shared-expert"])
def test_every_tensor_parallel_rule_names_a_module_or_parameter(fields):
    moe = "num_experts" in fields
    with torch.device("meta"):
        model = (GatedQwenMoeForCausalLM if moe else GatedQwenForCausalLM)(
            (GatedQwenMoeConfig if moe else GatedQwenConfig)(**tiny(**fields)))
    plan = model.config.base_model_tp_plan
    unmatched = [rule for rule in plan if not plan_rule_matches(model, rule)]
    assert not unmatched, unmatched
    # and every linear layer of the attention and MLP is split, except the G5 gate and Qwen3-Next's shared-expert
    # gate, which act on the whole (all-reduced) hidden state and stay replicated
    replicated = ("shared_expert_gate", "gate.g_proj" if model.config.gate_position == "dense" else "-")
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers.0." in name and not name.endswith(replicated):
            assert re.sub(r"^model\.layers\.0\.", "layers.*.", name) in plan, name
    assert (model.config.base_model_ep_plan is None) == (not moe)
