"""What `gated-qwen reproduce` writes: `report.md`, `report.json`, `directions.json` (the judged directions alone,
small enough to commit) and PNG plots, into a folder (the command's staging folder from `gated_qwen.files`).

A table per model family comes first (each number's median and range over the family's seeds), then the
long-context model's recall and low bits; then every direction of `directions.DIRECTIONS` whose models were trained,
with its per-seed numbers, test, verdict and corrected verdicts (`judge`, `verdicts`); then the main models' plots."""

from __future__ import annotations

import json
from pathlib import Path

from ...files import write_json
from .. import plots
from ..quantize import SCHEMES
from ..report import QUANTIZATION_NOTE, _fmt, _head_mean, _increase, markdown_table
from .directions import METRICS
from .judge import judge
from .presets import Plan, plan_dict
from .runs import SEQUENCE_PARTS, SPIKE_WINDOW, run_name
from .verdicts import directions_section, number, seed_list

Results = dict[tuple[str, float, int], dict]  # (variant, learning rate, seed) -> train_and_measure's result


def _summary(key: str):
    return lambda run: run["analysis"]["summary"].get(key)


COLUMNS = {  # report.md's family tables: header -> the number of one run (None: not measured)
    "held-out PPL": lambda run: run["heldout_ppl"],
    "loss above the floor": METRICS["loss above the floor"].value,
    "F-Attn": _summary("first_token_attention"),
    "F-Attn, largest head": METRICS["largest head's F-Attn"].value,
    "F-Attn, non-trigger queries": lambda run: run["sink"].get("other"),
    "F-Attn, trigger queries": lambda run: run["sink"].get("trigger"),
    "M-Act": _summary("max_activation"),
    "first-token M-Act, non-final layers": _summary("first_token_max_activation_nonfinal"),
    "largest elsewhere, non-final layers": _summary("other_max_activation_nonfinal"),
    "abs SDPA out": _summary("sdpa_output_mean_abs"),
    "after gate": _summary("gated_output_mean_abs"),
    "gate mean": _summary("gate_mean"),
    "gate < 0.1": _summary("gate_below_0.1"),
    "loss spike": lambda run: run["loss_max_rise"],
    "recall at 1x": METRICS["recall at 1x"].value,
}
COLUMN_NOTE = (
    "Each cell: the median over the family's seeds and, in brackets, the smallest and largest. F-Attn: attention on "
    "the first token (BOS), mean over heads, layers and query positions 1..S-1; its largest head: the head (of any "
    "layer) with the most; also over the queries that are not triggers (where a copying head has nothing to do) and "
    "those that are. M-Act: largest |hidden state| a layer outputs; at the first token in the non-final layers (the "
    "residual stream later layers read) and the largest at any other position there. loss above the floor: held-out "
    "loss minus the corpus's exact entropy. abs SDPA out / after gate: mean |attention output| per element before "
    "the gate and as o_proj receives it. Gate scores: every score of every held-out token. loss spike: the largest "
    f"rise of the {SPIKE_WINDOW}-step moving average of the training loss above its lowest earlier value (nats). "
    f"F-Attn by quarter of the query positions: report.json (`sink.by_part`, {SEQUENCE_PARTS} parts).")


def judged_families(plan: Plan, runs: dict[str, Results]) -> dict[str, dict]:
    """What `judge` reads for each family: its runs, learning rates (standard, high), seeds and tuning seeds."""
    return {f.name: {"runs": runs[f.name], "learning_rates": dict(zip(("standard", "high"), f.preset.learning_rates)),
                     "seeds": list(f.preset.seeds), "tuning_seeds": list(f.preset.tuning_seeds)}
            for f in plan.families if runs.get(f.name)}


def write_reproduce(folder: Path, plan: Plan, runs: dict[str, Results], meta: dict) -> str:
    """Writes report.md, report.json, directions.json and the plots of a `reproduce` run into `folder` (plots of the
    main models' first seed); `runs[family]`: `{(variant, learning rate, seed): result}`; returns the markdown."""
    judged, not_run = judge(judged_families(plan, runs), dict(plan.untestable))
    _plots(folder, plan, runs["main"])
    text = _text(plan, runs, judged, not_run, meta, folder)
    (folder / "report.md").write_text(text)
    summary = {"meta": meta, "plan": plan_dict(plan), "directions": judged, "not_run": not_run}
    write_json(folder / "directions.json", summary)
    write_json(folder / "report.json", {**summary, "runs": {
        family: {run_name(*name): {k: v for k, v in r.items() if k != "tensors"} for name, r in results.items()}
        for family, results in runs.items()}})
    return text


def _plots(folder: Path, plan: Plan, results: Results) -> None:
    """The main models' plots at their first seed: loss curves, F-Attn and M-Act per layer at each rate, gate
    scores, F-Attn by position, an overview, attention maps and perplexity by length."""
    family = plan.families[0]
    seed, variants, rates = family.preset.seeds[0], family.variants, family.preset.learning_rates
    runs = {lr: {v: results[(v, lr, seed)] for v in variants if (v, lr, seed) in results} for lr in rates}
    runs = {lr: chosen for lr, chosen in runs.items() if chosen}
    standard, last_rate = rates[0], list(runs)[-1]
    losses = {lr: {v: r["train_loss"] for v, r in chosen.items()} for lr, chosen in runs.items()}
    plots.loss_curves({f"learning rate {lr:g}": losses[lr] for lr in runs}, folder / "loss_curves.png")
    per_layer = {lr: {key: {v: [e[key] for e in r["analysis"]["layers"]] for v, r in chosen.items()}
                      for key in ("first_token_attention", "max_activation")} for lr, chosen in runs.items()}
    for lr in runs:
        suffix = "" if lr == standard else "_high_lr"
        plots.per_layer(per_layer[lr]["first_token_attention"], folder / f"first_token_attention{suffix}.png",
                        "attention on token 0", f"F-Attn per layer, lr {lr:g}, seed {seed}")
        plots.per_layer(per_layer[lr]["max_activation"], folder / f"max_activation{suffix}.png", "max |hidden state|",
                        f"M-Act per layer, lr {lr:g}, seed {seed}", log=True)
    layers = {v: r["analysis"]["layers"] for v, r in runs[standard].items()}
    histograms = {v: [_head_mean(e["gate"]["histogram_per_head"]) for e in layers[v] if e["gate"]] for v in layers
                  if runs[standard][v]["analysis"]["summary"]["gate_mean"] is not None}
    edges = next(iter(runs[standard].values()))["analysis"]["gate_histogram_edges"]
    if histograms:
        plots.per_layer({v: [e["gate"]["mean"] if e["gate"] else 0.0 for e in layers[v]] for v in histograms},
                        folder / "gate_mean.png", "mean gate score", f"mean gate score per layer, lr {standard:g}, "
                        f"seed {seed}")
        plots.gate_histograms(histograms, edges, folder / "gate_histograms.png")
    by_pos = {v: r["tensors"]["first_token_attention_by_position"].mean(0) for v, r in runs[standard].items()}
    plots.by_position(by_pos, folder / "first_token_attention_by_position.png",
                      f"F-Attn by query position (mean over layers and heads), lr {standard:g}, seed {seed}")
    plots.overview(per_layer[standard]["first_token_attention"], per_layer[standard]["max_activation"], by_pos,
                   f"lr {standard:g}, seed {seed}", histograms, edges, losses[last_rate],
                   f"training loss at learning rate {last_rate:g}, seed {seed}", folder / "overview.png")
    last = family.preset.num_hidden_layers - 1
    shown = [v for v in ("baseline", "g1-elementwise") if v in runs[standard]] or list(runs[standard])[:2]
    plots.attention_maps({v: {layer: runs[standard][v]["tensors"]["attention_maps"][layer]
                              for layer in sorted({0, last})} for v in shown}, folder / "attention_maps.png")
    plots.extrapolation({v: r["extrapolation"] for v, r in runs[standard].items()}, family.preset.seq_len,
                        folder / "extrapolation.png")


def _spread(values: list) -> str:
    """`median (min–max)` of the numbers that were measured."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return "–"
    middle = values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    return _fmt(middle) if len(values) == 1 else f"{_fmt(middle)} ({_fmt(values[0])}–{_fmt(values[-1])})"


def family_table(results: Results) -> str:
    """A row per variant and learning rate; a column for each of `COLUMNS` that any run measured."""
    keys = list(dict.fromkeys((v, lr) for v, lr, _ in results))
    cells = {(v, lr): {name: [get(r) for (rv, rlr, _), r in results.items() if (rv, rlr) == (v, lr)]
                       for name, get in COLUMNS.items()} for v, lr in keys}
    shown = [name for name in COLUMNS if any(v is not None for row in cells.values() for v in row[name])]
    return markdown_table(["variant", "lr", "seeds", "+params", *shown],
                          [[v, f"{lr:g}", len(cells[(v, lr)]["held-out PPL"]),
                            next(r["gate_parameters"] for (rv, _, _), r in results.items() if rv == v),
                            *(_spread(cells[(v, lr)][name]) for name in shown)] for v, lr in keys])


def family_header(name: str, info: dict) -> str:
    """One family's model, training and corpus in a sentence."""
    stages = "".join(f"{steps} steps at {length} tokens, then " for length, steps in info["short_stages"])
    return (f"{info['num_hidden_layers']} layer(s), hidden {info['hidden_size']}, {info['num_attention_heads']} query "
            f"/ {info['num_key_value_heads']} kv heads of {info['head_dim']}, QK-norm "
            f"{'on' if info['use_qk_norm'] else 'off'}, gradient clipping {info['max_grad_norm'] or 'off'}"
            f"{', bf16 autocast' if info['bf16'] else ''}; {stages}{info['steps']} steps of {info['batch_size']} x "
            f"{info['seq_len']} tokens of the built-in corpus `{info['corpus']}` ({json.dumps(info['language'])}); "
            f"learning rates {' and '.join(f'{lr:g}' for lr in info['learning_rates'])}; seeds "
            f"{seed_list(info['seeds'])} (set-up chosen on seeds {seed_list(info['tuning_seeds']) or 'none'}).")


def _text(plan: Plan, runs: dict[str, Results], judged: list[dict], not_run: list[str], meta: dict,
          folder: Path) -> str:
    """report.md: the header, a table per family, the long-context model, low bits, the directions, the plots."""
    info = plan_dict(plan)["families"]
    sections = []
    for family in plan.families:
        sections += [f"## Family `{family.name}`", family_header(family.name, info[family.name]),
                     family_table(runs[family.name])]
    if runs.get("long"):
        sections += _long_context_section(runs["long"], info["long"], folder)
    main = plan.families[0]
    first = runs["main"][(main.variants[0], main.preset.learning_rates[0], main.preset.seeds[0])]["extrapolation"]
    plotted = ["overview", "loss_curves", "first_token_attention", "first_token_attention_by_position",
               "max_activation", "gate_mean", "gate_histograms", "attention_maps", "extrapolation",
               "first_token_attention_high_lr", "max_activation_high_lr", "recall_by_length"]
    return "\n\n".join([
        "# gated-qwen reproduce: the paper's directions in miniature",
        f"Families {', '.join(f'`{f.name}`' for f in plan.families)}; {meta['seconds']:.0f} s on {meta['device']}. "
        f"Rows as of commit {meta.get('directions_commit') or 'unknown'} (`directions.py`"
        f"{'' if meta.get('directions_file_clean') else ', changed since'}; working tree "
        f"{'clean' if meta.get('tree_clean') else 'not clean'}).",
        *sections, COLUMN_NOTE,
        f"## Beyond the training length ({main.preset.seq_len} tokens), main models, seed {main.preset.seeds[0]}",
        _extrapolation_table(runs["main"], main, first),
        *_quantization_tables(plan, runs),
        *directions_section(judged, not_run),
        f"## Plots (main models, seed {main.preset.seeds[0]})",
        "\n\n".join(f"![{name}]({name}.png)" for name in plotted if (folder / f"{name}.png").exists()),
        "Models: `models/<variant>-lr<learning rate>-seed<seed>/` for the main models (load with "
        "`AutoModelForCausalLM.from_pretrained`), `models/<family>-<variant>-...` for another family's; held-out "
        "documents: `heldout.safetensors` (`input_ids`) and `heldout_<family>.safetensors` (`input_ids`, or "
        "`input_ids_<length>`, one tensor per length, for a recall corpus).",
    ]) + "\n"


def _extrapolation_table(results: Results, family, first: list[dict]) -> str:
    lengths = [row["length"] for row in first]
    yarn = "ppl_yarn" in first[0]
    standard, seed = family.preset.learning_rates[0], family.preset.seeds[0]
    rows = [[v] + [row["ppl"] for row in table] + ([row["ppl_yarn"] for row in table] if yarn else [])
            for v in family.variants if (table := results.get((v, standard, seed), {}).get("extrapolation"))]
    return markdown_table(["variant"] + [f"PPL @{n}" for n in lengths] + ([f"YaRN @{n}" for n in lengths] if yarn
                                                                            else []), rows)


def _long_context_section(results: Results, info: dict, folder: Path) -> list[str]:
    """The long-context model's recall and perplexity at every length, without / with YaRN (a row per variant and
    seed), YaRN's frequency bands, and its plot (first seed)."""
    lr, seeds = info["learning_rates"][0], info["seeds"]
    variants = info["variants"]
    first = results[(variants[0], lr, seeds[0])]
    lengths = [row["length"] for row in first["extrapolation"]]
    plots.extrapolation({v: results[(v, lr, seeds[0])]["extrapolation"] for v in variants},
                        info["seq_len"], folder / "recall_by_length.png", value=lambda r: r["recall"]["accuracy"],
                        yarn_value=lambda r: r["recall_yarn"]["accuracy"], ylabel="recall accuracy")

    def table(get) -> str:
        rows = [[v, seed, *(f"{_fmt(get(row, ''))} / {_fmt(get(row, '_yarn'))}"
                            for row in results[(v, lr, seed)]["extrapolation"])] for v in variants for seed in seeds]
        return markdown_table(["variant", "seed", *(f"@{n} ({n // lengths[0]}x)" for n in lengths)], rows)

    bands = first.get("yarn_bands")
    return [
        f"## Longer contexts: the long-context model, learning rate {lr:g}",
        "Each document holds facts (one token per key and value, one fact per `tokens_per_fact` tokens) and, after "
        "them, each fact's key followed by its value, which only the fact tells. Evaluated on "
        f"{first['extrapolation'][0]['sequences']} held-out documents drawn at each length, with YaRN factor "
        f"{lengths[-1] // lengths[0]} over the training length and without." + (f" {yarn_bands_text(bands)}"
                                                                                if bands else ""),
        "Recall accuracy (each cell: without / with YaRN): the share of the values after a key that the model "
        "predicts (most likely next token).",
        table(lambda row, yarn: row[f"recall{yarn}"]["accuracy"]),
        "Perplexity over every position (without / with YaRN):",
        table(lambda row, yarn: row[f"ppl{yarn}"]),
    ]


def yarn_bands_text(bands: dict) -> str:
    """`perplexity.yarn_bands` in words."""
    def dims(indices: list[int]) -> str:
        return seed_list(indices) or "none"

    return (f"YaRN leaves rotary frequencies {dims(bands['unchanged'])} alone (of {len(bands['rotations'])}; "
            f"frequency i turns {bands['rotations'][0]:.1f} times in the training length for i = 0 and "
            f"{bands['rotations'][-1]:.3f} for the last), divides frequencies {dims(bands['interpolated'])} by the "
            f"factor (interpolation) and ramps between them at {dims(bands['ramp'])}; attention logits scale by "
            f"{bands['attention_factor'] ** 2:.3f}.")


def _quantization_tables(plan: Plan, runs: dict[str, Results]) -> list[str]:
    """The low-bit part of report.md: held-out perplexity in float and its increase under each scheme, for the main
    models and the M-Act model (if trained) at their standard rate, a row per variant and seed."""
    chosen = [f for f in plan.families if f.name in ("main", "mact") and runs.get(f.name)]
    rows = [[f.name, v, seed, r["quantization"]["float"]["ppl"],
             *(_increase(r["quantization"][name]["increase"]) for name in SCHEMES)]
            for f in chosen for v in f.variants for seed in f.preset.seeds
            if (r := runs[f.name].get((v, f.preset.learning_rates[0], seed))) is not None]
    return [
        "## Low-bit inference: held-out perplexity under fake quantization",
        markdown_table(["family", "variant", "seed", "float PPL", *SCHEMES], rows),
        "Each cell: the PPL increase. " + "; ".join(f"{name}: {scheme}" for name, scheme in SCHEMES.items()) + ". "
        + QUANTIZATION_NOTE + " Standard learning rate.",
    ]


__all__ = ["write_reproduce", "family_table", "number"]
