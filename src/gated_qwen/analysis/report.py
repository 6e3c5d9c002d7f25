"""Writes what `analyze` found: `report.json`, `report.md` and PNG plots, into a folder (the command's staging folder
from `gated_qwen.files`, which appears whole or not at all); and the markdown helpers the reproduce report
(`miniature.report`) shares."""

from __future__ import annotations

import math
from pathlib import Path

from ..files import write_json
from . import plots
from .quantize import SCHEMES


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- analyze
def write_analysis(folder: Path, result: dict, meta: dict) -> str:
    """`result` from `measure.analyze`, `meta` (model, data, length...) -> report.json, report.md and plots in
    `folder`; returns the markdown."""
    layers = result["layers"]
    gated = [e for e in layers if e["gate"] is not None]
    plots.per_layer({"F-Attn": [e["first_token_attention"] for e in layers]}, folder / "first_token_attention.png",
                    "attention on token 0", "F-Attn per layer (mean over heads and query positions)")
    plots.per_layer({"M-Act": [e["max_activation"] for e in layers]}, folder / "max_activation.png",
                    "max |hidden state|", "M-Act per layer", log=True)
    plots.by_position({f"L{i}": row for i, row in enumerate(result["first_token_attention_by_position"])},
                      folder / "first_token_attention_by_position.png", "F-Attn by query position (mean over heads)")
    plots.attention_maps({"model": result["attention_maps"]}, folder / "attention_maps.png")
    if gated:
        plots.gate_histograms({"mean over heads": [_head_mean(e["gate"]["histogram_per_head"]) for e in gated]},
                              result["gate_histogram_edges"], folder / "gate_histograms.png")
    summary = result["summary"]
    rows = [[e["layer"], e["first_token_attention"], e["max_activation"], e["max_activation_position"],
             e["sdpa_output_mean_abs"], e["gated_output_mean_abs"],
             *((e["gate"]["mean"], e["gate"]["below_0.1"], e["gate"]["below_0.5"]) if e["gate"] else (None,) * 3)]
            for e in layers]
    quantization = _quantization_section(result["quantization"]) if "quantization" in result else []
    text = "\n\n".join([
        f"# Analysis of {meta['model']}",
        f"Input: {meta['data']}; {meta['sequences']} sequence(s) of {meta['length']} tokens.",
        markdown_table(["F-Attn", "M-Act (max)", "M-Act (mean of layer maxima)", "mean abs SDPA output",
                        "after the gate", "gate mean", "gate < 0.1", "gate < 0.5"],
                       [[summary["first_token_attention"], summary["max_activation"], summary["mean_max_activation"],
                         summary["sdpa_output_mean_abs"], summary["gated_output_mean_abs"], summary["gate_mean"],
                         summary["gate_below_0.1"], summary["gate_below_0.5"]]]),
        "F-Attn: attention probability on the first token, averaged over heads, layers and query positions "
        "1..S-1. M-Act: maximum |hidden state| output by a layer. Gate statistics over every score of every token.",
        *quantization,
        "## Per layer",
        markdown_table(["layer", "F-Attn", "M-Act", "M-Act position", "mean abs SDPA output", "after the gate",
                        "gate mean", "gate < 0.1", "gate < 0.5"], rows),
        "## Plots",
        "![F-Attn per layer](first_token_attention.png)\n\n![F-Attn by position](first_token_attention_by_position.png)"
        "\n\n![M-Act per layer](max_activation.png)\n\n![attention maps](attention_maps.png)"
        + ("\n\n![gate histograms](gate_histograms.png)" if gated else ""),
    ]) + "\n"
    (folder / "report.md").write_text(text, errors="backslashreplace")  # a path that is not UTF-8: as \udcXX
    write_json(folder / "report.json", {"meta": meta, "summary": summary, "layers": layers,
                                        "gate_histogram_edges": result["gate_histogram_edges"],
                                        **({"quantization": result["quantization"]} if quantization else {})})
    return text


QUANTIZATION_NOTE = ("Every linear layer of the decoder (attention, gate, MLP) fake-quantized, symmetric round-to-nearest, "
                     "weights per output channel, activations dynamic (per token, or per tensor: one scale per "
                     "sequence's input to a layer); embedding and LM head in float. PPL increase: quantized / float - 1.")


def _increase(value: float) -> str:
    return f"{100 * value:+.2f}%"


def _quantization_section(rows: dict) -> list[str]:
    """`quantize.perplexity_under_quantization`'s rows as a report section."""
    return [
        "## Low-bit inference (fake quantization)",
        markdown_table(["scheme", "weights", "activations", "PPL", "PPL increase"],
                       [["float", "float", "float", rows["float"]["ppl"], "–"]]
                       + [[name, f"{SCHEMES[name].weight_bits}-bit per channel",
                           f"{SCHEMES[name].activation_bits}-bit per {SCHEMES[name].activation_scale}", row["ppl"],
                           _increase(row["increase"])] for name, row in rows.items() if name != "float"]),
        QUANTIZATION_NOTE,
    ]


def _head_mean(per_head: list[list[float]]) -> list[float]:
    return [sum(col) / len(col) for col in zip(*per_head)]
