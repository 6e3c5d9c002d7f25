"""Writes what `analyze` and `reproduce` found: `report.json`, `report.md` and PNG plots, into a folder (the
command's staging folder from `gated_qwen.outputs`, which appears whole or not at all)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..outputs import write_json
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
    (folder / "report.md").write_text(text)
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


# -------------------------------------------------------------------------------------------------- reproduce
# The issue's yardsticks for "the direction appears in miniature" (the paper's table 4: F-Attn 0.467 -> 0.048,
# mean gate score 0.116, M-Act 1053 -> 94).
SINK_LEVEL = 0.3  # F-Attn of a strong attention sink (a layer, head, or the whole baseline)
SINK_REMOVAL = 3.0  # baseline F-Attn at least this many times G1 elementwise's
SPARSE_GATE = 0.3  # G1 elementwise's mean gate score at most this
NEAR_ZERO = 0.1  # the gate histogram's most common bin lies below this score
MASSIVE_ACTIVATION_RATIO = 2.0  # baseline M-Act at least this many times G1 elementwise's
# Longer contexts (the paper's table 5: RULER with YaRN at 32k / 64k / 128k, gated 72.9 / 66.6 / 58.8 against the
# baseline's 37.9 / 37.5 / 31.7) and low-bit inference, stated before the runs that decide them (issue 23):
RECALL_AT_TRAINING_LENGTH = 0.9  # every long-context model retrieves at least this well at its training length
RECALL_GAIN = 0.05  # with YaRN, G1's retrieval accuracy at each of 2x, 4x, 8x at least this far above the baseline's
# ... and with YaRN, G1's perplexity at 8x the training length below the baseline's. Under each fake-quantization
# scheme, G1 elementwise's relative perplexity increase (quantized / float - 1) below the baseline's, on the M-Act
# models and on the main models.

Results = dict[tuple[str, float, int], dict]  # (variant, learning rate, seed) -> train_and_measure's result


def sink_heads(layers: list[dict], level: float = SINK_LEVEL) -> list[tuple[int, int]]:
    """`(layer, head)` of every head whose F-Attn (over all query positions) is at least `level`; `layers` as in
    `analyze(...)["layers"]`."""
    return [(e["layer"], h) for e in layers for h, p in enumerate(e["first_token_attention_per_head"]) if p >= level]


def gate_histogram_mode(layers: list[dict], heads: list[tuple[int, int]], edges: list[float]) -> tuple[float, float]:
    """The `[low, high)` score bin holding most of the gate scores of `heads` (`(layer, head)` of a gated model's
    `layers`, pooled with equal weight), or of every gated head when `heads` is empty."""
    chosen = [e["gate"]["histogram_per_head"][h] for layer, h in heads for e in layers
              if e["layer"] == layer and e["gate"] is not None]
    if not heads:
        chosen = [row for e in layers if e["gate"] is not None for row in e["gate"]["histogram_per_head"]]
    pooled = [sum(col) for col in zip(*chosen)]
    top = max(range(len(pooled)), key=pooled.__getitem__)
    return edges[top], edges[top + 1]


def _verdict(per_seed: dict[int, dict]) -> str:
    held = [c["holds"] for c in per_seed.values() if c["holds"] is not None]
    if not held:
        return "not run"
    if all(held):
        return "yes"
    if not any(held):
        return "no"
    return f"in {sum(held)} of {len(held)} seeds"


def directions(results: Results, learning_rates: tuple[float, float], seeds: list[int],
               mact: tuple[Results, float] | None = None,
               long_context: tuple[Results, float] | None = None) -> list[dict]:
    """The paper's directions, checked on the numbers of every seed: each `{"claim", "verdict" ("yes": every seed,
    "no": none, "in k of n seeds", "not run": a variant is missing), "per_seed": {seed: {"holds" (bool or None),
    "numbers"}}}`. `mact`: the M-Act model's results and learning rate; M-Act is then compared on it first, and on
    `results` (the main models) after, and so is the loss under quantization. `long_context`: the long-context
    model's results and learning rate, on which recall and perplexity beyond the training length are compared (the
    first `extrapolation` row of a run is its training length)."""
    standard, high = learning_rates

    def run(variant, lr, seed):
        return results.get((variant, lr, seed))

    def summary(variant, lr, seed):
        r = run(variant, lr, seed)
        return r and r["analysis"]["summary"]

    def check(claim: str, evaluate) -> dict:
        per_seed = {seed: dict(zip(("holds", "numbers"), evaluate(seed))) for seed in seeds}
        return {"claim": claim, "verdict": _verdict(per_seed), "per_seed": per_seed}

    def strong_sink(seed):
        r = run("baseline", standard, seed)
        if r is None:
            return None, {}
        f = r["analysis"]["summary"]["first_token_attention"]
        numbers = {"baseline F-Attn": f, "lowest quarter": min(r["sink"]["by_part"])}
        if r["sink"].get("other") is not None:
            numbers["at non-trigger queries"] = r["sink"]["other"]
        return f >= SINK_LEVEL, numbers

    def removal(seed):
        base, g1 = summary("baseline", standard, seed), summary("g1-elementwise", standard, seed)
        if base is None or g1 is None:
            return None, {}
        b, g = base["first_token_attention"], g1["first_token_attention"]
        return b >= SINK_REMOVAL * g, {"baseline": b, "g1-elementwise": g, "ratio": b / g if g > 0 else math.inf}

    def sparse(seed):
        base, g1 = run("baseline", standard, seed), run("g1-elementwise", standard, seed)
        if base is None or g1 is None:
            return None, {}
        heads = sink_heads(base["analysis"]["layers"])
        low, high_edge = gate_histogram_mode(g1["analysis"]["layers"], heads, g1["analysis"]["gate_histogram_edges"])
        mean = g1["analysis"]["summary"]["gate_mean"]
        return mean <= SPARSE_GATE and high_edge <= NEAR_ZERO + 1e-9, {
            "gate mean": mean, "scores < 0.1": g1["analysis"]["summary"]["gate_below_0.1"],
            "mode bin": f"[{low:.2f}, {high_edge:.2f})",
            "in heads": ", ".join(f"L{layer}H{h}" for layer, h in heads) or "all (no sink head in the baseline)"}

    def closer(control):
        def evaluate(seed):
            base, g1, c = (summary(v, standard, seed) for v in ("baseline", "g1-elementwise", control))
            if base is None or g1 is None or c is None:
                return None, {}
            b = base["first_token_attention"]
            return abs(c["first_token_attention"] - b) < abs(g1["first_token_attention"] - b), {
                "baseline": b, control: c["first_token_attention"], "g1-elementwise": g1["first_token_attention"]}
        return evaluate

    def massive(lr, source=results):
        def evaluate(seed):
            base, g1 = (source.get((v, lr, seed)) for v in ("baseline", "g1-elementwise"))
            if base is None or g1 is None:
                return None, {}
            b, g = base["analysis"]["summary"]["max_activation"], g1["analysis"]["summary"]["max_activation"]
            return b >= MASSIVE_ACTIVATION_RATIO * g, {"baseline": b, "g1-elementwise": g,
                                                       "ratio": b / g if g > 0 else math.inf}
        return evaluate

    def lower(key, lr):
        def evaluate(seed):
            base, g1 = run("baseline", lr, seed), run("g1-elementwise", lr, seed)
            if base is None or g1 is None:
                return None, {}
            return g1[key] < base[key], {"baseline": base[key], "g1-elementwise": g1[key]}
        return evaluate

    def recalls_at_training_length(lr, source):
        def evaluate(seed):
            chosen = {v: source.get((v, lr, seed)) for v in ("baseline", "g1-elementwise", "g1-headwise")}
            if None in chosen.values():
                return None, {}
            accuracy = {v: r["extrapolation"][0]["recall"]["accuracy"] for v, r in chosen.items()}
            return min(accuracy.values()) >= RECALL_AT_TRAINING_LENGTH, accuracy
        return evaluate

    def recalls_better(variant, lr, source):
        def evaluate(seed):
            base, gated = source.get(("baseline", lr, seed)), source.get((variant, lr, seed))
            if base is None or gated is None:
                return None, {}
            beyond = [(b["length"], b["recall_yarn"]["accuracy"], g["recall_yarn"]["accuracy"])
                      for b, g in zip(base["extrapolation"][1:], gated["extrapolation"][1:])]
            numbers = {f"{name} @{n}": value for n, *pair in beyond for name, value in zip(("baseline", variant), pair)}
            return all(g >= b + RECALL_GAIN for _, b, g in beyond), numbers
        return evaluate

    def perplexity_lower(variant, lr, source):
        def evaluate(seed):
            base, gated = source.get(("baseline", lr, seed)), source.get((variant, lr, seed))
            if base is None or gated is None:
                return None, {}
            b, g = base["extrapolation"][-1]["ppl_yarn"], gated["extrapolation"][-1]["ppl_yarn"]
            return g < b, {"baseline": b, variant: g}
        return evaluate

    def loses_less(scheme, lr, source=results):
        def evaluate(seed):
            base, g1 = (source.get((v, lr, seed)) for v in ("baseline", "g1-elementwise"))
            if base is None or g1 is None:
                return None, {}
            b, g = base["quantization"][scheme]["increase"], g1["quantization"][scheme]["increase"]
            return g < b, {"baseline PPL increase %": 100 * b, "g1-elementwise's %": 100 * g}
        return evaluate

    long_context_checks = []
    if long_context is not None:
        long_results, long_lr = long_context
        any_run = next(iter(long_results.values()))
        lengths = [row["length"] for row in any_run["extrapolation"]]
        beyond = ", ".join(f"{n // lengths[0]}x" for n in lengths[1:])
        long_context_checks = [
            check(f"the long-context model recalls at its training length ({lengths[0]} tokens): accuracy >= "
                  f"{RECALL_AT_TRAINING_LENGTH:g} for the baseline and both G1 (lr {long_lr:g})",
                  recalls_at_training_length(long_lr, long_results)),
            *(check(f"with YaRN, G1 {variant.split('-')[1]} recalls better than the baseline beyond the training "
                    f"length: accuracy at each of {beyond} at least {RECALL_GAIN:g} above (lr {long_lr:g})",
                    recalls_better(variant, long_lr, long_results)) for variant in ("g1-elementwise", "g1-headwise")),
            *(check(f"with YaRN, G1 {variant.split('-')[1]}'s perplexity at {lengths[-1] // lengths[0]}x "
                    f"({lengths[-1]} tokens) below the baseline's (lr {long_lr:g})",
                    perplexity_lower(variant, long_lr, long_results))
              for variant in ("g1-elementwise", "g1-headwise")),
        ]
    families = ([("the M-Act models", *mact)] if mact is not None else []) + [("the main models", results, standard)]
    quantization_checks = [
        check(f"under {scheme}, G1 elementwise loses less than the baseline in {family}: lower relative PPL "
              f"increase (lr {lr:g})", loses_less(scheme, lr, source))
        for family, source, lr in families for scheme in SCHEMES]

    lowers = f"baseline M-Act >= {MASSIVE_ACTIVATION_RATIO:g} x G1's"
    if mact is None:
        massive_checks = [check(f"G1 elementwise lowers massive activations: {lowers} (lr {standard:g})",
                                massive(standard))]
    else:
        mact_results, mact_lr = mact
        massive_checks = [
            check(f"G1 elementwise lowers massive activations in the M-Act model: {lowers} (lr {mact_lr:g})",
                  massive(mact_lr, mact_results)),
            check(f"... in the main models: {lowers} (lr {standard:g})", massive(standard))]
    return [
        check(f"the baseline has a strong attention sink: F-Attn >= {SINK_LEVEL:g} over all query positions "
              f"(lr {standard:g})", strong_sink),
        check(f"G1 elementwise removes it: baseline F-Attn >= {SINK_REMOVAL:g} x G1's (lr {standard:g})", removal),
        check(f"G1 elementwise's gate is sparse: mean score <= {SPARSE_GATE:g}, histogram mode below {NEAR_ZERO:g} "
              f"in the heads where the baseline sinks (lr {standard:g})", sparse),
        check(f"NS-sigmoid's F-Attn closer to the baseline's than G1 elementwise's (lr {standard:g})",
              closer("ns-sigmoid")),
        check(f"input-independent gate's F-Attn closer to the baseline's than G1 elementwise's (lr {standard:g})",
              closer("input-independent")),
        *massive_checks,
        check(f"... and at lr {high:g}", massive(high)),
        check(f"smaller loss spikes for G1 elementwise than for the baseline (lr {high:g})",
              lower("loss_max_rise", high)),
        check(f"lower held-out loss for G1 elementwise than for the baseline (lr {high:g})",
              lower("heldout_loss", high)),
        *long_context_checks,
        *quantization_checks,
    ]


def _seeds(values: list) -> str:
    """One cell for every seed's value: `a / b`."""
    return " / ".join(_fmt(v) for v in values)


def reproduce_tables(results: Results, variants: list[str], learning_rates: tuple[float, float],
                     seeds: list[int]) -> tuple[str, str, str]:
    """The miniature of the paper's table 4 (standard learning rate), of table 2 (both learning rates) and the
    extrapolation table (first seed), as markdown; a cell holds every seed's number, `a / b`."""
    standard, high = learning_rates

    def cell(variant, lr, get):
        values = [get(results[(variant, lr, seed)]) if (variant, lr, seed) in results else None for seed in seeds]
        return _seeds(values) if any(v is not None for v in values) else None

    def summary(key):
        return lambda r: r["analysis"]["summary"][key]

    rows4 = [[v, results[(v, standard, seeds[0])]["gate_parameters"], cell(v, standard, lambda r: r["heldout_ppl"]),
              cell(v, standard, summary("first_token_attention")), cell(v, standard, lambda r: r["sink"].get("other")),
              cell(v, standard, lambda r: r["sink"].get("trigger")), cell(v, standard, summary("max_activation")),
              cell(v, standard, summary("sdpa_output_mean_abs")), cell(v, standard, summary("gated_output_mean_abs")),
              cell(v, standard, summary("gate_mean")), cell(v, standard, summary("gate_below_0.1"))]
             for v in variants]
    table4 = markdown_table(["variant", "+params", "held-out PPL", "F-Attn", "F-Attn, non-trigger queries",
                             "F-Attn, trigger queries", "M-Act", "abs SDPA out", "after gate", "gate mean",
                             "gate < 0.1"], rows4)
    rows2 = [[v, cell(v, standard, lambda r: r["heldout_ppl"]), cell(v, high, lambda r: r["heldout_ppl"]),
              cell(v, standard, lambda r: r["loss_max_rise"]), cell(v, high, lambda r: r["loss_max_rise"]),
              cell(v, high, summary("first_token_attention")), cell(v, high, summary("max_activation")),
              cell(v, high, summary("gate_mean"))] for v in variants]
    table2 = markdown_table(["variant", f"PPL lr {standard:g}", f"PPL lr {high:g}", f"loss spike lr {standard:g}",
                             f"loss spike lr {high:g}", f"F-Attn lr {high:g}", f"M-Act lr {high:g}",
                             f"gate mean lr {high:g}"], rows2)
    first = results[(variants[0], standard, seeds[0])]["extrapolation"]
    lengths = [row["length"] for row in first]
    yarn = "ppl_yarn" in first[0]
    header = ["variant"] + [f"PPL @{n}" for n in lengths] + ([f"YaRN @{n}" for n in lengths] if yarn else [])
    rows5 = []
    for v in variants:
        table = results[(v, standard, seeds[0])]["extrapolation"]
        rows5.append([v] + [row["ppl"] for row in table] + ([row["ppl_yarn"] for row in table] if yarn else []))
    return table4, table2, markdown_table(header, rows5)


def _verdict_line(check: dict) -> str:
    seeds = "; ".join(f"seed {seed}: " + ", ".join(f"{k} {_fmt(v, 3)}" for k, v in c["numbers"].items())
                      for seed, c in check["per_seed"].items() if c["numbers"])
    return f"- {check['claim']}: **{check['verdict']}**" + (f" ({seeds})" if seeds else "")


def write_reproduce(folder: Path, preset_info: dict, variants: list[str], learning_rates: tuple[float, float],
                    runs: list[dict], meta: dict) -> str:
    """Writes report.md, report.json and the plots of a `reproduce` run into `folder` (plots of the first seed);
    returns the markdown."""
    from .reproduce import SEQUENCE_PARTS, SPIKE_WINDOW, run_name

    results = {(r["variant"], r["learning_rate"], r["seed"]): r for r in runs if r["part"] == "main"}
    mact_results = {(r["variant"], r["learning_rate"], r["seed"]): r for r in runs if r["part"] == "mact"}
    long_results = {(r["variant"], r["learning_rate"], r["seed"]): r for r in runs if r["part"] == "long"}
    seeds = list(dict.fromkeys(r["seed"] for r in runs))
    seed = seeds[0]
    standard, high = learning_rates
    at_high = [v for v in variants if (v, high, seed) in results]
    seq_len = preset_info["seq_len"]
    losses = {lr: {v: results[(v, lr, seed)]["train_loss"] for v in variants if (v, lr, seed) in results}
              for lr in learning_rates}
    plots.loss_curves({f"learning rate {lr:g}": losses[lr] for lr in learning_rates}, folder / "loss_curves.png")
    layers = {lr: {v: results[(v, lr, seed)]["analysis"]["layers"] for v in losses[lr]} for lr in learning_rates}
    first_token = {lr: {v: [e["first_token_attention"] for e in layers[lr][v]] for v in layers[lr]}
                   for lr in learning_rates}
    max_act = {lr: {v: [e["max_activation"] for e in layers[lr][v]] for v in layers[lr]} for lr in learning_rates}
    for lr, suffix in ((standard, ""), (high, "_high_lr")):
        plots.per_layer(first_token[lr], folder / f"first_token_attention{suffix}.png", "attention on token 0",
                        f"F-Attn per layer, lr {lr:g}, seed {seed}")
        plots.per_layer(max_act[lr], folder / f"max_activation{suffix}.png", "max |hidden state|",
                        f"M-Act per layer, lr {lr:g}, seed {seed}", log=True)
    gated = [v for v in variants if results[(v, standard, seed)]["analysis"]["summary"]["gate_mean"] is not None]
    histograms = {v: [_head_mean(e["gate"]["histogram_per_head"]) for e in layers[standard][v] if e["gate"]]
                  for v in gated}
    edges = results[(variants[0], standard, seed)]["analysis"]["gate_histogram_edges"]
    if gated:
        plots.per_layer({v: [e["gate"]["mean"] if e["gate"] else 0.0 for e in layers[standard][v]] for v in gated},
                        folder / "gate_mean.png", "mean gate score",
                        f"mean gate score per layer, lr {standard:g}, seed {seed}")
        plots.gate_histograms(histograms, edges, folder / "gate_histograms.png")
    by_pos = {v: results[(v, standard, seed)]["tensors"]["first_token_attention_by_position"].mean(0)
              for v in variants}
    plots.by_position(by_pos, folder / "first_token_attention_by_position.png",
                      f"F-Attn by query position (mean over layers and heads), lr {standard:g}, seed {seed}")
    plots.overview(first_token[standard], max_act[standard], by_pos, f"lr {standard:g}, seed {seed}", histograms,
                   edges, losses[high], f"training loss at the high learning rate, {high:g}, seed {seed}",
                   folder / "overview.png")
    last = preset_info["num_hidden_layers"] - 1
    shown = [v for v in ("baseline", "g1-elementwise") if v in variants] or variants[:2]
    plots.attention_maps({v: {layer: results[(v, standard, seed)]["tensors"]["attention_maps"][layer]
                              for layer in sorted({0, last})} for v in shown}, folder / "attention_maps.png")
    plots.extrapolation({v: results[(v, standard, seed)]["extrapolation"] for v in variants}, seq_len,
                        folder / "extrapolation.png")

    table4, table2, table5 = reproduce_tables(results, variants, learning_rates, seeds)
    mact = (mact_results, preset_info["mact"]["learning_rates"][0]) if mact_results else None
    long_context = (long_results, preset_info["long_context"]["learning_rates"][0]) if long_results else None
    checks = directions(results, learning_rates, seeds, mact, long_context)
    mact_section = _mact_section(mact_results, preset_info, seeds, folder) if mact_results else []
    long_section = _long_context_section(long_results, preset_info, seeds, folder) if long_results else []
    quantization_section = _quantization_tables(results, variants, standard, mact_results,
                                                mact and mact[1], seeds)
    seed_text = " / ".join(str(s) for s in seeds)
    corpus = preset_info.get("corpus", "")
    text = "\n\n".join([
        "# gated-qwen reproduce: the paper's tables 2 and 4 in miniature",
        f"{len(variants)} variants at learning rate {standard:g}, {len(at_high)} of them also at {high:g}; seeds "
        f"{seed_text}; {preset_info['steps']} steps of {preset_info['batch_size']} x {seq_len} tokens; "
        f"{preset_info['num_hidden_layers']} layers, hidden {preset_info['hidden_size']}, "
        f"{preset_info['num_attention_heads']} query / {preset_info['num_key_value_heads']} kv heads of "
        f"{preset_info['head_dim']}, QK-norm {'on' if preset_info['use_qk_norm'] else 'off'}, gradient clipping "
        f"{preset_info['max_grad_norm'] or 'off'}{', bf16 autocast' if preset_info['bf16'] else ''}. Built-in corpus "
        f"`{corpus}` ({json.dumps(preset_info['language'])}); measured on held-out documents. "
        f"{meta['seconds']:.0f} s on {meta['device']}"
        + (f", with the {' and the '.join(extra)} (below)." if (extra := [
            name for name, chosen in (("M-Act model", mact_results), ("long-context model", long_results)) if chosen])
           else "."),
        f"## Sink, activations and gates (table 4), learning rate {standard:g}; each cell: seed {seed_text}",
        table4,
        "F-Attn: attention on the first token (BOS), mean over heads, layers and query positions 1..S-1; also over "
        "the queries that are not triggers (where a copying head has nothing to do) and those that are. M-Act: "
        "largest |hidden state| a layer outputs. abs SDPA out / after gate: mean |attention output| per element "
        "before the gate and as o_proj receives it. Gate scores: every score of every held-out token. +params: gate "
        "parameters.",
        f"## Stability (table 2): both learning rates; each cell: seed {seed_text}",
        table2,
        f"loss spike: the largest rise of the {SPIKE_WINDOW}-step moving average of the training loss above its "
        "lowest earlier value (nats; 0 for a curve that never goes back up).",
        *mact_section,
        f"## Beyond the training length ({seq_len} tokens), learning rate {standard:g}, seed {seed}",
        table5,
        *long_section,
        *quantization_section,
        "## The paper's directions, checked on these numbers (every seed)",
        "\n".join(_verdict_line(c) for c in checks),
        f"Lowest quarter: the lowest F-Attn over {SEQUENCE_PARTS} consecutive parts of the query positions. Heads "
        "are matched by layer and index (the baseline's sink heads, G1's gate scores in the same places).",
        f"## Plots (seed {seed})",
        "\n\n".join(f"![{name}]({name}.png)" for name in (
            "overview", "loss_curves", "first_token_attention", "first_token_attention_high_lr",
            "first_token_attention_by_position", "max_activation",
            "max_activation_high_lr", *(("max_activation_mact",) if mact_results else ()),
            *(("gate_mean", "gate_histograms") if gated else ()), "attention_maps", "extrapolation",
            *(("recall_by_length",) if long_results else ()))),
        "Models: `models/<variant>-lr<learning rate>-seed<seed>/` (load with `AutoModelForCausalLM.from_pretrained`), "
        "the M-Act model's as `models/mact-<variant>-...`, the long-context model's as `models/long-<variant>-...`; "
        "held-out documents: `heldout.safetensors` and `heldout_mact.safetensors` (`input_ids`), "
        "`heldout_long_context.safetensors` (`input_ids_<length>`, one tensor per length).",
    ]) + "\n"
    (folder / "report.md").write_text(text)
    write_json(folder / "report.json", {
        "meta": meta, "preset": preset_info, "variants": variants, "learning_rates": list(learning_rates),
        "seeds": seeds, "directions": checks,
        **{key: {run_name(*name): {k: v for k, v in r.items() if k != "tensors"} for name, r in chosen.items()}
           for key, chosen in (("runs", results), ("mact_runs", mact_results), ("long_context_runs", long_results))},
    })
    return text


def _mact_section(results: Results, preset_info: dict, seeds: list[int], folder: Path) -> list[str]:
    """The M-Act model's part of report.md (a table row per variant and seed) and its plot (first seed); `results`
    holds every run of `reproduce.mact_runs`."""
    from .reproduce import MACT_VARIANTS

    info = preset_info["mact"]
    lr = info["learning_rates"][0]
    plots.per_layer({v: [e["max_activation"] for e in results[(v, lr, seeds[0])]["analysis"]["layers"]]
                     for v in MACT_VARIANTS}, folder / "max_activation_mact.png",
                    "max |hidden state|", f"M-Act model: M-Act per layer, lr {lr:g}, seed {seeds[0]}", log=True)
    rows = []
    for v in MACT_VARIANTS:
        for seed in seeds:
            r = results[(v, lr, seed)]
            layers, summary = r["analysis"]["layers"], r["analysis"]["summary"]
            rows.append([v, seed, r["heldout_ppl"], summary["first_token_attention"], summary["max_activation"],
                         ", ".join(_fmt(e["max_activation"], 1) for e in layers),
                         ", ".join(str(e["max_activation_position"]) for e in layers), summary["gate_mean"]])
    return [
        f"## Massive activations in the M-Act model, learning rate {lr:g}",
        f"{info['num_hidden_layers']} layers, hidden {info['hidden_size']}, {info['num_attention_heads']} query / "
        f"{info['num_key_value_heads']} kv heads of {info['head_dim']}, QK-norm {'on' if info['use_qk_norm'] else 'off'}"
        f"; {info['steps']} steps of {info['batch_size']} x {info['seq_len']} tokens of the built-in corpus "
        f"`{info['corpus']}` ({json.dumps(info['language'])}); baseline and G1 elementwise only. In a model of one "
        "layer, M-Act is that layer's output, which only the final RMSNorm reads, so nothing fixes its scale; in LLMs "
        "the massive activation appears in an early layer at the first token and the residual stream carries it to "
        "the later layers' attention. This model has layers to carry it.",
        markdown_table(["variant", "seed", "held-out PPL", "F-Attn", "M-Act", "M-Act per layer",
                        "position of each layer's max", "gate mean"], rows),
    ]


def _long_context_section(results: Results, preset_info: dict, seeds: list[int], folder: Path) -> list[str]:
    """The long-context model's part of report.md (recall and perplexity at every length, without / with YaRN, a
    row per variant and seed) and its plot (first seed); `results` holds every run of `reproduce.long_context_runs`."""
    from .reproduce import LONG_CONTEXT_VARIANTS

    info = preset_info["long_context"]
    lr = info["learning_rates"][0]
    first = results[(LONG_CONTEXT_VARIANTS[0], lr, seeds[0])]["extrapolation"]
    lengths = [row["length"] for row in first]
    plots.extrapolation({v: results[(v, lr, seeds[0])]["extrapolation"] for v in LONG_CONTEXT_VARIANTS},
                        info["seq_len"], folder / "recall_by_length.png", value=lambda r: r["recall"]["accuracy"],
                        yarn_value=lambda r: r["recall_yarn"]["accuracy"], ylabel="recall accuracy")

    def table(get) -> str:
        rows = [[v, seed, *(f"{_fmt(get(row, ''))} / {_fmt(get(row, '_yarn'))}"
                            for row in results[(v, lr, seed)]["extrapolation"])]
                for v in LONG_CONTEXT_VARIANTS for seed in seeds]
        return markdown_table(["variant", "seed", *(f"@{n} ({n // lengths[0]}x)" for n in lengths)], rows)

    return [
        f"## Longer contexts: the long-context model, learning rate {lr:g}",
        f"{info['num_hidden_layers']} layer(s), hidden {info['hidden_size']}, {info['num_attention_heads']} query / "
        f"{info['num_key_value_heads']} kv heads of {info['head_dim']}, QK-norm {'on' if info['use_qk_norm'] else 'off'}"
        f"; {info['steps']} steps of {info['batch_size']} x {info['seq_len']} tokens of the built-in corpus "
        f"`{info['corpus']}` ({json.dumps(info['language'])}): each document holds facts (one token per key and "
        "value) in its first half and, in its second half, each fact's key followed by its value, which only the fact "
        f"tells. Evaluated on {first[0]['sequences']} held-out documents drawn at each length "
        f"({first[0]['recall']['positions']} values to recall), with YaRN factor {lengths[-1] // lengths[0]} over the "
        "training length and without.",
        "Recall accuracy (each cell: without / with YaRN): the share of the values after a key that the model "
        "predicts (most likely next token).",
        table(lambda row, yarn: row[f"recall{yarn}"]["accuracy"]),
        "Perplexity over every position (without / with YaRN):",
        table(lambda row, yarn: row[f"ppl{yarn}"]),
    ]


def _quantization_tables(results: Results, variants: list[str], lr: float, mact_results: Results,
                         mact_lr: float | None, seeds: list[int]) -> list[str]:
    """The low-bit inference part of report.md: held-out perplexity in float and its increase under each scheme, for
    the M-Act models (if any) and the main models at learning rate `lr`, a row per variant and seed."""
    from .reproduce import MACT_VARIANTS

    families = ([("M-Act model", mact_results, MACT_VARIANTS, mact_lr)] if mact_results else []) + [
        ("main", results, variants, lr)]
    rows = [[family, v, seed, r["quantization"]["float"]["ppl"],
             *(_increase(r["quantization"][name]["increase"]) for name in SCHEMES)]
            for family, chosen, names, at in families for v in names for seed in seeds
            if (r := chosen.get((v, at, seed))) is not None]
    return [
        "## Low-bit inference: held-out perplexity under fake quantization",
        markdown_table(["model", "variant", "seed", "float PPL", *SCHEMES], rows),
        "Each cell: the PPL increase. " + "; ".join(f"{name}: {scheme}" for name, scheme in SCHEMES.items()) + ". "
        + QUANTIZATION_NOTE + " Standard learning rate"
        + (f" ({lr:g}; the M-Act model's {mact_lr:g})." if mact_results else f" ({lr:g})."),
    ]
