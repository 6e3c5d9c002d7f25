"""Writes what `analyze` and `reproduce` found: `report.json`, `report.md` and PNG plots, into a folder (the
command's staging folder from `gated_qwen.outputs`, which appears whole or not at all)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..outputs import write_json
from . import plots


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
        "## Per layer",
        markdown_table(["layer", "F-Attn", "M-Act", "M-Act position", "mean abs SDPA output", "after the gate",
                        "gate mean", "gate < 0.1", "gate < 0.5"], rows),
        "## Plots",
        "![F-Attn per layer](first_token_attention.png)\n\n![F-Attn by position](first_token_attention_by_position.png)"
        "\n\n![M-Act per layer](max_activation.png)\n\n![attention maps](attention_maps.png)"
        + ("\n\n![gate histograms](gate_histograms.png)" if gated else ""),
    ]) + "\n"
    (folder / "report.md").write_text(text)
    write_json(folder / "report.json", {"meta": meta, "summary": summary, "layers": layers,
                                        "gate_histogram_edges": result["gate_histogram_edges"]})
    return text


def _head_mean(per_head: list[list[float]]) -> list[float]:
    return [sum(col) / len(col) for col in zip(*per_head)]


# -------------------------------------------------------------------------------------------------- reproduce
def directions(results: dict[tuple[str, float], dict], learning_rates: tuple[float, float]) -> list[dict]:
    """The paper's directions, checked on the numbers: each `{"claim", "holds" (bool or None if a variant is
    missing), "numbers"}`."""
    standard, high = learning_rates

    def get(variant, lr, *keys):
        run = results.get((variant, lr))
        if run is None:
            return None
        value = run
        for key in keys:
            value = value[key]
        return value

    checks = []
    for lr in (standard, high):
        base, g1 = get("baseline", lr, "analysis", "summary"), get("g1-elementwise", lr, "analysis", "summary")
        for metric, name in (("first_token_attention", "F-Attn"), ("max_activation", "M-Act")):
            holds = None if base is None or g1 is None else base[metric] > g1[metric]
            checks.append({"claim": f"baseline {name} above G1 elementwise's (lr {lr:g})", "holds": holds,
                           "numbers": {"baseline": base and base[metric], "g1-elementwise": g1 and g1[metric]}})
        for control in ("ns-sigmoid", "input-independent"):
            c = get(control, lr, "analysis", "summary")
            holds = None
            if base and g1 and c:
                holds = abs(c["first_token_attention"] - base["first_token_attention"]) < abs(
                    g1["first_token_attention"] - base["first_token_attention"])
            checks.append({"claim": f"{control} F-Attn closer to the baseline's than G1 elementwise's (lr {lr:g})",
                           "holds": holds, "numbers": {v: s and s["first_token_attention"] for v, s in
                                                       (("baseline", base), ("g1-elementwise", g1), (control, c))}})
    rise_base, rise_g1 = get("baseline", high, "loss_max_rise"), get("g1-elementwise", high, "loss_max_rise")
    checks.append({"claim": f"smaller loss spikes for G1 elementwise than for the baseline (lr {high:g})",
                   "holds": None if rise_base is None or rise_g1 is None else rise_g1 < rise_base,
                   "numbers": {"baseline": rise_base, "g1-elementwise": rise_g1}})
    loss_base, loss_g1 = get("baseline", high, "heldout_loss"), get("g1-elementwise", high, "heldout_loss")
    checks.append({"claim": f"lower held-out loss for G1 elementwise than for the baseline (lr {high:g})",
                   "holds": None if loss_base is None or loss_g1 is None else loss_g1 < loss_base,
                   "numbers": {"baseline": loss_base, "g1-elementwise": loss_g1}})
    return checks


def reproduce_tables(results: dict[tuple[str, float], dict], variants: list[str],
                     learning_rates: tuple[float, float]) -> tuple[str, str, str]:
    """The miniature of the paper's table 4 (standard learning rate), of table 2 (both learning rates) and the
    extrapolation table, as markdown."""
    standard, high = learning_rates
    rows4 = []
    for v in variants:
        r = results[(v, standard)]
        s = r["analysis"]["summary"]
        rows4.append([v, r["gate_parameters"], r["heldout_loss"], r["heldout_ppl"], s["first_token_attention"],
                      s["max_activation"], s["sdpa_output_mean_abs"], s["gated_output_mean_abs"], s["gate_mean"],
                      s["gate_below_0.1"]])
    table4 = markdown_table(["variant", "+params", "held-out loss", "PPL", "F-Attn", "M-Act", "abs SDPA out",
                             "after gate", "gate mean", "gate < 0.1"], rows4)
    rows2 = []
    for v in variants:
        a, b = results[(v, standard)], results[(v, high)]
        rows2.append([v, a["heldout_ppl"], b["heldout_ppl"], a["loss_max_rise"], b["loss_max_rise"],
                      b["analysis"]["summary"]["first_token_attention"], b["analysis"]["summary"]["max_activation"],
                      b["analysis"]["summary"]["gate_mean"]])
    table2 = markdown_table(["variant", f"PPL lr {standard:g}", f"PPL lr {high:g}", f"loss spike lr {standard:g}",
                             f"loss spike lr {high:g}", f"F-Attn lr {high:g}", f"M-Act lr {high:g}",
                             f"gate mean lr {high:g}"], rows2)
    lengths = [row["length"] for row in results[(variants[0], standard)]["extrapolation"]]
    yarn = "ppl_yarn" in results[(variants[0], standard)]["extrapolation"][0]
    header = ["variant"] + [f"PPL @{n}" for n in lengths] + ([f"YaRN @{n}" for n in lengths] if yarn else [])
    rows5 = []
    for v in variants:
        table = results[(v, standard)]["extrapolation"]
        rows5.append([v] + [row["ppl"] for row in table] + ([row["ppl_yarn"] for row in table] if yarn else []))
    return table4, table2, markdown_table(header, rows5)


def write_reproduce(folder: Path, preset_info: dict, variants: list[str], learning_rates: tuple[float, float],
                    runs: list[dict], meta: dict) -> str:
    """Writes report.md, report.json and the plots of a `reproduce` run into `folder`; returns the markdown."""
    from .reproduce import SPIKE_WINDOW, run_name

    results = {(r["variant"], r["learning_rate"]): r for r in runs}
    standard, high = learning_rates
    seq_len = preset_info["seq_len"]
    losses = {lr: {v: results[(v, lr)]["train_loss"] for v in variants} for lr in learning_rates}
    plots.loss_curves({f"learning rate {lr:g}": losses[lr] for lr in learning_rates}, folder / "loss_curves.png")
    layers = {lr: {v: results[(v, lr)]["analysis"]["layers"] for v in variants} for lr in learning_rates}
    first_token = {lr: {v: [e["first_token_attention"] for e in layers[lr][v]] for v in variants}
                   for lr in learning_rates}
    max_act = {lr: {v: [e["max_activation"] for e in layers[lr][v]] for v in variants} for lr in learning_rates}
    for lr, suffix in ((standard, ""), (high, "_high_lr")):
        plots.per_layer(first_token[lr], folder / f"first_token_attention{suffix}.png", "attention on token 0",
                        f"F-Attn per layer, lr {lr:g}")
        plots.per_layer(max_act[lr], folder / f"max_activation{suffix}.png", "max |hidden state|",
                        f"M-Act per layer, lr {lr:g}", log=True)
    gated = [v for v in variants if results[(v, standard)]["analysis"]["summary"]["gate_mean"] is not None]
    histograms = {v: [_head_mean(e["gate"]["histogram_per_head"]) for e in layers[standard][v] if e["gate"]]
                  for v in gated}
    edges = results[(variants[0], standard)]["analysis"]["gate_histogram_edges"]
    if gated:
        plots.per_layer({v: [e["gate"]["mean"] if e["gate"] else 0.0 for e in layers[standard][v]] for v in gated},
                        folder / "gate_mean.png", "mean gate score", f"mean gate score per layer, lr {standard:g}")
        plots.gate_histograms(histograms, edges, folder / "gate_histograms.png")
    by_pos = {v: results[(v, standard)]["tensors"]["first_token_attention_by_position"].mean(0) for v in variants}
    plots.by_position(by_pos, folder / "first_token_attention_by_position.png",
                      f"F-Attn by query position (mean over layers and heads), lr {standard:g}")
    plots.overview(first_token[standard], max_act[standard], by_pos, f"lr {standard:g}", histograms, edges,
                   losses[high], f"training loss at the high learning rate, {high:g}", folder / "overview.png")
    last = preset_info["num_hidden_layers"] - 1
    shown = [v for v in ("baseline", "g1-elementwise") if v in variants] or variants[:2]
    plots.attention_maps({v: {last: results[(v, standard)]["tensors"]["attention_maps"][last]} for v in shown},
                         folder / "attention_maps.png")
    plots.extrapolation({v: results[(v, standard)]["extrapolation"] for v in variants}, seq_len,
                        folder / "extrapolation.png")

    table4, table2, table5 = reproduce_tables(results, variants, learning_rates)
    checks = directions(results, learning_rates)
    verdicts = "\n".join(
        f"- {c['claim']}: **{'yes' if c['holds'] else 'no' if c['holds'] is False else 'not run'}** ("
        + ", ".join(f"{k} {_fmt(v, 4)}" for k, v in c["numbers"].items()) + ")" for c in checks)
    text = "\n\n".join([
        "# gated-qwen reproduce: the paper's tables 2 and 4 in miniature",
        f"{len(variants)} variants x learning rates {standard:g} and {high:g}; {preset_info['steps']} steps of "
        f"{preset_info['batch_size']} x {seq_len} tokens; {preset_info['num_hidden_layers']} layers, hidden "
        f"{preset_info['hidden_size']}, {preset_info['num_attention_heads']} query / "
        f"{preset_info['num_key_value_heads']} kv heads of {preset_info['head_dim']}. Built-in synthetic corpus "
        f"(`gated_qwen.analysis.data.SyntheticLanguage`, {json.dumps(preset_info['language'])}); measured on held-out "
        f"documents. Seed {meta['seed']}; {meta['seconds']:.0f} s on {meta['device']}.",
        f"## Sink, activations and gates (table 4), learning rate {standard:g}",
        table4,
        "F-Attn: attention on the first token (BOS), mean over heads, layers and query positions. M-Act: largest "
        "|hidden state| a layer outputs. abs SDPA out / after gate: mean |attention output| per element before the "
        "gate and as o_proj receives it. Gate scores: every score of every held-out token. +params: gate parameters.",
        "## Stability (table 2): both learning rates",
        table2,
        f"loss spike: the largest rise of the {SPIKE_WINDOW}-step moving average of the training loss above its "
        "lowest earlier value (nats; 0 for a curve that never goes back up).",
        f"## Beyond the training length ({seq_len} tokens), learning rate {standard:g}",
        table5,
        "## The paper's directions, checked on these numbers",
        verdicts,
        "## Plots",
        "\n\n".join(f"![{name}]({name}.png)" for name in (
            "overview", "loss_curves", "first_token_attention", "first_token_attention_high_lr",
            "first_token_attention_by_position", "max_activation",
            "max_activation_high_lr", *(("gate_mean", "gate_histograms") if gated else ()), "attention_maps",
            "extrapolation")),
        "Models: `models/<variant>-lr<learning rate>/` (load with `AutoModelForCausalLM.from_pretrained`); held-out "
        "documents: `heldout.safetensors` (`input_ids`).",
    ]) + "\n"
    (folder / "report.md").write_text(text)
    write_json(folder / "report.json", {
        "meta": meta, "preset": preset_info, "variants": variants, "learning_rates": list(learning_rates),
        "directions": checks,
        "runs": {run_name(r["variant"], r["learning_rate"]): {k: v for k, v in r.items() if k != "tensors"}
                 for r in runs},
    })
    return text
