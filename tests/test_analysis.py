"""gated_qwen.analysis against brute force: F-Attn and attention maps against the eager attention weights
(`output_attentions=True`), M-Act against `output_hidden_states=True`, |SDPA output| and gate statistics against
values recomputed by hand from the weights, perplexity against a hand-written cross-entropy, YaRN against a model
built from a YaRN config; the built-in corpus against its own rules; `reproduce`, `analyze` and `eval-ppl`
end to end through the CLI."""

import json
import math

import pytest
import torch
from helpers import TINY, randomize_, sizes
from safetensors.torch import load_file, save_file

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.analysis import SyntheticLanguage, analyze, first_token_attention, mean_nll, perplexity_by_length
from gated_qwen.analysis.measure import GATE_BINS, with_yarn
from gated_qwen.analysis.reproduce import loss_spikes
from gated_qwen.cli import main

VOCAB = 61


def model_for(seed=0, gate_scale=1.0, **overrides) -> GatedQwenForCausalLM:
    """A tiny float64 model with random weights (norms included); `gate_scale` widens the gate logits so that
    scores spread over (0, 1)."""
    fields = sizes(TINY, vocab_size=VOCAB, intermediate_size=48, num_hidden_layers=3, max_position_embeddings=64,
                   **overrides)
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
    maxima = [output.abs().max().item() for output in hidden[1:]]
    assert result["summary"]["max_activation"] == pytest.approx(max(maxima), rel=1e-12)
    assert result["summary"]["mean_max_activation"] == pytest.approx(sum(maxima) / len(maxima), rel=1e-12)


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
    heads, width = config.gate_shape
    means = []
    for layer, block in enumerate(model.model.layers):
        entry = result["layers"][layer]["gate"]
        if layer not in config.gated_layers:
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


def test_analysis_sees_the_ungated_output_under_a_backend_that_fuses_the_gate():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def fused(module, query, key, value, attention_mask, output_gate=None, **kwargs):  # returns the gated output
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out * torch.sigmoid(output_gate), weights

    fused.fuses_output_gate = True
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


def test_loss_spikes():
    assert loss_spikes([5.0, 4.0, 3.0, 2.0], window=1) == {"max_rise": 0.0, "diverged": False}
    assert loss_spikes([5.0, 3.0, 4.5, 2.0], window=1)["max_rise"] == pytest.approx(1.5)
    assert loss_spikes([4.0, 2.0, 4.0, 2.0], window=2)["max_rise"] == pytest.approx(0.0)  # smoothed away
    assert loss_spikes([3.0, float("nan")], window=1)["diverged"] is True


def test_reproduce_smoke_preset_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--jobs", "1", "--variants",
                 "baseline,g1-elementwise,ns-sigmoid", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "| g1-elementwise |" in printed and "The paper's directions" in printed
    for name in ("report.md", "report.json", "loss_curves.png", "first_token_attention.png", "max_activation.png",
                 "gate_histograms.png", "attention_maps.png", "extrapolation.png", "heldout.safetensors"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "report.json").read_text())
    assert report["learning_rates"] == [1e-2, 4e-2] and report["meta"]["seed"] == 3
    assert len(report["runs"]) == 6 and len(report["runs"]["baseline-lr0.01"]["train_loss"]) == 6
    # The saved model, measured again, gives the report's numbers.
    heldout = load_file(out / "heldout.safetensors")["input_ids"]
    run = report["runs"]["g1-elementwise-lr0.04"]
    model = GatedQwenForCausalLM.from_pretrained(out / "models" / "g1-elementwise-lr0.04").eval()
    seq_len = report["preset"]["seq_len"]
    assert run["heldout_loss"] == pytest.approx(mean_nll(model, heldout[: report["preset"]["eval_documents"],
                                                                         :seq_len]), rel=1e-5)
    again = analyze(model, heldout[: report["preset"]["analysis_documents"], :seq_len], batch_size=8)
    assert run["analysis"]["summary"]["first_token_attention"] == pytest.approx(
        again["summary"]["first_token_attention"], rel=1e-5)
    assert run["analysis"]["summary"]["gate_mean"] == pytest.approx(again["summary"]["gate_mean"], rel=1e-5)
    # A non-empty folder is never overwritten silently; --overwrite replaces it whole.
    (out / "mine.txt").write_text("keep")
    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--jobs", "1"]) == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "mine.txt").exists()
    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--jobs", "1", "--variants", "baseline",
                 "--steps", "2", "--hidden-size", "16", "--layers", "1", "--seq-len", "24", "--batch-size", "2",
                 "--learning-rates", "0.001", "0.002", "--overwrite"]) == 0
    assert not (out / "mine.txt").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["variants"] == ["baseline"] and report["learning_rates"] == [0.001, 0.002]
    assert {k: report["preset"][k] for k in ("steps", "hidden_size", "head_dim", "num_hidden_layers", "seq_len",
                                             "batch_size")} == dict(steps=2, hidden_size=16, head_dim=4,
                                                                    num_hidden_layers=1, seq_len=24, batch_size=2)
    config = json.loads((out / "models" / "baseline-lr0.002" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["max_position_embeddings"]) == (16, 1, 24)
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no staging folder left behind
    assert main(["reproduce", "--preset", "smoke", "--out", str(tmp_path / "x"), "--variants", "g9"]) == 2
    assert "unknown ['g9']" in capsys.readouterr().err
    assert main(["reproduce", "--preset", "smoke", "--out", str(tmp_path / "x"), "--hidden-size", "30"]) == 2
    assert "multiple of the 4 attention heads" in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter or several processes
def test_reproduce_in_worker_processes_gives_the_in_process_results():
    from gated_qwen.analysis.reproduce import PRESETS, customised, run_all

    preset = customised(PRESETS["smoke"], steps=3)
    inline = run_all(preset, ["g1-headwise"], seed=2, models_dir=None, jobs=1, progress=False)
    spawned = run_all(preset, ["g1-headwise"], seed=2, models_dir=None, jobs=2, progress=False)
    assert [(r["variant"], r["learning_rate"]) for r in spawned] == [(r["variant"], r["learning_rate"]) for r in inline]
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
                 "--map-tokens", "5"]) == 0
    report = json.loads((out / "report.json").read_text())
    direct = analyze(model, tokens[:, :40])
    assert report["summary"]["first_token_attention"] == pytest.approx(direct["summary"]["first_token_attention"])
    assert report["summary"]["max_activation"] == pytest.approx(direct["summary"]["max_activation"])
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
        (["analyze", str(tmp_path / "broken")], "is not a valid JSON file"),
        (["analyze", str(tmp_path / "missing")], "is not a model folder"),
    ]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for args, message in cases:
        assert main([*args, *(["--out", str(tmp_path / "out")] if args[0] == "analyze"
                              else ["--out", str(tmp_path / "out" / "rows.json")])]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("gated-qwen: error: ")]
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
        assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no output, no staging folder, no parent
