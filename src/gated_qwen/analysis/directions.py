"""The paper's directions as `gated-qwen reproduce` tests them: one row of data each, declared here before the runs
that judge them (issue 30), and `evaluate`, the one function that judges every row on a run's numbers.

A row names the models it compares (`family`: the one-layer "main" models, the deeper "mact" model, the "long"
context model), a `metric` of each trained model, the `variant` measured and the variant it is paired with by seed
(`against`, or None for the variant's own number), how the pair becomes one number per seed (`comparison`:
"difference", variant - against, or "ratio", variant / against), the `threshold` that number is held against, the
side of it the paper's claim puts the number on (`paper`: "above" or "below") and the learning rate(s) of the runs
("standard", "high", or ("high", "standard"): the change from the standard rate to the high one). `requires` names
set-up rows: unless each of them is "yes", the row is "not testable here" (the mechanism it rests on is absent).

The seeds are the run's own (the preset's `seeds`) less the seeds on which the preset's set-up was chosen (its
`tuning_seeds`, listed under `meta` and never used as evidence). `stats` computes the interval and the verdict.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from . import stats
from .quantize import SCHEMES


@dataclass(frozen=True)
class Metric:
    """What a row reads from each trained model's result (a `reproduce.train_and_measure` dict)."""

    description: str
    value: Callable[[dict], float]


def _finite_or_inf(value: float) -> float:
    """A loss of a diverged run (NaN) counts as infinitely bad."""
    return math.inf if math.isnan(value) else value


def _summary(key: str) -> Callable[[dict], float]:
    return lambda run: run["analysis"]["summary"][key]


def _recall(multiple: int, yarn: bool) -> Callable[[dict], float | None]:
    """Recall accuracy at `multiple` times the training length (None where the run did not evaluate it)."""
    def value(run: dict) -> float | None:
        rows = run["extrapolation"]
        row = next((r for r in rows if r["length"] == multiple * rows[0]["length"]), None)
        return None if row is None else row["recall_yarn" if yarn else "recall"]["accuracy"]
    return value


def _increase(scheme: str) -> Callable[[dict], float]:
    return lambda run: _finite_or_inf(100 * run["quantization"][scheme]["increase"])


METRICS: dict[str, Metric] = {
    "F-Attn": Metric("attention on the first token, mean over layers, heads and query positions 1..S-1",
                     _summary("first_token_attention")),
    "M-Act": Metric("largest |hidden state| a decoder layer outputs", _summary("max_activation")),
    "gate mean": Metric("mean gate score", _summary("gate_mean")),
    "gate < 0.1": Metric("share of the gate scores below 0.1", _summary("gate_below_0.1")),
    "held-out loss": Metric("held-out loss (nats per token)", lambda run: _finite_or_inf(run["heldout_loss"])),
    "loss spike": Metric("largest rise of the smoothed training loss above its lowest earlier value (nats)",
                         lambda run: run["loss_max_rise"]),
    **{f"{scheme} increase": Metric(f"held-out perplexity increase under {scheme} ({SCHEMES[scheme]}), % of the "
                                    "float perplexity", _increase(scheme)) for scheme in SCHEMES},
    "recall at 1x": Metric("recall accuracy at the training length, without YaRN", _recall(1, yarn=False)),
    **{f"recall with YaRN at {m}x": Metric(f"recall accuracy at {m} x the training length, with YaRN",
                                           _recall(m, yarn=True)) for m in (1, 2, 4)},
    "YaRN's recall drop at 1x": Metric(
        "recall accuracy at the training length without YaRN minus with it",
        lambda run: _recall(1, yarn=False)(run) - _recall(1, yarn=True)(run)),
}


@dataclass(frozen=True)
class Direction:
    """One row: see the module docstring. `name` is unique; `claim` is what the report says is tested; `paper` the
    paper's own number(s), for the reader."""

    name: str
    claim: str
    family: str
    metric: str
    variant: str
    side: str  # "above" / "below": where the paper puts the per-seed number, against `threshold`
    threshold: float = 0.0
    against: str | None = "baseline"
    comparison: str = "difference"
    lr: str | tuple[str, str] = "standard"
    requires: tuple[str, ...] = ()
    paper: str = ""


QUANT_VARIANTS = ("g1-elementwise", "g1-headwise", "ns-sigmoid", "input-independent", "sdpa-rmsnorm")
NAMES = {"g1-elementwise": "G1 elementwise", "g1-headwise": "G1 headwise", "ns-sigmoid": "NS-sigmoid",
         "input-independent": "the input-independent gate", "sdpa-rmsnorm": "RMSNorm on the SDPA output (no gate)",
         "baseline": "the baseline"}
PAPER_QUANT = {"w4a4": "follow-up work: gated models lose less under W4A4"}

DIRECTIONS: tuple[Direction, ...] = (
    # --- the attention sink, the gate's sparsity, table 4's ordering: the one-layer Bigram-Backcopy models
    Direction("sink", "the baseline has a strong attention sink: F-Attn above 0.3", "main", "F-Attn", "baseline",
              "above", 0.3, against=None, paper="0.467"),
    Direction("sink-removal/g1-elementwise", "G1 elementwise removes the sink: its F-Attn below a third of the "
              "baseline's", "main", "F-Attn", "g1-elementwise", "below", 1 / 3, comparison="ratio",
              requires=("sink",), paper="0.048 / 0.467"),
    Direction("sink-removal/g1-headwise", "G1 headwise removes the sink: its F-Attn below a third of the baseline's",
              "main", "F-Attn", "g1-headwise", "below", 1 / 3, comparison="ratio", requires=("sink",),
              paper="0.073 / 0.467"),
    Direction("sparse-gate/mean", "G1 elementwise's gate is sparse: mean score below 0.3", "main", "gate mean",
              "g1-elementwise", "below", 0.3, against=None, paper="0.116"),
    Direction("sparse-gate/near-zero", "G1 elementwise's gate is sparse: more than half its scores below 0.1",
              "main", "gate < 0.1", "g1-elementwise", "above", 0.5, against=None, paper="histogram mode near 0"),
    Direction("sink-kept/ns-sigmoid", "NS-sigmoid (scores in [0.5, 1]) keeps the sink: its F-Attn above a third of "
              "the baseline's", "main", "F-Attn", "ns-sigmoid", "above", 1 / 3, comparison="ratio",
              requires=("sink",), paper="0.451 / 0.467"),
    Direction("sink-kept/input-independent", "the input-independent gate keeps the sink: its F-Attn above a third "
              "of the baseline's", "main", "F-Attn", "input-independent", "above", 1 / 3, comparison="ratio",
              requires=("sink",), paper="0.364 / 0.467"),
    Direction("sink-kept/sdpa-rmsnorm", "RMSNorm on the SDPA output (no gate) keeps the sink: its F-Attn above a "
              "third of the baseline's", "main", "F-Attn", "sdpa-rmsnorm", "above", 1 / 3, comparison="ratio",
              requires=("sink",), paper="not reported"),
    Direction("ordering/ns-sigmoid", "table 4's ordering: NS-sigmoid's F-Attn above G1 elementwise's", "main",
              "F-Attn", "ns-sigmoid", "above", 1.0, against="g1-elementwise", comparison="ratio",
              paper="0.451 vs 0.048"),
    Direction("ordering/input-independent", "table 4's ordering: the input-independent gate's F-Attn above G1 "
              "elementwise's", "main", "F-Attn", "input-independent", "above", 1.0, against="g1-elementwise",
              comparison="ratio", paper="0.364 vs 0.048"),
    # --- massive activations
    Direction("m-act/g1-elementwise", "G1 elementwise lowers massive activations: its M-Act below half the "
              "baseline's", "main", "M-Act", "g1-elementwise", "below", 0.5, comparison="ratio", paper="94 / 1053"),
    Direction("m-act/g1-elementwise/high-lr", "... at the high learning rate", "main", "M-Act", "g1-elementwise",
              "below", 0.5, comparison="ratio", lr="high"),
    *(Direction(f"m-act/{v}", f"{NAMES[v]}'s M-Act below the baseline's", "main", "M-Act", v, "below", 1.0,
                comparison="ratio", paper=paper) for v, paper in (
        ("g1-headwise", "98 / 1053"), ("ns-sigmoid", "892 / 1053"), ("input-independent", "471 / 1053"),
        ("sdpa-rmsnorm", "not reported"))),
    # --- stability at a high learning rate (table 2)
    Direction("stability/baseline-degrades", "the high learning rate hurts the baseline: its held-out loss higher "
              "than at the standard rate", "main", "held-out loss", "baseline", "above", 0.0, against=None,
              lr=("high", "standard"), paper="PPL 7.42 at 4e-3, 9.20 at 8e-3"),
    Direction("stability/degradation", "G1 elementwise degrades less: its held-out loss rises less from the "
              "standard to the high rate than the baseline's", "main", "held-out loss", "g1-elementwise", "below",
              lr=("high", "standard"), requires=("stability/baseline-degrades",), paper="7.29 -> 7.33 vs 7.42 -> 9.20"),
    Direction("stability/loss", "G1 elementwise's held-out loss at the high rate below the baseline's", "main",
              "held-out loss", "g1-elementwise", "below", lr="high", paper="PPL 7.33 vs 9.20"),
    Direction("stability/spikes", "smaller loss spikes at the high rate for G1 elementwise than for the baseline",
              "main", "loss spike", "g1-elementwise", "below", lr="high",
              paper="3T-token curves: baseline spikes to 10.37, gated under 2.17"),
    # --- the deeper M-Act model (4 layers, QK-norm, the `repeats` corpus)
    Direction("mact/sink", "M-Act model: the baseline has a strong attention sink: F-Attn above 0.3", "mact",
              "F-Attn", "baseline", "above", 0.3, against=None, paper="0.467"),
    Direction("mact/sink-removal", "M-Act model: G1 elementwise removes the sink: its F-Attn below a third of the "
              "baseline's", "mact", "F-Attn", "g1-elementwise", "below", 1 / 3, comparison="ratio",
              requires=("mact/sink",), paper="0.048 / 0.467"),
    Direction("mact/sparse-gate", "M-Act model: G1 elementwise's gate is sparse: mean score below 0.3", "mact",
              "gate mean", "g1-elementwise", "below", 0.3, against=None, paper="0.116"),
    Direction("mact/m-act", "M-Act model: G1 elementwise lowers massive activations: its M-Act below half the "
              "baseline's", "mact", "M-Act", "g1-elementwise", "below", 0.5, comparison="ratio", paper="94 / 1053"),
    # --- low-bit inference: every scheme, G1 and the controls, against the baseline
    *(Direction(f"mact/quant/{scheme}", f"M-Act model: under {scheme}, G1 elementwise loses less than the baseline "
                "(perplexity increase, percentage points)", "mact", f"{scheme} increase", "g1-elementwise", "below",
                paper=PAPER_QUANT.get(scheme, "")) for scheme in SCHEMES),
    *(Direction(f"quant/{scheme}/{v}", f"under {scheme}, {NAMES[v]} loses less than the baseline (perplexity "
                "increase, percentage points)", "main", f"{scheme} increase", v, "below",
                paper=PAPER_QUANT.get(scheme, "") if v.startswith("g1") else "")
      for scheme in SCHEMES for v in QUANT_VARIANTS),
    # --- longer contexts (table 5: RULER after YaRN, at 1x / 2x / 4x the training length): the long-context model
    Direction("long/sink", "long-context model: the baseline forms a sink on this corpus: F-Attn above 0.3", "long",
              "F-Attn", "baseline", "above", 0.3, against=None, paper="0.467 (table 4's corpus)"),
    *(Direction(f"long/recall/{v}", f"long-context model: {NAMES[v]} recalls at its training length: accuracy "
                "above 0.9 without YaRN", "long", "recall at 1x", v, "above", 0.9, against=None)
      for v in ("baseline", "g1-elementwise")),
    Direction("long/yarn-1x", "with YaRN, at the training length, G1 elementwise recalls better than the baseline",
              "long", "recall with YaRN at 1x", "g1-elementwise", "above",
              requires=("long/sink", "long/recall/baseline", "long/recall/g1-elementwise"),
              paper="RULER 72.88 vs 37.94 at 32k"),
    Direction("long/yarn-drop", "YaRN costs G1 elementwise less recall at the training length than the baseline",
              "long", "YaRN's recall drop at 1x", "g1-elementwise", "below",
              requires=("long/sink", "long/recall/baseline", "long/recall/g1-elementwise")),
    *(Direction(f"long/yarn-{m}x", f"with YaRN, at {m}x the training length, G1 elementwise recalls better than the "
                "baseline", "long", f"recall with YaRN at {m}x", "g1-elementwise", "above",
                requires=("long/sink", "long/recall/baseline", "long/recall/g1-elementwise"), paper=paper)
      for m, paper in ((2, "66.60 vs 37.51 at 64k"), (4, "58.82 vs 31.65 at 128k"))),
)


def _measured(row: Direction, get, variant: str, seed: int) -> float | None:
    """`row.metric` of `variant`'s run at `seed` (at a pair of rates: the first's minus the second's); None when a
    run is missing."""
    rates = row.lr if isinstance(row.lr, tuple) else (row.lr,)
    runs = [get(variant, rate, seed) for rate in rates]
    if None in runs:
        return None
    values = [METRICS[row.metric].value(run) for run in runs]
    if None in values:
        return None
    return values[0] if len(values) == 1 else values[0] - values[1]


def _ratio(a: float, b: float) -> float:
    if b == 0:
        return math.nan if a == 0 else math.copysign(math.inf, a)
    return a / b


def seed_value(row: Direction, get, seed: int) -> tuple[float | None, dict]:
    """The row's number for one seed and the measurements it comes from (`{variant: value, against: value}`)."""
    mine = _measured(row, get, row.variant, seed)
    theirs = None if row.against is None else _measured(row, get, row.against, seed)
    if mine is None or (row.against is not None and theirs is None):
        return None, {}
    if row.against is None:
        return mine, {row.variant: mine}
    value = mine - theirs if row.comparison == "difference" else _ratio(mine, theirs)
    return value, {row.variant: mine, row.against: theirs}


def evaluate(row: Direction, get: Callable[[str, str, int], dict | None], seeds: list[int],
             tuning_seeds: list[int], verdicts: dict[str, str]) -> dict:
    """Judges `row` on the runs `get(variant, "standard" | "high", seed)` returns (None: not trained): its number on
    each of `seeds` that is not a tuning seed, the sign test's 95% interval of their median and the verdict;
    "not testable here" when a row it `requires` (in `verdicts`, judged before) is not "yes"."""
    evidence = [seed for seed in seeds if seed not in tuning_seeds]
    per_seed = {seed: dict(zip(("value", "measured"), seed_value(row, get, seed))) for seed in evidence}
    values = [entry["value"] for entry in per_seed.values() if entry["value"] is not None
              and not math.isnan(entry["value"])]
    interval = stats.median_interval(values)
    blocked = [name for name in row.requires if verdicts.get(name) != "yes"]
    return {
        "name": row.name, "claim": row.claim, "family": row.family, "metric": METRICS[row.metric].description,
        "comparison": _comparison(row), "threshold": row.threshold, "side": row.side, "paper": row.paper,
        "seeds": evidence, "per_seed": per_seed, "median": stats.median(values),
        "interval": {**interval, "method": "exact sign test (distribution-free interval for the median)"},
        "sign_test": stats.sign_test(values, row.threshold),
        "verdict": "not testable here" if blocked else stats.verdict(interval, row.threshold, row.side),
        **({"not_testable_because": blocked} if blocked else {}),
        "meta": {"tuning_seeds": list(tuning_seeds), "tuning_seeds_in_this_run": [s for s in seeds if s in tuning_seeds]},
    }


def _comparison(row: Direction) -> str:
    """The per-seed number in words, e.g. "g1-elementwise / baseline of F-Attn at the standard rate, below 0.3333"."""
    number = row.variant if row.against is None else (
        f"{row.variant} - {row.against}" if row.comparison == "difference" else f"{row.variant} / {row.against}")
    rate = ("the change from the standard to the high rate" if isinstance(row.lr, tuple) else f"the {row.lr} rate")
    return f"{number} of {row.metric} at {rate}; the paper's side: {row.side} {row.threshold:.4g}"


def _trained(row: Direction, family: dict) -> bool:
    """Whether the run trained every model the row reads (at some seed)."""
    rates = row.lr if isinstance(row.lr, tuple) else (row.lr,)
    trained = {(variant, lr) for variant, lr, _ in family["runs"]}
    wanted = [row.variant] + ([row.against] if row.against else [])
    return all((v, family["learning_rates"][rate]) in trained for v in wanted for rate in rates)


def judge(families: dict[str, dict]) -> tuple[list[dict], list[str]]:
    """Every row of `DIRECTIONS` whose models were trained, judged in order by `evaluate` (set-up rows first, so the
    rows that require them see their verdicts), and the names of the rows whose models were not (or whose metric the
    run did not measure, e.g. a length it did not evaluate). `families[name]`:
    `{"runs": {(variant, learning rate, seed): result}, "learning_rates": {"standard": lr, "high": lr}, "seeds",
    "tuning_seeds"}` for "main", "mact" and "long" (those trained)."""
    verdicts, judged, not_run = {}, [], []
    for row in DIRECTIONS:
        family = families.get(row.family)
        if family is None or not _trained(row, family):
            not_run.append(row.name)
            continue
        def get(variant, rate, seed, family=family):
            return family["runs"].get((variant, family["learning_rates"][rate], seed))
        result = evaluate(row, get, family["seeds"], family["tuning_seeds"], verdicts)
        if result["per_seed"] and all(entry["value"] is None for entry in result["per_seed"].values()):
            not_run.append(row.name)
            continue
        judged.append(result)
        verdicts[row.name] = result["verdict"]
    return judged, not_run
