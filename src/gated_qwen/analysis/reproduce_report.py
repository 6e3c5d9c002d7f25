"""What `gated-qwen reproduce` writes: `report.md`, `report.json`, `directions.json` (the judged directions alone,
small enough to commit) and PNG plots, into a folder (the command's staging folder from `gated_qwen.files`).

The tables of numbers come first, per model family; then every direction of `directions.DIRECTIONS` whose models
were trained, with its per-seed numbers, the 95% interval and the verdict (`directions.judge`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..files import write_json
from . import directions, plots
from .quantize import SCHEMES
from .report import QUANTIZATION_NOTE, _fmt, _head_mean, _increase, markdown_table

Results = dict[tuple[str, float, int], dict]  # (variant, learning rate, seed) -> train_and_measure's result
PARTS = ("main", "mact", "long")  # a run's "part": the one-layer models, the M-Act model, the long-context model
FAMILY_KEYS = {"main": None, "mact": "mact", "long": "long_context"}  # where preset_info holds each family's preset


def by_part(runs: list[dict]) -> dict[str, Results]:
    """`run_all`'s results keyed by (variant, learning rate, seed), per part."""
    return {part: {(r["variant"], r["learning_rate"], r["seed"]): r for r in runs if r["part"] == part}
            for part in PARTS}


def families(parts: dict[str, Results], preset_info: dict) -> dict[str, dict]:
    """What `directions.judge` reads for each family that was trained: its runs, learning rates (standard, high),
    seeds and tuning seeds (from each family's preset)."""
    chosen = {}
    for part, key in FAMILY_KEYS.items():
        info = preset_info if key is None else preset_info.get(key)
        if info is None or not parts[part]:
            continue
        standard, high = info["learning_rates"]
        chosen[part] = {"runs": parts[part], "learning_rates": {"standard": standard, "high": high},
                        "seeds": list(info["seeds"]), "tuning_seeds": list(info.get("tuning_seeds", []))}
    return chosen


def write_reproduce(folder: Path, preset_info: dict, variants: list[str], learning_rates: tuple[float, float],
                    runs: list[dict], meta: dict) -> str:
    """Writes report.md, report.json, directions.json and the plots of a `reproduce` run into `folder` (plots of the
    first seed); returns the markdown."""
    from .reproduce import run_name

    parts = by_part(runs)
    seeds = list(dict.fromkeys(r["seed"] for r in runs))
    judged, not_run = directions.judge(families(parts, preset_info))
    _plots(folder, preset_info, variants, learning_rates, parts, seeds[0])
    text = _text(preset_info, variants, learning_rates, parts, seeds, judged, not_run, meta, folder)
    (folder / "report.md").write_text(text)
    summary = {"meta": meta, "preset": preset_info, "variants": variants, "learning_rates": list(learning_rates),
               "seeds": seeds, "directions": judged, "not_run": not_run}
    write_json(folder / "directions.json", summary)
    write_json(folder / "report.json", {**summary, **{
        key: {run_name(*name): {k: v for k, v in r.items() if k != "tensors"} for name, r in parts[part].items()}
        for key, part in (("runs", "main"), ("mact_runs", "mact"), ("long_context_runs", "long"))}})
    return text


def _plots(folder: Path, preset_info: dict, variants: list[str], learning_rates: tuple[float, float],
           parts: dict[str, Results], seed: int) -> None:
    """The main models' plots at `seed`: loss curves, F-Attn and M-Act per layer at both rates, gate scores,
    F-Attn by position, an overview, attention maps and perplexity by length."""
    results, (standard, high) = parts["main"], learning_rates
    runs = {lr: {v: results[(v, lr, seed)] for v in variants if (v, lr, seed) in results} for lr in learning_rates}
    losses = {lr: {v: r["train_loss"] for v, r in runs[lr].items()} for lr in learning_rates}
    plots.loss_curves({f"learning rate {lr:g}": losses[lr] for lr in learning_rates}, folder / "loss_curves.png")
    per_layer = {lr: {key: {v: [e[key] for e in r["analysis"]["layers"]] for v, r in runs[lr].items()}
                      for key in ("first_token_attention", "max_activation")} for lr in learning_rates}
    for lr, suffix in ((standard, ""), (high, "_high_lr")):
        plots.per_layer(per_layer[lr]["first_token_attention"], folder / f"first_token_attention{suffix}.png",
                        "attention on token 0", f"F-Attn per layer, lr {lr:g}, seed {seed}")
        plots.per_layer(per_layer[lr]["max_activation"], folder / f"max_activation{suffix}.png", "max |hidden state|",
                        f"M-Act per layer, lr {lr:g}, seed {seed}", log=True)
    layers = {v: r["analysis"]["layers"] for v, r in runs[standard].items()}
    histograms = {v: [_head_mean(e["gate"]["histogram_per_head"]) for e in layers[v] if e["gate"]] for v in variants
                  if runs[standard][v]["analysis"]["summary"]["gate_mean"] is not None}
    edges = runs[standard][variants[0]]["analysis"]["gate_histogram_edges"]
    if histograms:
        plots.per_layer({v: [e["gate"]["mean"] if e["gate"] else 0.0 for e in layers[v]] for v in histograms},
                        folder / "gate_mean.png", "mean gate score", f"mean gate score per layer, lr {standard:g}, "
                        f"seed {seed}")
        plots.gate_histograms(histograms, edges, folder / "gate_histograms.png")
    by_pos = {v: r["tensors"]["first_token_attention_by_position"].mean(0) for v, r in runs[standard].items()}
    plots.by_position(by_pos, folder / "first_token_attention_by_position.png",
                      f"F-Attn by query position (mean over layers and heads), lr {standard:g}, seed {seed}")
    plots.overview(per_layer[standard]["first_token_attention"], per_layer[standard]["max_activation"], by_pos,
                   f"lr {standard:g}, seed {seed}", histograms, edges, losses[high],
                   f"training loss at the high learning rate, {high:g}, seed {seed}", folder / "overview.png")
    last = preset_info["num_hidden_layers"] - 1
    shown = [v for v in ("baseline", "g1-elementwise") if v in variants] or variants[:2]
    plots.attention_maps({v: {layer: runs[standard][v]["tensors"]["attention_maps"][layer]
                              for layer in sorted({0, last})} for v in shown}, folder / "attention_maps.png")
    plots.extrapolation({v: r["extrapolation"] for v, r in runs[standard].items()}, preset_info["seq_len"],
                        folder / "extrapolation.png")


def _text(preset_info: dict, variants: list[str], learning_rates: tuple[float, float], parts: dict[str, Results],
          seeds: list[int], judged: list[dict], not_run: list[str], meta: dict, folder: Path) -> str:
    """report.md: the header, the tables of each family, the directions, the plots."""
    from .reproduce import SEQUENCE_PARTS, SPIKE_WINDOW

    results, standard = parts["main"], learning_rates[0]
    seed_text = " / ".join(str(s) for s in seeds)
    table4, table2, table5 = reproduce_tables(results, variants, learning_rates, seeds)
    mact = _mact_section(parts["mact"], preset_info, seeds, folder) if parts["mact"] else []
    long = _long_context_section(parts["long"], preset_info, seeds, folder) if parts["long"] else []
    mact_lr = preset_info["mact"]["learning_rates"][0] if parts["mact"] else None
    return "\n\n".join([
        "# gated-qwen reproduce: the paper's directions in miniature",
        _header(preset_info, variants, learning_rates, parts, seeds, meta),
        f"## Sink, activations and gates (table 4), learning rate {standard:g}; each cell: seed {seed_text}",
        table4,
        "F-Attn: attention on the first token (BOS), mean over heads, layers and query positions 1..S-1; also over "
        "the queries that are not triggers (where a copying head has nothing to do) and those that are. M-Act: "
        "largest |hidden state| a layer outputs. abs SDPA out / after gate: mean |attention output| per element "
        "before the gate and as o_proj receives it. Gate scores: every score of every held-out token. +params: gate "
        f"parameters. Lowest quarter of the sink: see report.json (`sink.by_part`, {SEQUENCE_PARTS} parts).",
        f"## Stability (table 2): both learning rates; each cell: seed {seed_text}",
        table2,
        f"loss spike: the largest rise of the {SPIKE_WINDOW}-step moving average of the training loss above its "
        "lowest earlier value (nats; 0 for a curve that never goes back up).",
        *mact,
        f"## Beyond the training length ({preset_info['seq_len']} tokens), learning rate {standard:g}, seed {seeds[0]}",
        table5,
        *long,
        *_quantization_tables(results, variants, standard, parts["mact"], mact_lr, seeds),
        *directions_section(judged, not_run),
        f"## Plots (seed {seeds[0]})",
        "\n\n".join(f"![{name}]({name}.png)" for name in (
            "overview", "loss_curves", "first_token_attention", "first_token_attention_high_lr",
            "first_token_attention_by_position", "max_activation", "max_activation_high_lr",
            *(("max_activation_mact",) if mact else ()), *(("gate_mean", "gate_histograms")
                                                           if (folder / "gate_mean.png").exists() else ()),
            "attention_maps", "extrapolation", *(("recall_by_length",) if long else ()))),
        "Models: `models/<variant>-lr<learning rate>-seed<seed>/` (load with `AutoModelForCausalLM.from_pretrained`), "
        "the M-Act model's as `models/mact-<variant>-...`, the long-context model's as `models/long-<variant>-...`; "
        "held-out documents: `heldout.safetensors` and `heldout_mact.safetensors` (`input_ids`), "
        "`heldout_long_context.safetensors` (`input_ids_<length>`, one tensor per length).",
    ]) + "\n"


def _header(preset_info: dict, variants: list[str], learning_rates: tuple[float, float], parts: dict[str, Results],
            seeds: list[int], meta: dict) -> str:
    standard, high = learning_rates
    at_high = {v for v, lr, _ in parts["main"] if lr == high}
    extra = [name for name, part in (("M-Act model", "mact"), ("long-context model", "long")) if parts[part]]
    return (
        f"{len(variants)} variants at learning rate {standard:g}, {len(at_high)} of them also at {high:g}; seeds "
        f"{' / '.join(str(s) for s in seeds)} (set-up chosen on seeds "
        f"{_seed_list(preset_info.get('tuning_seeds', [])) or 'none'}); {preset_info['steps']} steps of "
        f"{preset_info['batch_size']} x {preset_info['seq_len']} tokens; {preset_info['num_hidden_layers']} layers, "
        f"hidden {preset_info['hidden_size']}, {preset_info['num_attention_heads']} query / "
        f"{preset_info['num_key_value_heads']} kv heads of {preset_info['head_dim']}, QK-norm "
        f"{'on' if preset_info['use_qk_norm'] else 'off'}, gradient clipping {preset_info['max_grad_norm'] or 'off'}"
        f"{', bf16 autocast' if preset_info['bf16'] else ''}. Built-in corpus `{preset_info.get('corpus', '')}` "
        f"({json.dumps(preset_info['language'])}); measured on held-out documents. {meta['seconds']:.0f} s on "
        f"{meta['device']}" + (f", with the {' and the '.join(extra)} (below)." if extra else "."))


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
              cell(v, high, lambda r: r["final_train_loss"]), cell(v, high, summary("first_token_attention")),
              cell(v, high, summary("max_activation")), cell(v, high, summary("gate_mean"))] for v in variants]
    table2 = markdown_table(["variant", f"PPL lr {standard:g}", f"PPL lr {high:g}", f"loss spike lr {standard:g}",
                             f"loss spike lr {high:g}", f"final training loss lr {high:g}", f"F-Attn lr {high:g}",
                             f"M-Act lr {high:g}", f"gate mean lr {high:g}"], rows2)
    first = results[(variants[0], standard, seeds[0])]["extrapolation"]
    lengths = [row["length"] for row in first]
    yarn = "ppl_yarn" in first[0]
    header = ["variant"] + [f"PPL @{n}" for n in lengths] + ([f"YaRN @{n}" for n in lengths] if yarn else [])
    rows5 = []
    for v in variants:
        table = results[(v, standard, seeds[0])]["extrapolation"]
        rows5.append([v] + [row["ppl"] for row in table] + ([row["ppl_yarn"] for row in table] if yarn else []))
    return table4, table2, markdown_table(header, rows5)


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
        f"`{info['corpus']}` ({json.dumps(info['language'])}); baseline and G1 elementwise only (set-up chosen on "
        f"seeds {_seed_list(info.get('tuning_seeds', [])) or 'none'}). In a model of one layer, M-Act is that "
        "layer's output, which only the final RMSNorm reads, so nothing fixes its scale; in LLMs the massive "
        "activation appears in an early layer at the first token and the residual stream carries it to the later "
        "layers' attention. This model has layers to carry it.",
        markdown_table(["variant", "seed", "held-out PPL", "F-Attn", "M-Act", "M-Act per layer",
                        "position of each layer's max", "gate mean"], rows),
    ]


def _long_context_section(results: Results, preset_info: dict, seeds: list[int], folder: Path) -> list[str]:
    """The long-context model's part of report.md (F-Attn, then recall and perplexity at every length, without /
    with YaRN, a row per variant and seed; YaRN's frequency bands) and its plot (first seed)."""
    from .reproduce import LONG_CONTEXT_VARIANTS

    info = preset_info["long_context"]
    lr = info["learning_rates"][0]
    first = results[(LONG_CONTEXT_VARIANTS[0], lr, seeds[0])]
    lengths = [row["length"] for row in first["extrapolation"]]
    plots.extrapolation({v: results[(v, lr, seeds[0])]["extrapolation"] for v in LONG_CONTEXT_VARIANTS},
                        info["seq_len"], folder / "recall_by_length.png", value=lambda r: r["recall"]["accuracy"],
                        yarn_value=lambda r: r["recall_yarn"]["accuracy"], ylabel="recall accuracy")

    def table(get) -> str:
        rows = [[v, seed, results[(v, lr, seed)]["analysis"]["summary"]["first_token_attention"],
                 *(f"{_fmt(get(row, ''))} / {_fmt(get(row, '_yarn'))}" for row in results[(v, lr, seed)]["extrapolation"])]
                for v in LONG_CONTEXT_VARIANTS for seed in seeds]
        return markdown_table(["variant", "seed", "F-Attn", *(f"@{n} ({n // lengths[0]}x)" for n in lengths)], rows)

    bands = first.get("yarn_bands")
    return [
        f"## Longer contexts: the long-context model, learning rate {lr:g}",
        f"{info['num_hidden_layers']} layer(s), hidden {info['hidden_size']}, {info['num_attention_heads']} query / "
        f"{info['num_key_value_heads']} kv heads of {info['head_dim']}, RoPE base {info['rope_theta']:g}, QK-norm "
        f"{'on' if info['use_qk_norm'] else 'off'}; {info['steps']} steps of {info['batch_size']} x {info['seq_len']} "
        f"tokens of the built-in corpus `{info['corpus']}` ({json.dumps(info['language'])}): each document holds "
        "facts (one token per key and value, one fact per `tokens_per_fact` tokens, so longer documents hold more) "
        "in its first half and, in its second half, each fact's key followed by its value, which only the fact tells. "
        f"Set-up chosen on seeds {_seed_list(info.get('tuning_seeds', [])) or 'none'}. Evaluated on "
        f"{first['extrapolation'][0]['sequences']} held-out documents drawn at each length, with YaRN factor "
        f"{lengths[-1] // lengths[0]} over the training length and without." + (f" {yarn_bands_text(bands)}"
                                                                                if bands else ""),
        "Recall accuracy (each cell: without / with YaRN): the share of the values after a key that the model "
        "predicts (most likely next token); F-Attn at the training length, without YaRN.",
        table(lambda row, yarn: row[f"recall{yarn}"]["accuracy"]),
        "Perplexity over every position (without / with YaRN):",
        table(lambda row, yarn: row[f"ppl{yarn}"]),
    ]


def yarn_bands_text(bands: dict) -> str:
    """`measure.yarn_bands` in words."""
    def dims(indices: list[int]) -> str:
        return _seed_list(indices) or "none"

    return (f"YaRN leaves rotary frequencies {dims(bands['unchanged'])} alone (of {len(bands['rotations'])}; "
            f"frequency i turns {bands['rotations'][0]:.1f} times in the training length for i = 0 and "
            f"{bands['rotations'][-1]:.3f} for the last), divides frequencies {dims(bands['interpolated'])} by the "
            f"factor (interpolation) and ramps between them at {dims(bands['ramp'])}; attention logits scale by "
            f"{bands['attention_factor'] ** 2:.3f}.")


def _quantization_tables(results: Results, variants: list[str], lr: float, mact_results: Results,
                         mact_lr: float | None, seeds: list[int]) -> list[str]:
    """The low-bit inference part of report.md: held-out perplexity in float and its increase under each scheme, for
    the M-Act models (if any) and the main models at learning rate `lr`, a row per variant and seed."""
    from .reproduce import MACT_VARIANTS

    chosen = ([("M-Act model", mact_results, MACT_VARIANTS, mact_lr)] if mact_results else []) + [
        ("main", results, variants, lr)]
    rows = [[family, v, seed, r["quantization"]["float"]["ppl"],
             *(_increase(r["quantization"][name]["increase"]) for name in SCHEMES)]
            for family, runs, names, at in chosen for v in names for seed in seeds
            if (r := runs.get((v, at, seed))) is not None]
    return [
        "## Low-bit inference: held-out perplexity under fake quantization",
        markdown_table(["model", "variant", "seed", "float PPL", *SCHEMES], rows),
        "Each cell: the PPL increase. " + "; ".join(f"{name}: {scheme}" for name, scheme in SCHEMES.items()) + ". "
        + QUANTIZATION_NOTE + " Standard learning rate"
        + (f" ({lr:g}; the M-Act model's {mact_lr:g})." if mact_results else f" ({lr:g})."),
    ]


# -------------------------------------------------------------------------------------------------- directions
def _seed_list(seeds: list[int]) -> str:
    """`[10, 11, 12, 15]` -> "10-12, 15"."""
    runs, text = [], []
    for seed in sorted(seeds):
        if runs and seed == runs[-1][1] + 1:
            runs[-1][1] = seed
        else:
            runs.append([seed, seed])
    for low, high in runs:
        text.append(str(low) if low == high else f"{low}-{high}")
    return ", ".join(text)


def number(value: float | None) -> str:
    """A per-seed number, median or bound as the report prints it: 3 significant digits or so."""
    if value is None:
        return "–"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    size = abs(value)
    if 0 < size < 0.001:
        return f"{value:.1e}"
    return f"{value:.0f}" if size >= 100 else f"{value:.1f}" if size >= 10 else f"{value:.2f}" if size >= 1 else (
        f"{value:.3f}")


def interval_text(interval: dict) -> str:
    if interval["low"] is None:
        return f"unbounded ({interval['n']} seeds; a 95% interval needs 6)"
    return f"[{number(interval['low'])}, {number(interval['high'])}] ({100 * interval['coverage']:.1f}%)"


def directions_table(judged: list[dict]) -> str:
    """The verdict table: one row per judged direction (docs/analysis.md quotes these rows word for word)."""
    return markdown_table(
        ["direction", "claim", "paper", "seeds", "median", "95% interval", "verdict"],
        [[f"`{d['name']}`", d["claim"], d["paper"] or "–", f"{len(d['seeds'])} ({_seed_list(d['seeds'])})",
          number(d["median"]), interval_text(d["interval"]), f"**{d['verdict']}**"] for d in judged])


def quantization_verdicts(judged: list[dict]) -> str | None:
    """Low bits with the controls in one table: per variant of the main models, its F-Attn and M-Act over the
    baseline's (medians) beside each scheme's verdict and median increase difference (percentage points)."""
    rows = {d["name"]: d for d in judged}
    table = []
    for v in directions.QUANT_VARIANTS:
        if f"quant/w4a4/{v}" not in rows:
            continue
        sink = rows.get(f"sink-removal/{v}") or rows.get(f"sink-kept/{v}")
        act = rows.get(f"m-act/{v}")
        table.append([directions.NAMES[v], number(sink and sink["median"]), number(act and act["median"]),
                      *(f"**{rows[f'quant/{s}/{v}']['verdict']}**, {number(rows[f'quant/{s}/{v}']['median'])}"
                        for s in SCHEMES)])
    return markdown_table(["variant", "F-Attn / baseline's", "M-Act / baseline's",
                           *(f"{s}: loses less? (median difference, points)" for s in SCHEMES)], table) if table else None


def directions_section(judged: list[dict], not_run: list[str]) -> list[str]:
    """The directions part of report.md: how they are judged, the verdict table, low bits with their controls and
    every per-seed number."""
    quant = quantization_verdicts(judged)
    return [
        "## The paper's directions: per-seed comparisons, 95% intervals, verdicts",
        "Each direction is a row declared in `gated_qwen/analysis/directions.py` before the runs that judge it. Per "
        "seed, a variant is compared with the baseline trained on the same seed (a difference or a ratio), or a "
        "variant's number is taken alone. The 95% interval is the exact sign test's for the median of those "
        "numbers (order statistics; its exact coverage in brackets); no interval exists below 6 seeds. Verdict: "
        "**yes** when the interval lies wholly on the paper's side of the threshold, **no** when it lies wholly on "
        "the other side, **inconclusive** otherwise; **not testable here** when a set-up direction it rests on is "
        "not yes. Seeds on which a set-up was chosen are never evidence (report.json: `meta` of each direction).",
        directions_table(judged),
        *((f"Not run here (their models were not trained): {', '.join(f'`{n}`' for n in not_run)}.",) if not_run
          else ()),
        *(("### Low bits beside the controls (main models)", quant,
           "A gate that helps quantization through the sink should help where F-Attn falls; through M-Act, where "
           "M-Act falls.") if quant else ()),
        "### Per-seed numbers",
        markdown_table(["direction", "the number per seed", "seed: number"],
                       [[f"`{d['name']}`", d["comparison"].split(";")[0],
                         ", ".join(f"{seed}: {number(e['value'])}" for seed, e in d["per_seed"].items())]
                        for d in judged]),
    ]
