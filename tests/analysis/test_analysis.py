"""gated_qwen.analysis against brute force: F-Attn and attention maps against the eager attention weights
(`output_attentions=True`), M-Act against `output_hidden_states=True`, |SDPA output| and gate statistics against
values recomputed by hand from the weights, perplexity against a hand-written cross-entropy, YaRN against a model
built from a YaRN config, fake quantization against its formula written out here and a model quantized by hand,
recall accuracy against a count; the built-in corpora against their own rules; `reproduce`, `analyze` and `eval-ppl`
end to end through the CLI."""

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.analysis import SyntheticLanguage, analyze, first_token_attention, mean_nll, perplexity_by_length
from gated_qwen.analysis.measure import GATE_BINS, first_token_attention_per_query
from gated_qwen.analysis.miniature.corpora import HELDOUT_SEED, BigramBackcopy, KeyValueRecall, TrigramLanguage
from gated_qwen.analysis.miniature.presets import planned_runs
from gated_qwen.analysis.miniature.runs import loss_spikes, sink_profile
from gated_qwen.analysis.perplexity import recall_accuracy, with_yarn
from gated_qwen.analysis.quantize import SCHEMES, fake_quantize_rows, fake_quantized, perplexity_under_quantization
from gated_qwen.cli import main
from gated_qwen.model.gating import gate_shape, gated_layers
from tests.helpers import TINY, assert_refused, randomize_, refusal_line, sizes

VOCAB = 61


def model_for(seed=0, gate_scale=1.0, **overrides) -> GatedQwenForCausalLM:
    """A tiny float64 model with random weights (norms included); `gate_scale` widens the gate logits so that
    scores spread over (0, 1)."""
    fields = sizes(TINY, vocab_size=VOCAB, intermediate_size=48, max_position_embeddings=64,
                   **{"num_hidden_layers": 3, **overrides})
    torch.manual_seed(seed)
    model = randomize_(GatedQwenForCausalLM(GatedQwenConfig(**fields)), seed).double().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "gate.g_proj" in name or "gate.logits" in name:
                param.mul_(gate_scale)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.mul_(2.5)  # sharper attention than random weights give
    return model


def ids(batch=3, length=19, seed=1) -> torch.Tensor:
    x = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    x[:, 0] = 0
    return x


def eager_outputs(model, input_ids):
    """The attention weights `[B, Hq, S, S]` of every layer (eager attention, which takes its softmax in float32
    even in a float64 model: comparisons with them use float32 tolerances), and every layer's output before the
    final norm (from the model's own SDPA run, float64)."""
    with torch.no_grad():
        model.config.tie_last_hidden_states = False  # keep the last layer's output, not the normed one
        hidden = model(input_ids, output_hidden_states=True).hidden_states
        del model.config.tie_last_hidden_states
        model.set_attn_implementation("eager")
        attentions = model(input_ids, output_attentions=True).attentions
        model.set_attn_implementation("sdpa")
    return attentions, hidden


def rms_norm(x, weight, eps):
    """By hand, in float64; the model's RMSNorm (like Qwen3's) normalises in float32, so results built on it agree
    to float32 precision."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("overrides", [
    {},  # G1 elementwise
    {"gate_position": None},
    {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},  # layers 1, 2 slide
], ids=["g1", "baseline", "sliding-window"])
def test_first_token_attention_and_maps_match_eager_attention(overrides):
    model = model_for(**overrides)
    x = ids()
    result = analyze(model, x, batch_size=2, map_tokens=7)
    attentions, _ = eager_outputs(model, x)
    assert model.config._attn_implementation == "sdpa"  # restored after the analysis
    for layer, weights in enumerate(attentions):
        p0 = weights[:, :, 1:, 0]  # [B, Hq, S-1]: query 0 can only attend to itself
        entry = result["layers"][layer]
        torch.testing.assert_close(torch.tensor(entry["first_token_attention_per_head"], dtype=torch.float64),
                                   p0.mean(dim=(0, 2)), rtol=1e-5, atol=1e-6)
        assert entry["first_token_attention"] == pytest.approx(p0.mean().item(), abs=1e-6)
        torch.testing.assert_close(result["attention_maps"][layer], weights[:, :, :7, :7].mean(0), rtol=1e-5,
                                   atol=1e-6)
        torch.testing.assert_close(result["first_token_attention_by_position"][layer],
                                   weights[:, :, :, 0].mean(dim=(0, 1)), rtol=1e-5, atol=1e-6)
    assert result["summary"]["first_token_attention"] == pytest.approx(
        torch.stack([w[:, :, 1:, 0].mean() for w in attentions]).mean().item(), abs=1e-6)
    if "sliding_window" in overrides:
        assert (result["first_token_attention_by_position"][1:, 5:] == 0).all()  # key 0 left the window


@pytest.mark.parametrize("overrides", [{}, {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}],
                         ids=["g1", "sliding-window"])
def test_first_token_attention_per_query_matches_eager_attention(overrides):
    model = model_for(**overrides)
    x = ids()
    per_query = first_token_attention_per_query(model, x, batch_size=2)
    attentions, _ = eager_outputs(model, x)
    assert per_query.shape == (3, 3, 4, 19) and model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(per_query, torch.stack([w[..., 0] for w in attentions], dim=1).float(), rtol=1e-5,
                               atol=1e-6)


def test_first_token_attention_of_float32_long_rows_matches_softmax():
    """The fused-kernel route against a plain softmax, float32, GQA, a few hundred rows."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 300, 16, generator=g), torch.randn(2, 3, 300, 16, generator=g)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.3
    scores = scores.masked_fill(torch.ones(300, 300, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(first_token_attention(q, k, 0.3), scores.softmax(-1)[..., 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides", [{}, {"gate_position": None}], ids=["g1", "baseline"])
def test_max_activation_matches_hidden_states(overrides):
    model = model_for(**overrides)
    x = ids()
    result = analyze(model, x, batch_size=2)
    _, hidden = eager_outputs(model, x)
    for layer, entry in enumerate(result["layers"]):
        output = hidden[layer + 1].abs()  # hidden[0] is the embedding output
        assert entry["max_activation"] == pytest.approx(output.max().item(), rel=1e-12)
        assert entry["max_activation_position"] == output.amax(dim=(0, 2)).argmax().item()
        # the paper's massive activation sits at the first token: its largest |value| there and elsewhere
        assert entry["first_token_max_activation"] == pytest.approx(output[:, 0].max().item(), rel=1e-12)
        assert entry["other_max_activation"] == pytest.approx(output[:, 1:].max().item(), rel=1e-12)
    maxima = [output.abs().max().item() for output in hidden[1:]]
    assert result["summary"]["max_activation"] == pytest.approx(max(maxima), rel=1e-12)
    assert result["summary"]["mean_max_activation"] == pytest.approx(sum(maxima) / len(maxima), rel=1e-12)
    # ... in the non-final layers, whose output later layers read (the last layer's only the final norm does)
    assert len(hidden) - 1 == model.config.num_hidden_layers > 1
    assert result["summary"]["first_token_max_activation_nonfinal"] == pytest.approx(
        max(output[:, 0].abs().max().item() for output in hidden[1:-1]), rel=1e-12)
    assert result["summary"]["other_max_activation_nonfinal"] == pytest.approx(
        max(output[:, 1:].abs().max().item() for output in hidden[1:-1]), rel=1e-12)
    one_layer = analyze(model_for(num_hidden_layers=1, **overrides), x)["summary"]
    assert one_layer["first_token_max_activation_nonfinal"] is one_layer["other_max_activation_nonfinal"] is None


def test_sdpa_output_before_and_after_the_gate_match_a_hand_computation():
    model = model_for(gate_scale=8.0)
    config = model.config
    x = ids()
    result = analyze(model, x, batch_size=3)
    attentions, hidden = eager_outputs(model, x)
    groups = config.num_attention_heads // config.num_key_value_heads
    for layer, block in enumerate(model.model.layers):
        normed = rms_norm(hidden[layer], block.input_layernorm.weight, config.rms_norm_eps)
        v = (normed @ block.self_attn.v_proj.weight.T).view(*x.shape, config.num_key_value_heads, config.head_dim)
        v = v.transpose(1, 2).repeat_interleave(groups, dim=1)  # [B, Hq, S, D]
        sdpa = (attentions[layer] @ v).transpose(1, 2)  # [B, S, Hq, D]
        gate = torch.sigmoid(normed @ block.self_attn.gate.g_proj.weight.T).view_as(sdpa)
        entry = result["layers"][layer]
        assert entry["sdpa_output_mean_abs"] == pytest.approx(sdpa.abs().mean().item(), rel=1e-6)
        assert entry["gated_output_mean_abs"] == pytest.approx((sdpa * gate).abs().mean().item(), rel=1e-6)


@pytest.mark.parametrize("overrides", [
    {},
    {"gate_granularity": "headwise"},
    {"gate_activation": "ns_sigmoid"},
    {"gate_position": "value"},
    {"gate_input_dependent": False},
    {"gate_layers": [1]},
], ids=["elementwise", "headwise", "ns-sigmoid", "g2-value", "input-independent", "one-layer"])
def test_gate_statistics_match_scores_recomputed_from_the_weights(overrides):
    model = model_for(gate_scale=12.0, **overrides)
    config = model.config
    with torch.no_grad():
        for block in model.model.layers:
            if hasattr(block.self_attn.gate, "logits"):  # spread the learned constants over the sigmoid's range
                logits = block.self_attn.gate.logits
                logits.copy_(torch.linspace(-4, 4, logits.numel())[torch.randperm(logits.numel())].view_as(logits))
    x = ids()
    result = analyze(model, x, batch_size=2)
    _, hidden = eager_outputs(model, x)
    heads, width = gate_shape(config)
    means = []
    for layer, block in enumerate(model.model.layers):
        entry = result["layers"][layer]["gate"]
        if layer not in gated_layers(config):
            assert entry is None
            continue
        normed = rms_norm(hidden[layer], block.input_layernorm.weight, config.rms_norm_eps)
        logits = (normed @ block.self_attn.gate.g_proj.weight.T if config.gate_input_dependent
                  else block.self_attn.gate.logits.reshape(-1).expand(*x.shape, heads * width))
        scores = torch.sigmoid(logits).view(*x.shape, heads, width)
        if config.gate_activation == "ns_sigmoid":
            scores = 0.5 + 0.5 * scores
        per_head = scores.movedim(-2, 0).reshape(heads, -1)  # [heads, every score of every token]
        assert per_head.min() < 0.1 < 0.5 < per_head.max() or config.gate_activation == "ns_sigmoid"
        torch.testing.assert_close(torch.tensor(entry["mean_per_head"], dtype=torch.float64), per_head.mean(1),
                                   rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(entry["below_0.1_per_head"], dtype=torch.float64),
                                   (per_head < 0.1).double().mean(1))
        torch.testing.assert_close(torch.tensor(entry["below_0.5_per_head"], dtype=torch.float64),
                                   (per_head < 0.5).double().mean(1))
        assert entry["mean"] == pytest.approx(per_head.mean().item(), rel=1e-6)
        assert entry["below_0.5"] == (per_head < 0.5).double().mean().item()
        bins = (per_head * GATE_BINS).floor().clamp(max=GATE_BINS - 1).long()
        histogram = torch.stack([torch.bincount(row, minlength=GATE_BINS) for row in bins]) / per_head.shape[1]
        torch.testing.assert_close(torch.tensor(entry["histogram_per_head"], dtype=torch.float64), histogram.double())
        means.append(per_head.mean().item())
    assert result["summary"]["gate_mean"] == pytest.approx(sum(means) / len(means), rel=1e-6)


def test_perplexity_matches_a_hand_computation_and_yarn_a_model_built_from_a_yarn_config():
    model = model_for()
    x = ids(batch=5, length=40)
    with torch.no_grad():
        logp = model(x).logits.log_softmax(-1)
    by_hand = -logp[:, :-1].gather(-1, x[:, 1:, None]).mean().item()
    assert mean_nll(model, x, batch_size=2) == pytest.approx(by_hand, rel=1e-10)

    yarn = with_yarn(model, 4.0)
    config = GatedQwenConfig(**{**model.config.to_dict(), "max_position_embeddings": 256,
                                "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": 64}})
    reference = GatedQwenForCausalLM(config).double().eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(yarn(x).logits, reference(x).logits, rtol=0, atol=1e-10)
        assert not torch.allclose(yarn(x).logits, model(x).logits)  # YaRN changed something ...
    assert model.config.rope_parameters["rope_type"] == "default"  # ... in a copy only

    rows = perplexity_by_length(model, lambda n: x[:, :n], [20, 40], yarn_factor=4.0, batch_size=3)
    assert [r["length"] for r in rows] == [20, 40] and rows[1]["sequences"] == 5
    assert rows[0]["ppl"] == pytest.approx(math.exp(mean_nll(model, x[:, :20])), rel=1e-10)
    assert rows[1]["ppl_yarn"] == pytest.approx(math.exp(mean_nll(reference, x)), rel=1e-10)
    with pytest.raises(ValueError, match="factor"):
        with_yarn(model, 1.0)


# ------------------------------------------------------------------------------------ fake quantization, by hand
DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "self_attn.gate.g_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def quantize_by_hand(x: torch.Tensor, bits: int, groups: int) -> torch.Tensor:
    """Symmetric round-to-nearest of `x` split into `groups` equal rows, each with the scale max|row| / (2^(bits-1)
    - 1) (kept in float32, as a kernel stores it): s * clamp(round(x / s), -2^(bits-1), 2^(bits-1) - 1); a row of
    zeros stays zero. Computed in float32 or wider, returned in `x`'s dtype."""
    levels = 2 ** (bits - 1) - 1
    rows = x.reshape(groups, -1).to(torch.promote_types(x.dtype, torch.float32))
    scale = (rows.abs().amax(dim=1, keepdim=True).float() / levels).to(rows.dtype)
    steps = torch.where(scale > 0, rows * (1 / scale), torch.zeros_like(rows))  # x / s as x * (1 / s), as kernels do
    return (torch.clamp(torch.round(steps), -levels - 1, levels) * scale).to(x.dtype).view_as(x)


def hand_quantized(model, scheme):
    """A copy of `model` with the weight of every linear layer named in `DECODER_LINEARS` quantized by hand per
    output channel and its input per token or per sequence (forward pre-hooks)."""
    import copy

    model = copy.deepcopy(model)

    def quantize_input(module, args):
        x = args[0]
        groups = x.shape[:-1].numel() if scheme.activation_scale == "token" else x.shape[0]
        return (quantize_by_hand(x, scheme.activation_bits, groups),)

    for layer in model.model.layers:
        for name in DECODER_LINEARS:
            if name == "self_attn.gate.g_proj" and not hasattr(layer.self_attn.gate, "g_proj"):
                continue  # no gate (the baseline)
            linear = layer.get_submodule(name)
            with torch.no_grad():
                linear.weight.copy_(quantize_by_hand(linear.weight, scheme.weight_bits, linear.weight.shape[0]))
            linear.register_forward_pre_hook(quantize_input)
    return model


def nll_by_hand(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logp = model(ids).logits.log_softmax(-1)
    return -logp[:, :-1].gather(-1, ids[:, 1:, None]).mean().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_fake_quantization_matches_its_formula(bits, dtype):
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(40, 33, generator=g) * torch.rand(40, 1, generator=g) * 10).to(dtype)
    x[3] = 0.0  # an all-zero row stays zero
    got = fake_quantize_rows(x, bits)
    torch.testing.assert_close(got, quantize_by_hand(x, bits, 40), rtol=0, atol=0)
    assert got.dtype == dtype and (got[3] == 0).all()
    steps = got.float() / (x.float().abs().amax(1, keepdim=True) / (2 ** (bits - 1) - 1)).clamp(min=1e-30)
    assert all(len(row.round().unique()) <= 2 ** bits for row in steps)  # at most 2^bits levels per row
    if dtype != torch.bfloat16:  # rounding to nearest: never off by more than half a step
        assert ((got - x).abs() <= x.abs().amax(1, keepdim=True) / (2 ** (bits - 1) - 1) / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("overrides", [{}, {"gate_position": None}], ids=["g1", "baseline"])
def test_fake_quantized_model_matches_a_model_quantized_by_hand(scheme, overrides):
    model = model_for(gate_scale=8.0, **overrides)
    x = ids(batch=3, length=21)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        float_logits = model(x).logits
        with fake_quantized(model, SCHEMES[scheme]):
            quantized = model(x).logits
        expected = hand_quantized(model, SCHEMES[scheme])(x).logits
    torch.testing.assert_close(quantized, expected, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(quantized, float_logits, rtol=1e-4, atol=1e-4)  # quantization changed something
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the float weights are back
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, float_logits, rtol=0, atol=0)
    rows = perplexity_under_quantization(model, x, [scheme], batch_size=2)  # a batch of 2 and one of 1
    assert rows["float"]["nll"] == pytest.approx(nll_by_hand(model, x), rel=1e-10)
    assert rows[scheme]["nll"] == pytest.approx(nll_by_hand(hand_quantized(model, SCHEMES[scheme]), x), rel=1e-10)
    assert rows[scheme]["increase"] == pytest.approx(rows[scheme]["ppl"] / rows["float"]["ppl"] - 1, rel=1e-9)
    with pytest.raises(ValueError, match="w3a3"):
        perplexity_under_quantization(model, x, ["w3a3"])


def test_per_tensor_activations_lose_more_than_per_token_at_an_outlier_token():
    """One token 100 times larger than the others: per tensor, the others are rounded to a few levels."""
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[0, 0] *= 100
    from gated_qwen.analysis.quantize import fake_quantize_activation

    per_token = (fake_quantize_activation(x, 8, "token") - x)[0, 1:].abs().mean()
    per_tensor = (fake_quantize_activation(x, 8, "tensor") - x)[0, 1:].abs().mean()
    assert per_tensor > 10 * per_token
    torch.testing.assert_close(fake_quantize_activation(x, 8, "tensor"), quantize_by_hand(x, 8, 1), rtol=0, atol=0)


# -------------------------------------------------------------------------------------------- recall, counted
class _LookupModel(torch.nn.Module):
    """Next-token logits from the current token alone (`table[token]`), as a causal LM returns them."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids, use_cache=False):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.table[input_ids])


def test_recall_accuracy_matches_a_count():
    corpus = KeyValueRecall()
    docs = corpus.sample(50, 40, seed=3)
    targets = corpus.recall_targets(docs)
    table = torch.randn(corpus.vocab_size, corpus.vocab_size, generator=torch.Generator().manual_seed(0))
    for key in range(corpus.keys):  # after key k, the most likely token is value k % values: right 1 time in `values`
        table[1 + corpus.fillers + key, 1 + corpus.fillers + corpus.keys + key % corpus.values] += 10
    model = _LookupModel(table)
    hits = positions = 0
    nll = 0.0
    for doc in docs.tolist():
        for i in range(1, len(doc)):
            if corpus.fillers < doc[i - 1] <= corpus.fillers + corpus.keys:  # a key: a value to recall follows
                logits = table[doc[i - 1]]
                hits += int(logits.argmax()) == doc[i]
                nll -= logits.log_softmax(-1)[doc[i]].item()
                positions += 1
    assert positions == 50 * corpus.facts(40) == 250 and 0 < hits < positions
    result = recall_accuracy(model, docs, targets, batch_size=7)
    assert result == {"accuracy": hits / positions, "nll": pytest.approx(nll / positions, rel=1e-6),
                      "positions": positions}
    with pytest.raises(ValueError, match="position 0"):
        recall_accuracy(model, docs, torch.ones_like(targets))


@pytest.mark.parametrize("layout", ["halves", "interleaved"])
def test_key_value_recall_follows_its_rules(layout):
    corpus = KeyValueRecall(fillers=20, keys=6, values=5, tokens_per_fact=10, successors=4, layout=layout, seed=2)
    assert corpus.vocab_size == 1 + 20 + 6 + 5 + 30
    table = corpus.successor_table()
    assert table.shape == (corpus.vocab_size, 4) and (table >= 1).all() and (table <= 20).all()
    # 1 fact in the shortest document (halves: a position in [1, n // 2) and a query slot after; interleaved: two
    # two-token slots), 6 facts (one per key) in 69 tokens
    assert (corpus.min_length(), corpus.max_length()) == ((5, 69) if layout == "halves" else (6, 69))
    for length, facts in ((corpus.min_length(), 1), (30, 3), (69, 6)):  # the facts scale with the length
        assert corpus.facts(length) == facts
        docs = corpus.sample(40, length, seed=7)
        assert torch.equal(docs, corpus.sample(40, length, seed=7))
        half = length // 2
        for doc, targets in zip(docs.tolist(), corpus.recall_targets(docs).tolist()):
            assert doc[0] == 0
            known = {}  # key -> (value, position), from the fact tokens
            for i, token in enumerate(doc[1:], start=1):
                if token > 1 + 20 + 6 + 5 - 1:  # a fact token
                    assert i < half if layout == "halves" else i % 2 == 1
                    key, value = divmod(token - 32, 5)
                    assert key not in known
                    known[key] = value, i
            assert len(known) == facts
            queried = []
            for i in range(1, length):
                token, before = doc[i], doc[i - 1]
                if 21 <= before <= 26:  # after a key: its fact's value
                    assert token == 27 + known[before - 21][0] and targets[i]
                    continue
                assert not targets[i]
                if 21 <= token <= 26:  # a query's key: after its fact (halves: in the second half), each fact's once
                    assert (half <= i if layout == "halves" else i % 2 == 1) and known[token - 21][1] < i < length - 1
                    queried.append(token - 21)
                elif token <= 20:
                    assert i == 1 or token in table[before].tolist()  # the chain goes on from any token
            assert sorted(queried) == sorted(known)
    with pytest.raises(ValueError, match=f"give at least {corpus.min_length()} tokens"):
        corpus.sample(2, corpus.min_length() - 1)
    with pytest.raises(ValueError, match="7 facts .* more than its 6 distinct keys; give at most 69 tokens"):
        corpus.sample(2, 70)
    with pytest.raises(ValueError, match="tokens_per_fact"):
        KeyValueRecall(tokens_per_fact=4)
    with pytest.raises(ValueError, match="layout"):
        KeyValueRecall(layout="random")


def test_held_out_documents_of_the_chain_corpora_are_prefixes_of_longer_ones():
    """`reproduce.held_out(preset, length)` draws each length anew: for these corpora that is the first tokens of the
    longest documents, so every length sees the same documents."""
    for corpus in (BigramBackcopy(), SyntheticLanguage()):
        assert torch.equal(corpus.sample(5, 30, seed=HELDOUT_SEED), corpus.sample(5, 240, seed=HELDOUT_SEED)[:, :30])


def test_analysis_sees_the_ungated_output_under_a_backend_that_fuses_the_gate():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def fused(module, query, key, value, attention_mask, output_gate=None, **kwargs):  # returns the gated output
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out * torch.sigmoid(output_gate), weights

    fused.applies_output_gate = True  # how an attention function says it takes the gate's logits
    AttentionInterface.register("test_fused_gate", fused)
    AttentionMaskInterface.register("test_fused_gate", sdpa_mask)
    model, x = model_for(gate_scale=8.0), ids()
    expected = analyze(model, x)
    model.set_attn_implementation("test_fused_gate")
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, model_for(gate_scale=8.0)(x).logits)  # the backend is right
    result = analyze(model, x)
    assert model.config._attn_implementation == "test_fused_gate"  # restored
    for got, want in zip(result["layers"], expected["layers"]):
        assert got["sdpa_output_mean_abs"] == pytest.approx(want["sdpa_output_mean_abs"], rel=1e-12)
        assert got["gated_output_mean_abs"] == pytest.approx(want["gated_output_mean_abs"], rel=1e-12)
        assert got["gated_output_mean_abs"] < 0.9 * got["sdpa_output_mean_abs"]


def test_analyze_refuses_bad_input():
    model = model_for()
    with pytest.raises(ValueError, match="vocabulary"):
        analyze(model, torch.full((1, 8), VOCAB))
    with pytest.raises(ValueError, match="length >= 2"):
        analyze(model, torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="map_layers"):
        analyze(model, ids(), map_layers=[3])


def test_builtin_corpus_follows_its_rules():
    language = SyntheticLanguage(vocab_size=50, successors=3, repeat_rate=0.2, span=(4, 6), seed=3)
    docs = language.sample(64, 80, seed=5)
    assert torch.equal(docs, language.sample(64, 80, seed=5))
    assert not torch.equal(docs, language.sample(64, 80, seed=6))
    assert (docs[:, 0] == 0).all() and (docs[:, 1:] > 0).all() and docs.max() < 50
    table = language.successor_table()
    follows = (table[docs[:, 1:-1]] == docs[:, 2:, None]).any(-1)  # [N, S-2]: a bigram step
    assert follows[:, : 6 - 1].all()  # no repeat starts in the first span[1] tokens
    for doc, ok in zip(docs, follows):
        for i in (~ok).nonzero().flatten().tolist():  # every other token is copied from earlier in the document
            position = i + 2
            assert (doc[1:position] == doc[position]).any()
    off_table = 1 - follows.float().mean().item()
    assert 0.05 < off_table < 0.6  # repeats happen, but the chain dominates
    with pytest.raises(ValueError, match="successors"):
        SyntheticLanguage(vocab_size=4, successors=4)


def test_bigram_backcopy_follows_its_rules():
    language = BigramBackcopy(vocab_size=30, triggers=3, successors=4, trigger_rate=0.4, seed=2)
    docs = language.sample(200, 50, seed=7)
    assert torch.equal(docs, language.sample(200, 50, seed=7))
    assert not torch.equal(docs, language.sample(200, 50, seed=8))
    table = language.successor_table()
    assert table.shape == (30, 4) and (table > 3).all() and table.max() < 30  # successors are ordinary tokens
    triggers = 0
    for doc in docs.tolist():  # the rules, token by token
        assert doc[0] == 0 and doc[1] > 3
        for i in range(2, len(doc)):
            if 1 <= doc[i - 1] <= 3:
                assert doc[i] == doc[i - 2] and doc[i] > 3  # the backcopy: an ordinary token
            else:
                assert 1 <= doc[i] <= 3 or doc[i] in table[doc[i - 1]].tolist()
            triggers += 1 <= doc[i] <= 3
    share = triggers / (200 * 48)
    assert share == pytest.approx(0.4 / 1.4, abs=0.02)  # a trigger after each ordinary token with p = 0.4
    assert torch.equal(language.is_trigger(docs), (docs >= 1) & (docs <= 3))
    with pytest.raises(ValueError, match="trigger_rate"):
        BigramBackcopy(trigger_rate=1.5)
    with pytest.raises(ValueError, match="successors"):
        BigramBackcopy(vocab_size=10, triggers=4, successors=6)


def test_sink_profile_by_hand():
    per_query = torch.zeros(2, 2, 1, 9)  # 2 documents, 2 layers, 1 head, 9 positions (query 0 left out)
    per_query[:, 0, 0] = torch.tensor([1.0, 0.8, 0.8, 0.0, 0.0, 0.8, 0.8, 0.0, 0.0])
    per_query[:, 1, 0] = 0.2
    triggers = torch.zeros(2, 9, dtype=torch.bool)
    triggers[:, [3, 4, 7, 8]] = True  # the layer-0 head attends to BOS exactly where the query is no trigger
    profile = sink_profile(per_query, triggers)
    assert profile["by_part"] == pytest.approx([0.5, 0.1, 0.5, 0.1])  # positions 1-2, 3-4, 5-6, 7-8
    assert profile["other"] == pytest.approx(0.5) and profile["trigger"] == pytest.approx(0.1)
    assert profile["other_per_layer_head"] == [[pytest.approx(0.8)], [pytest.approx(0.2)]]
    assert profile["trigger_share"] == pytest.approx(0.5)
    assert set(sink_profile(per_query, None)) == {"by_part"}


def test_planned_runs_train_the_high_learning_rate_for_the_chosen_variants():
    from gated_qwen.analysis.miniature.presets import PAIR, PLANS, Family, Plan, customised, training_key
    from gated_qwen.analysis.miniature.runs import unique_runs

    preset = customised(PLANS["smoke"].main, seeds=(4, 5), high_lr_variants=PAIR)
    assert planned_runs(preset, ["baseline", "ns-sigmoid", "g1-elementwise"]) == [
        (v, lr, seed) for seed in (4, 5) for v, lr in (("baseline", 1e-2), ("ns-sigmoid", 1e-2),
                                                      ("g1-elementwise", 1e-2), ("baseline", 4e-2),
                                                      ("g1-elementwise", 4e-2))]
    assert planned_runs(dataclasses.replace(preset, high_lr_variants=()), ["baseline"]) == [
        ("baseline", 1e-2, 4), ("baseline", 1e-2, 5)]
    # a run two families share (same model, variant, rate and seed) is trained once, at its first family
    more_seeds = dataclasses.replace(preset, seeds=(4, 5, 6), tuning_seeds=(0, 1, 2))
    other_model = dataclasses.replace(preset, num_hidden_layers=2)
    plan = Plan((Family("main", preset, ("baseline", "ns-sigmoid")), Family("stability", more_seeds),
                 Family("deep", other_model)))
    runs = unique_runs(plan)
    assert [(p is preset, v, lr, seed) for p, v, lr, seed in runs[:5]] == [
        (True, "baseline", 1e-2, 4), (True, "ns-sigmoid", 1e-2, 4), (True, "baseline", 4e-2, 4),
        (True, "baseline", 1e-2, 5), (True, "ns-sigmoid", 1e-2, 5)]
    keys = [(training_key(p), v, lr, seed) for p, v, lr, seed in runs]
    assert len(keys) == len(set(keys)) == 6 + (12 - 4) + 8  # the stability family adds G1 and seed 6
    assert training_key(more_seeds) == training_key(preset) != training_key(other_model)


def test_the_demo_and_the_confirmatory_run_have_fresh_disjoint_seeds():
    """The demo's and the confirmatory run's seeds: none a seed any of their set-ups was chosen on (0-9), enough for a
    95% interval (and for Holm's correction to keep a unanimous row: 12 seeds at least), the confirmatory run's
    evidence never a seed the demo reports (tests/analysis/test_seed_ledger.py: nor any committed run), table 1 on
    at least 30 seeds, and the stability family's controls at the high rate."""
    from gated_qwen.analysis.miniature.presets import PLANS

    demo, confirm = PLANS["default"], PLANS["confirm"]
    demo_seeds = {seed for f in demo.families for seed in f.preset.seeds}
    assert [f.name for f in demo.families] == ["main"] and len(demo_seeds) >= 12
    for family in (*demo.families, *confirm.families):
        assert len(family.preset.seeds) >= 12 and not set(family.preset.seeds) & set(range(10)), family.name
        assert set(family.preset.tuning_seeds) <= set(range(10)), family.name
        if family in confirm.families:
            assert not set(family.preset.seeds) & demo_seeds, family.name
    families = {f.name: f for f in confirm.families}
    assert len(families["table1-learned"].preset.seeds) >= 30
    assert len(families["table1-learned"].preset.tuning_seeds) >= 6
    assert families["stability"].preset.high_lr_variants == ("baseline", "g1-elementwise", "sdpa-rmsnorm")


def test_loss_spikes():
    assert loss_spikes([5.0, 4.0, 3.0, 2.0], window=1) == {"max_rise": 0.0, "diverged": False}
    assert loss_spikes([5.0, 3.0, 4.5, 2.0], window=1)["max_rise"] == pytest.approx(1.5)
    assert loss_spikes([4.0, 2.0, 4.0, 2.0], window=2)["max_rise"] == pytest.approx(0.0)  # smoothed away
    assert loss_spikes([3.0, float("nan")], window=1)["diverged"] is True


def _layer_outputs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """What each decoder layer of `model` returns for `ids`, through forward hooks."""
    outputs = []
    hooks = [layer.register_forward_hook(lambda module, args, output: outputs.append(
        output[0] if isinstance(output, tuple) else output)) for layer in model.model.layers]
    with torch.no_grad():
        model.eval()(ids)
    for hook in hooks:
        hook.remove()
    return outputs


def count_recall(model, docs: torch.Tensor, corpus: KeyValueRecall) -> tuple[int, float, int]:
    """Hits, summed NLL and number of the positions right after a key token, counted one by one."""
    with torch.no_grad():
        logp = model(docs).logits.log_softmax(-1)
    hits, nll, count = 0, 0.0, 0
    for n, doc in enumerate(docs.tolist()):
        for i in range(1, len(doc)):
            if corpus.fillers < doc[i - 1] <= corpus.fillers + corpus.keys:
                hits += int(logp[n, i - 1].argmax()) == doc[i]
                nll -= logp[n, i - 1, doc[i]].item()
                count += 1
    return hits, nll, count


def test_reproduce_smoke_preset_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--jobs", "1", "--variants",
                 "baseline,g1-elementwise,g1-headwise,ns-sigmoid", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "| g1-elementwise |" in printed and "The paper's directions" in printed
    for name in ("report.md", "report.json", "loss_curves.png", "first_token_attention.png", "max_activation.png",
                 "first_token_attention_high_lr.png", "gate_histograms.png", "attention_maps.png", "extrapolation.png",
                 "overview.png", "heldout.safetensors", "heldout_mact.safetensors", "heldout_table1.safetensors",
                 "heldout_table1-learned.safetensors",
                 "heldout_long.safetensors", "recall_by_length.png"):
        assert (out / name).stat().st_size > 0, name
    assert not (out / "heldout_stability.safetensors").exists()  # the stability family's documents are the main's
    report = json.loads((out / "report.json").read_text())
    families = report["plan"]["families"]
    assert list(families) == ["main", "mact", "six-layer", "table1", "table1-learned", "stability", "long"] \
        == report["meta"]["families"]
    info = families["main"]
    assert info["learning_rates"] == [1e-2, 4e-2] and report["meta"]["seeds"]["main"] == info["seeds"] == [3]
    assert info["corpus"] == "bigram-backcopy" and info["use_qk_norm"] is False
    runs = report["runs"]
    assert len(runs["main"]) == 6 and len(runs["main"]["baseline-lr0.01-seed3"]["train_loss"]) == 6
    # the stability family reads the main models' runs (trained once) and adds only its control, RMSNorm on the
    # SDPA output, which --variants left out of the main models
    assert runs["stability"]["baseline-lr0.04-seed3"] == runs["main"]["baseline-lr0.04-seed3"]
    assert set(runs["stability"]) - set(runs["main"]) == {"sdpa-rmsnorm-lr0.01-seed3", "sdpa-rmsnorm-lr0.04-seed3"}
    assert sorted(p.name for p in (out / "models").iterdir() if not p.name.startswith(("mact-", "table1-", "long-"))) \
        == sorted({*runs["main"], *runs["stability"]})
    assert runs["six-layer"] == {k: v for k, v in runs["mact"].items() if k.startswith("g1-")}  # trained once
    # the rows as run: the commit that last changed directions.py, and whether the tree was clean (a checkout here)
    meta = report["meta"]
    assert set(meta) >= {"directions_commit", "directions_commit_date", "directions_file_clean", "tree_clean", "head",
                         "directions_sha256", "started_at"}
    assert meta["directions_commit"] is None or len(meta["directions_commit"]) == 40
    # One seed: no 95% interval, so no direction is decided (test_judge.py judges made-up seeds), nor corrected.
    directions = report["directions"]
    assert {c["verdict"] for c in directions} <= {"inconclusive", "not testable here"}
    assert all(set(c["adjusted"].values()) <= {"inconclusive", "not testable here"} for c in directions)
    assert all(c["seeds"] == [3] and (c["interval"] is None or c["interval"]["low"] is None) for c in directions)
    assert json.loads((out / "directions.json").read_text())["directions"] == directions
    assert "long/yarn-4x" in report["not_run"]  # the smoke preset's long-context model is evaluated at 1x and 2x
    # The saved model, measured again, gives the report's numbers.
    heldout = load_file(out / "heldout.safetensors")["input_ids"]
    run = runs["main"]["g1-elementwise-lr0.04-seed3"]
    model = GatedQwenForCausalLM.from_pretrained(out / "models" / "g1-elementwise-lr0.04-seed3").eval()
    seq_len, analysed = info["seq_len"], info["analysis_documents"]
    assert run["heldout_loss"] == pytest.approx(mean_nll(model, heldout[: info["eval_documents"], :seq_len]), rel=1e-5)
    # F-Attn from the eager attention probabilities, the gate mean from the gate's weights (not analyze() again).
    attentions, hidden = eager_outputs(model, heldout[:analysed, :seq_len])
    assert run["analysis"]["summary"]["first_token_attention"] == pytest.approx(
        torch.stack([weights[:, :, 1:, 0].mean() for weights in attentions]).mean().item(), rel=1e-5)
    gate_means = [torch.sigmoid(rms_norm(hidden[i], block.input_layernorm.weight, model.config.rms_norm_eps)
                                @ block.self_attn.gate.g_proj.weight.T).mean() for i, block in enumerate(model.model.layers)]
    assert run["analysis"]["summary"]["gate_mean"] == pytest.approx(torch.stack(gate_means).mean().item(), rel=1e-5)
    # F-Attn at the queries that are not triggers, by hand from the per-query attention of the saved model.
    docs = heldout[:analysed, :seq_len]
    per_query = first_token_attention_per_query(model, docs)[..., 1:].double().mean(dim=(1, 2))  # [N, S-1]
    other = ~BigramBackcopy(**info["language"]).is_trigger(docs)[:, 1:]
    assert run["sink"]["other"] == pytest.approx(per_query[other].mean().item(), rel=1e-5)
    _check_the_other_families(out, report)
    _check_the_commands_flags(tmp_path, out, capsys)


def _check_the_other_families(out, report):
    """The M-Act model's largest |output| at the first token of its non-final layers and every head's F-Attn, table
    1's losses against the corpus's floor, low bits and the long-context model's recall, each from the saved models
    and documents by hand."""
    families, runs = report["plan"]["families"], report["runs"]
    info = families["mact"]
    assert sorted(runs["mact"]) == ["baseline-lr0.01-seed3", "g1-elementwise-lr0.01-seed3"]
    assert (info["num_hidden_layers"], info["corpus"], info["seeds"]) == (2, "repeats", [3])
    mact_docs = load_file(out / "heldout_mact.safetensors")["input_ids"]
    for name, run in runs["mact"].items():
        model = GatedQwenForCausalLM.from_pretrained(out / "models" / f"mact-{name}").eval()
        outputs = _layer_outputs(model, mact_docs[: info["analysis_documents"], : info["seq_len"]])
        assert len(outputs) == 2
        assert run["analysis"]["summary"]["first_token_max_activation_nonfinal"] == pytest.approx(
            outputs[0][:, 0].abs().max().item(), rel=1e-5)
        attentions, _ = eager_outputs(model, mact_docs[: info["analysis_documents"], : info["seq_len"]])
        assert [layer["first_token_attention_per_head"] for layer in run["analysis"]["layers"]] == [
            pytest.approx(w[:, :, 1:, 0].mean(dim=(0, 2)).tolist(), rel=1e-5) for w in attentions]
    info = families["table1"]
    assert sorted(runs["table1"]) == sorted(f"{v}-lr0.01-seed3" for v in info["variants"]) and len(info["variants"]) == 5
    corpus = TrigramLanguage(**info["language"])
    docs = load_file(out / "heldout_table1.safetensors")["input_ids"][: info["eval_documents"], : info["seq_len"]]
    for name, run in runs["table1"].items():
        model = GatedQwenForCausalLM.from_pretrained(out / "models" / f"table1-{name}").eval()
        assert run["heldout_loss"] == pytest.approx(nll_by_hand(model, docs), rel=1e-5)
        assert run["entropy_floor"] == pytest.approx(corpus.entropy_floor(info["seq_len"]), rel=1e-12)
    assert json.loads((out / "models" / "table1-g2-value-lr0.01-seed3" / "config.json").read_text())[
        "gate_position"] == "value"
    # Low-bit inference: the PPL of a saved main and M-Act model under each scheme, against the model quantized by hand.
    main_docs = load_file(out / "heldout.safetensors")["input_ids"][: families["main"]["eval_documents"],
                                                                      : families["main"]["seq_len"]]
    for folder, run, docs in (("g1-elementwise-lr0.01-seed3", runs["main"]["g1-elementwise-lr0.01-seed3"], main_docs),
                              ("mact-baseline-lr0.01-seed3", runs["mact"]["baseline-lr0.01-seed3"],
                               mact_docs[: families["mact"]["eval_documents"], : families["mact"]["seq_len"]])):
        model = GatedQwenForCausalLM.from_pretrained(out / "models" / folder).eval()
        assert run["quantization"]["float"]["nll"] == pytest.approx(nll_by_hand(model, docs), rel=1e-5)
        for scheme in SCHEMES:
            assert run["quantization"][scheme]["nll"] == pytest.approx(
                nll_by_hand(hand_quantized(model, SCHEMES[scheme]), docs), rel=1e-5), (folder, scheme)
    # The long-context model: recall accuracy and the NLL of the recalled tokens at every length, without and with
    # YaRN, counted on the saved model and the saved documents.
    assert sorted(runs["long"]) == [f"{v}-lr0.01-seed3" for v in ("baseline", "g1-elementwise")]
    info = families["long"]
    assert (info["corpus"], info["extrapolation"], info["seeds"]) == ("recall", [1, 2], [3])
    corpus = KeyValueRecall(**info["language"])
    saved = load_file(out / "heldout_long.safetensors")
    assert sorted(saved) == ["input_ids_24", "input_ids_48"]
    for name, run in runs["long"].items():
        model = GatedQwenForCausalLM.from_pretrained(out / "models" / f"long-{name}").eval()
        assert [row["length"] for row in run["extrapolation"]] == [24, 48]
        for row in run["extrapolation"]:
            docs = saved[f"input_ids_{row['length']}"][: info["extrapolation_documents"]]
            assert row["ppl"] == pytest.approx(math.exp(nll_by_hand(model, docs)), rel=1e-5)
            for suffix, chosen in (("", model), ("_yarn", with_yarn(model, 2.0))):
                hits, nll, count = count_recall(chosen, docs, corpus)
                assert count == 3 * corpus.facts(row["length"]) and row[f"recall{suffix}"] == {
                    "accuracy": hits / count, "nll": pytest.approx(nll / count, rel=1e-5), "positions": count}
    text = (out / "report.md").read_text()
    assert all(f"## Family `{name}`" in text for name in families)
    assert "## Longer contexts: the long-context model" in text and "## Low-bit inference" in text


def _check_the_commands_flags(tmp_path, out, capsys):
    assert main(["reproduce", "--preset", "smoke", "--out", str(tmp_path / "main-only"), "--jobs", "1", "--variants",
                 "baseline,g1-elementwise,g1-headwise", "--seeds", "4", "--families", "main"]) == 0
    report = json.loads((tmp_path / "main-only" / "report.json").read_text())
    assert list(report["runs"]) == list(report["plan"]["families"]) == ["main"] and len(report["runs"]["main"]) == 5
    assert sorted(p.name for p in (tmp_path / "main-only").glob("heldout*")) == ["heldout.safetensors"]
    assert not [p for p in (tmp_path / "main-only" / "models").iterdir() if "-lr" in p.name.split("-", 1)[0]]
    # A non-empty folder is never overwritten silently; --overwrite replaces it whole.
    (out / "mine.txt").write_text("keep")
    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--jobs", "1"]) == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "mine.txt").exists()
    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--jobs", "1", "--variants", "baseline",
                 "--steps", "2", "--hidden-size", "16", "--layers", "1", "--seq-len", "24", "--batch-size", "2",
                 "--learning-rates", "0.001", "0.002", "--seeds", "5", "6", "--corpus", "repeats", "--qk-norm",
                 "--no-clip", "--overwrite", "--families", "main"]) == 0
    assert not (out / "mine.txt").exists()
    report = json.loads((out / "report.json").read_text())
    info = report["plan"]["families"]["main"]
    assert info["variants"] == ["baseline"] and info["learning_rates"] == [0.001, 0.002]
    assert info["seeds"] == [5, 6] and len(report["runs"]["main"]) == 4 and info["corpus"] == "repeats"
    assert {k: info[k] for k in ("steps", "hidden_size", "head_dim", "num_hidden_layers", "seq_len", "batch_size",
                                 "use_qk_norm", "max_grad_norm")} == dict(
        steps=2, hidden_size=16, head_dim=16, num_hidden_layers=1, seq_len=24, batch_size=2, use_qk_norm=True,
        max_grad_norm=0.0)
    config = json.loads((out / "models" / "baseline-lr0.001-seed6" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["max_position_embeddings"],
            config["vocab_size"], config["use_qk_norm"]) == (16, 1, 24, 128, True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["main-only", "run"]  # no staging folder left behind
    assert main(["reproduce", "--preset", "smoke", "--out", str(tmp_path / "x"), "--variants", "g9"]) == 2
    assert "unknown ['g9']" in capsys.readouterr().err
    assert main(["reproduce", "--preset", "smoke", "--out", str(tmp_path / "x"), "--families", "main,deep"]) == 2
    assert "--families: ['deep']" in capsys.readouterr().err
    assert main(["reproduce", "--preset", "smoke", "--out", str(tmp_path / "x"), "--families", "long"]) == 2
    assert "main is missing" in capsys.readouterr().err
    assert main(["reproduce", "--preset", "large", "--out", str(tmp_path / "x"), "--hidden-size", "30"]) == 2
    assert "multiple of the 8 attention heads" in capsys.readouterr().err
    assert main(["reproduce", "--preset", "smoke", "--out", str(tmp_path / "x"), "--seeds", "1", "1000000"]) == 2
    assert "held-out documents" in capsys.readouterr().err
    # A corpus length with no room for its facts is refused before training, naming the models and the fix.
    assert main(["reproduce", "--preset", "smoke", "--out", str(tmp_path / "x"), "--corpus", "recall", "--seq-len",
                 "100"]) == 2  # 200-token held-out documents: 25 facts, 8 keys
    assert ("the main models (--seq-len, --corpus), trained at 100 tokens and measured at 100, 200: A KeyValueRecall "
            "document of 200 tokens holds 25 facts") in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # a fresh interpreter or several processes
def test_reproduce_in_worker_processes_gives_the_in_process_results(tmp_path, monkeypatch):
    """The same results and saved models from worker processes as in-process, also under a TMPDIR long enough that
    a Unix socket in it (how tensors pickled as they are cross between processes) would not fit."""
    from safetensors.torch import load_file

    from gated_qwen.analysis.miniature.presets import PLANS, Family, Plan, customised
    from gated_qwen.analysis.miniature.runs import run_all

    long_tmp = tmp_path / ("t" * (100 - len(str(tmp_path))))
    long_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(long_tmp))
    preset = customised(PLANS["smoke"].main, steps=3, seeds=(2,), high_lr_variants=("g1-headwise",))
    plan = Plan((Family("main", preset, ("g1-headwise",)),))
    inline = list(run_all(plan, models_dir=tmp_path / "inline", jobs=1, progress=False).values())
    spawned = list(run_all(plan, models_dir=tmp_path / "spawned", jobs=2, progress=False).values())
    for model in ("g1-headwise-lr0.01-seed2", "g1-headwise-lr0.04-seed2"):
        a, b = (load_file(tmp_path / kind / model / "model.safetensors") for kind in ("inline", "spawned"))
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    for a, b in zip(inline, spawned):
        for name, maps in a["tensors"]["attention_maps"].items():
            torch.testing.assert_close(b["tensors"]["attention_maps"][name], maps, rtol=1e-4, atol=1e-6)
    assert [(r["variant"], r["learning_rate"], r["seed"]) for r in spawned] == [
        (r["variant"], r["learning_rate"], r["seed"]) for r in inline] == [("g1-headwise", 1e-2, 2),
                                                                          ("g1-headwise", 4e-2, 2)]
    for a, b in zip(inline, spawned):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert b["analysis"]["summary"]["gate_mean"] == pytest.approx(a["analysis"]["summary"]["gate_mean"], rel=1e-5)


def test_analyze_and_eval_ppl_commands(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = model_for().float()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    words = {"<s>": 0, **{f"t{i}": i for i in range(1, VOCAB - 1)}, "<unk>": VOCAB - 1}  # "t60" -> <unk>, id 60
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="<unk>").save_pretrained(folder)
    tokens = ids(batch=2, length=48, seed=4)
    save_file({"input_ids": tokens}, tmp_path / "tokens.safetensors")

    out = tmp_path / "analysis"
    assert main(["analyze", str(folder), "--tokens", str(tmp_path / "tokens.safetensors"), "--length", "40",
                 "--sequences", "2", "--batch-size", "2", "--out", str(out), "--map-layers", "0", "2",
                 "--map-tokens", "5", "--quant", "w8a8-tensor,w4a4"]) == 0
    report = json.loads((out / "report.json").read_text())
    # The report's F-Attn and M-Act against the saved model's eager attention probabilities and layer outputs.
    attentions, hidden = eager_outputs(GatedQwenForCausalLM.from_pretrained(folder).eval(), tokens[:, :40])
    first_token = torch.stack([weights[:, :, 1:, 0].mean() for weights in attentions])  # [layers]
    assert report["summary"]["first_token_attention"] == pytest.approx(first_token.mean().item(), rel=1e-5)
    assert [entry["first_token_attention"] for entry in report["layers"]] == pytest.approx(first_token.tolist(),
                                                                                           rel=1e-5)
    assert report["summary"]["max_activation"] == pytest.approx(max(h.abs().max().item() for h in hidden[1:]),
                                                                rel=1e-5)
    assert list(report["quantization"]) == ["float", "w8a8-tensor", "w4a4"]  # as asked, float first
    for scheme in ("w8a8-tensor", "w4a4"):
        by_hand = nll_by_hand(hand_quantized(model, SCHEMES[scheme]), tokens[:, :40])
        assert report["quantization"][scheme]["nll"] == pytest.approx(by_hand, rel=1e-5)
        assert report["quantization"][scheme]["increase"] == pytest.approx(
            math.exp(by_hand - nll_by_hand(model, tokens[:, :40])) - 1, rel=1e-4, abs=1e-6)
    assert "## Low-bit inference" in capsys.readouterr().out
    for name in ("report.md", "attention_maps.png", "first_token_attention.png", "max_activation.png",
                 "first_token_attention_by_position.png", "gate_histograms.png"):
        assert (out / name).stat().st_size > 0, name

    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"t{t}" for t in tokens[0, 1:].tolist()))  # 47 words
    rows_file = tmp_path / "ppl.json"
    assert main(["eval-ppl", str(folder), "--text", str(text), "--lengths", "16", "24", "--yarn", "2",
                 "--sequences", "3", "--out", str(rows_file)]) == 0
    rows = json.loads(rows_file.read_text())["rows"]
    words = tokens[0, 1:]

    def windows(length):  # BOS + the next length - 1 words, as many whole windows as the text holds (at most 3)
        n = min(3, len(words) // (length - 1))
        return torch.cat([torch.zeros(n, 1, dtype=torch.long), words[: n * (length - 1)].view(n, -1)], dim=1)

    assert [r["sequences"] for r in rows] == [3, 2]
    assert rows[0]["ppl"] == pytest.approx(math.exp(mean_nll(model, windows(16))), rel=1e-6)
    assert rows[1]["ppl_yarn"] == pytest.approx(math.exp(mean_nll(with_yarn(model, 2.0), windows(24))), rel=1e-6)
    assert "| 24 |" in capsys.readouterr().out

    assert main(["eval-ppl", str(folder), "--lengths", "16"]) == 2  # the built-in corpus has another vocabulary
    assert "--text FILE" in capsys.readouterr().err
    assert main(["eval-ppl", str(folder), "--lengths", "16", "--text", str(tmp_path / "missing.txt")]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert main(["eval-ppl", str(tmp_path), "--lengths", "16"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["eval-ppl", str(folder), "--lengths", "64", "--tokens", str(tmp_path / "tokens.safetensors")]) == 2
    assert "shorter than the length 64" in capsys.readouterr().err
    assert main(["analyze", str(folder), "--tokens", str(tmp_path / "tokens.safetensors"), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval-ppl", str(folder), "--lengths", "16", "--yarn", "0.5"])


def test_commands_refuse_bad_input_in_one_line_and_write_nothing(tmp_path, capsys):
    model_for().float().save_pretrained(tmp_path / "model")
    (tmp_path / "not-safetensors.bin").write_bytes(b"\x80\x02 a pickle, say")
    (tmp_path / "text.txt").write_text("some text")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    cases = [
        (["analyze", str(tmp_path / "model"), "--tokens", str(tmp_path / "not-safetensors.bin")],
         "is not a safetensors file"),
        (["eval-ppl", str(tmp_path / "model"), "--lengths", "8", "--tokens", str(tmp_path / "not-safetensors.bin")],
         "is not a safetensors file"),
        (["analyze", str(tmp_path / "model"), "--text", str(tmp_path / "text.txt")], "--text needs a tokenizer"),
        (["analyze", str(tmp_path / "broken")], "broken/config.json) is not valid JSON ("),
        (["analyze", str(tmp_path / "missing")], "is not a model folder"),
    ]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    capsys.readouterr()  # the set-up's progress bars
    for bad in ("w3a3", "w8a8-tensor,int2", ""):  # refused while parsing, before anything is loaded
        with pytest.raises(SystemExit) as refused:
            main(["analyze", str(tmp_path / "model"), "--quant", bad, "--out", str(tmp_path / "out")])
        line = refusal_line(refused.value.code, capsys.readouterr().err, "w8a8-tensor, w8a8-token, w4a8, w4a4, or all")
        assert line.startswith("gated-qwen: error: argument --quant: unknown scheme(s) '")
    from gated_qwen.analysis.cli import _quant_schemes

    assert _quant_schemes("all") == list(SCHEMES) and _quant_schemes("w4a4, w4a4,w4a8") == ["w4a4", "w4a8"]
    for args, message in cases:
        assert_refused(capsys, [*args, *(["--out", str(tmp_path / "out")] if args[0] == "analyze"
                                         else ["--out", str(tmp_path / "out" / "rows.json")])], message, bars=True)
        assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no output, no staging folder, no parent


def test_short_stages_train_before_the_main_one():
    """`Preset.short_stages`: steps on shorter documents first, in order (the paper's pretraining before its
    long-context stage; a curriculum of lengths), logged with the rest; the memory estimate counts the largest
    stage's documents."""
    from gated_qwen.analysis.footprint import training_bytes
    from gated_qwen.analysis.miniature.presets import PLANS, customised
    from gated_qwen.analysis.miniature.runs import train_and_measure

    preset = customised(PLANS["smoke"].main, steps=2, short_stages=((8, 3), (12, 1)), extrapolation=(1,))
    result, model = train_and_measure(preset, "g1-elementwise", 1e-2, seed=1)
    assert len(result["train_loss"]) == 6 and model.config.max_position_embeddings == preset.seq_len
    one_stage = customised(preset, short_stages=())
    assert training_bytes(one_stage) == training_bytes(preset)  # 3 x 4 x 8 tokens: fewer than 2 x 4 x 24
    assert training_bytes(customised(preset, short_stages=((8, 10**6), (12, 1)))) - training_bytes(one_stage) == (
        8 * 4 * (8 * 10**6 - 2 * 24))


@pytest.mark.parametrize("length, theta, head_dim, unchanged, interpolated_from", [
    (32, 1e4, 64, [0], 6),  # the old long-context model: only frequency 0 kept, and only by rounding (5 turns)
    (256, 1e4, 128, [0, 1], 26),  # the long-context model: frequencies 0 and 1 turn 41 and 35 times in 256 tokens
])
def test_yarn_bands_match_the_yarn_papers_formula(length, theta, head_dim, unchanged, interpolated_from):
    """YaRN (Peng et al. 2023) with beta_fast 32 and beta_slow 1: a frequency that turns r times in the trained
    context is left alone where r >= 32 and divided by the factor where r <= 1; Transformers rounds the band edges
    (the dimension index where r crosses each bound, down and up) and ramps linearly between."""
    from gated_qwen.analysis.perplexity import yarn_bands

    config = GatedQwenConfig(**sizes(TINY, head_dim=head_dim, max_position_embeddings=length,
                                     rope_parameters={"rope_type": "default", "rope_theta": theta}))
    bands = yarn_bands(config, 4.0)
    turns = [length * theta ** (-2 * i / head_dim) / (2 * math.pi) for i in range(head_dim // 2)]
    edge = lambda r: head_dim * math.log(length / (r * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low, high = max(math.floor(edge(32)), 0), math.ceil(edge(1))
    assert bands["rotations"] == pytest.approx(turns)
    assert bands["unchanged"] == list(range(low + 1)) == unchanged
    assert bands["interpolated"] == list(range(high, head_dim // 2)) and high == interpolated_from
    assert bands["ramp"] == list(range(low + 1, high))
    assert all(turns[i] >= 32 for i in bands["unchanged"] if length >= 256)
    assert bands["attention_factor"] == pytest.approx(0.1 * math.log(4.0) + 1)
