"""`gated-qwen analyze` and `gated-qwen eval-ppl` through the CLI: the report's numbers against the saved model's
eager attention, layer outputs and a model quantized by hand, the perplexity rows against a hand-written
cross-entropy, and every bad input refused in one line with nothing written."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from gated_qwen import GatedQwenForCausalLM
from gated_qwen.analysis import mean_nll
from gated_qwen.analysis.perplexity import with_yarn
from gated_qwen.analysis.quantize import SCHEMES
from gated_qwen.cli import main
from tests.analysis.analysis_helpers import VOCAB, eager_outputs, hand_quantized, ids, model_for, nll_by_hand
from tests.helpers import assert_refused, refusal_line


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
