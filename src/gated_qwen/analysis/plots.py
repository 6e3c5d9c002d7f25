"""PNG plots of the analysis (matplotlib, Agg backend: no display needed).

Every function takes plain numbers (lists, dicts, tensors from `measure.analyze`) and a path, and writes one PNG.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

LINE_STYLES = ("-", "--", "-.", (0, (1, 1)), (0, (5, 1)))


def _pyplot():
    try:
        import matplotlib
    except ImportError as error:  # matplotlib comes with the `analysis` extra
        raise ModuleNotFoundError("plots need matplotlib, which is not installed: pip install 'gated-qwen[analysis]'.",
                                  name="matplotlib") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)


def attention_maps(maps: dict[str, dict[int, torch.Tensor]], path: Path, max_heads: int = 4) -> None:
    """`maps`: `{model name: {layer: [Hq, n, n]}}` -> one row per (model, layer), one column per head (at most
    `max_heads`); brighter = more attention, query rows down, keys across (key 0, the first token, on the left)."""
    plt = _pyplot()
    rows = [(name, layer, m) for name, by_layer in maps.items() for layer, m in by_layer.items()]
    heads = min(max_heads, max(m.shape[0] for _, _, m in rows))
    fig, axes = plt.subplots(len(rows), heads, figsize=(1.9 * heads + 0.6, 1.9 * len(rows)), squeeze=False)
    for r, (name, layer, m) in enumerate(rows):
        for h in range(heads):
            ax = axes[r][h]
            ax.set_xticks([])
            ax.set_yticks([])
            if h < m.shape[0]:
                ax.imshow(m[h].numpy() ** 0.5, cmap="viridis", vmin=0, vmax=1)  # sqrt: small weights stay visible
                ax.set_title(f"L{layer} H{h} F={m[h, 1:, 0].mean():.2f}", fontsize=8)
        axes[r][0].set_ylabel(name, fontsize=8)
    _save(fig, path)


def _bars(ax, series: dict[str, list[float]], ylabel: str, title: str, log: bool = False) -> None:
    names = list(series)
    layers = max(len(v) for v in series.values())
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = series[name]
        ax.bar([x + (i - (len(names) - 1) / 2) * width for x in range(len(values))], values, width, label=name)
    ax.set_xticks(range(layers))
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    if len(names) > 1:
        ax.legend(fontsize=7)


def per_layer(series: dict[str, list[float]], path: Path, ylabel: str, title: str, log: bool = False) -> None:
    """Grouped bars: `series` `{name: one value per layer}`."""
    plt = _pyplot()
    layers = max(len(v) for v in series.values())
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * layers + 2), 3.2))
    _bars(ax, series, ylabel, title, log)
    _save(fig, path)


def _histograms(ax, layers: list[list[float]], edges: list[float], title: str) -> None:
    centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    for layer, counts in enumerate(layers):
        ax.plot(centers, counts, marker=".", label=f"L{layer}")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("gate score")
    ax.set_xlim(0, 1)


def gate_histograms(histograms: dict[str, list[list[float]]], edges: list[float], path: Path) -> None:
    """`histograms`: `{name: one histogram per gated layer (shares of scores per bin over `edges`)}` -> one panel
    per name, one line per layer."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(histograms), figsize=(3.2 * len(histograms), 2.8), squeeze=False)
    for ax, (name, layers) in zip(axes[0], histograms.items()):
        _histograms(ax, layers, edges, name)
    axes[0][0].set_ylabel("share of scores")
    axes[0][-1].legend(fontsize=7)
    _save(fig, path)


def _positions(ax, lines: dict[str, torch.Tensor], title: str) -> None:
    for i, (label, row) in enumerate(lines.items()):
        positions = torch.arange(1, len(row))
        step = max(1, len(positions) // 2000)  # a long input: plot every step-th position
        ax.plot(positions[::step], row[1::step], label=label, linewidth=1.6 if i == 0 else 1,
                linestyle=LINE_STYLES[i % len(LINE_STYLES)])  # lines that coincide stay visible
    ax.plot(positions[::step], 1.0 / (positions[::step] + 1), "k:", label="uniform 1/(i+1)", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("query position")
    ax.set_ylabel("attention on token 0")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)


def by_position(lines: dict[str, torch.Tensor], path: Path, title: str = "") -> None:
    """`lines`: `{label: [S] tensor}`, the first-token attention of each query position -> one line per label, log x
    axis, with the uniform-attention level 1/(i+1) for reference."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    _positions(ax, lines, title)
    _save(fig, path)


def _losses(ax, runs: dict[str, list[float]], title: str, smooth: int) -> None:
    for i, (name, losses) in enumerate(runs.items()):
        ax.plot(range(1, len(losses) + 1), losses, color=f"C{i}", alpha=0.2, linewidth=0.6)
        ax.plot(range(1, len(losses) + 1), moving_average(losses, smooth), color=f"C{i}", label=name, linewidth=1.2)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    finite = [x for losses in runs.values() for x in losses if math.isfinite(x)]
    if finite:
        ax.set_ylim(min(finite) - 0.05, min(finite) + 2.0)  # the first steps' loss would squash everything else
    ax.legend(fontsize=7)


def loss_curves(curves: dict[str, dict[str, list[float]]], path: Path, smooth: int = 10) -> None:
    """`curves`: `{panel title: {name: training loss per step}}` -> one panel per title; curves are moving
    averages over `smooth` steps, the raw losses faint behind them."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(5.0 * len(curves), 3.4), squeeze=False)
    for ax, (title, runs) in zip(axes[0], curves.items()):
        _losses(ax, runs, title, smooth)
    _save(fig, path)


def overview(first_token: dict[str, list[float]], max_act: dict[str, list[float]], by_pos: dict[str, torch.Tensor],
             title: str, histograms: dict[str, list[list[float]]], edges: list[float], losses: dict[str, list[float]],
             losses_title: str, path: Path, smooth: int = 10) -> None:
    """The reproduce run on one page. Top: F-Attn and M-Act per layer (`{variant: per layer}`), the gate
    histograms of (at most two) gated variants (mean over heads, one line per layer). Bottom: F-Attn by query
    position (`{variant: [S]}`) and training losses (`{variant: per step}`)."""
    plt = _pyplot()
    shown = list(histograms)[:2]
    fig = plt.figure(figsize=(16, 6.6))
    grid = fig.add_gridspec(2, 4)
    _bars(fig.add_subplot(grid[0, 0]), first_token, "attention on token 0", f"F-Attn per layer, {title}")
    _bars(fig.add_subplot(grid[0, 1]), max_act, "max |hidden state|", f"M-Act per layer, {title}", log=True)
    for i, name in enumerate(shown):
        ax = fig.add_subplot(grid[0, 2 + i])
        _histograms(ax, histograms[name], edges, f"gate scores, {name}, {title}")
        ax.legend(fontsize=7)
    _positions(fig.add_subplot(grid[1, :2]), by_pos, f"F-Attn by query position, {title}")
    _losses(fig.add_subplot(grid[1, 2:]), losses, losses_title, smooth)
    _save(fig, path)


def extrapolation(rows: dict[str, list[dict]], train_length: int, path: Path, value=lambda r: r["ppl"],
                  yarn_value=lambda r: r["ppl_yarn"], ylabel: str = "perplexity") -> None:
    """`rows`: `{name: perplexity_by_length rows}` -> `value` (default perplexity) against context length, solid
    without YaRN, dashed with it (`yarn_value`, where the rows have YaRN); the training length marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for i, (name, table) in enumerate(rows.items()):
        lengths = [r["length"] for r in table]
        ax.plot(lengths, [value(r) for r in table], f"C{i}-", marker=".", label=name)
        if "ppl_yarn" in table[0]:
            ax.plot(lengths, [yarn_value(r) for r in table], f"C{i}--", marker=".")
    ax.axvline(train_length, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (dashed: with YaRN)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    _save(fig, path)


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
