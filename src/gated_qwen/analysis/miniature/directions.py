"""The paper's directions as `gated-qwen reproduce` tests them: one row of data each, declared here, in a commit of
their own, before the runs that judge them. `judge` judges them; this module only says what is
claimed, so that the commit that last changed it (a report's `meta["directions_commit"]`) dates the claims.

A row names the models it compares (`family`, a family of the run's preset: `presets.FAMILIES`), a `metric` of each
trained model, the `variant` measured and the variant it is paired with by seed (`against`, or None for the
variant's own number), how the pair becomes one number per seed (`comparison`: "difference", variant - against, or
"ratio", variant / against), the `threshold` that number is held against, the side of it the paper's claim puts the
number on (`side`: "above" or "below") and the learning rate(s) of the runs ("standard", "high", or ("high",
"standard"): the change from the standard rate to the high one). `requires` names set-up rows: unless each of them
is "yes", the row is "not testable here" (the mechanism it rests on is absent). A row that claims the paper's
opposite, a finding of an earlier run stated before the fresh seeds that judge it, says so (`opposite`): its `side`
is its claim's.

`test` says how the per-seed numbers are judged: "sign" (the exact sign test's interval for their median, against
`threshold`) or "mcnemar" (a failure rate: each run fails when its number is above `threshold`, and the variant's
failures and the against-variant's, paired by seed, go to the exact McNemar test; `side` "below": the variant fails
less often).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..quantize import SCHEMES


@dataclass(frozen=True)
class Metric:
    """What a row reads from each trained model's result (a `runs.train_and_measure` dict)."""

    description: str
    value: Callable[[dict], float | None]


def _finite_or_inf(value: float) -> float:
    """A loss of a diverged run (NaN) counts as infinitely bad."""
    return math.inf if math.isnan(value) else value


def _summary(key: str) -> Callable[[dict], float | None]:
    return lambda run: run["analysis"]["summary"].get(key)


def _recall(multiple: int, yarn: bool) -> Callable[[dict], float | None]:
    """Recall accuracy at `multiple` times the training length (None where the run did not evaluate it)."""
    def value(run: dict) -> float | None:
        rows = run["extrapolation"]
        row = next((r for r in rows if r["length"] == multiple * rows[0]["length"]), None)
        found = None if row is None else row.get("recall_yarn" if yarn else "recall")
        return None if found is None else found["accuracy"]
    return value


def _extrapolated_loss(multiple: int) -> Callable[[dict], float | None]:
    """Held-out loss at `multiple` times the training length (None where the run did not evaluate it)."""
    def value(run: dict) -> float | None:
        rows = run["extrapolation"]
        row = next((r for r in rows if r["length"] == multiple * rows[0]["length"]), None)
        return None if row is None or "nll" not in row else _finite_or_inf(row["nll"])
    return value


def _increase(scheme: str) -> Callable[[dict], float]:
    return lambda run: _finite_or_inf(100 * run["quantization"][scheme]["increase"])


def _largest_head(run: dict) -> float:
    """The largest per-head F-Attn over every layer and head: a sink held by one head is not averaged away."""
    return max(max(layer["first_token_attention_per_head"]) for layer in run["analysis"]["layers"])


def _first_token_share(run: dict) -> float | None:
    summary = run["analysis"]["summary"]
    first, other = summary.get("first_token_max_activation_nonfinal"), summary.get("other_max_activation_nonfinal")
    return None if first is None or not other else first / other


def _above_floor(run: dict) -> float | None:
    floor = run.get("entropy_floor")
    return None if floor is None else _finite_or_inf(run["heldout_loss"]) - floor


METRICS: dict[str, Metric] = {
    "F-Attn": Metric("attention on the first token, mean over layers, heads and query positions 1..S-1",
                     _summary("first_token_attention")),
    "largest head's F-Attn": Metric("attention on the first token, mean over query positions 1..S-1, of the head "
                                    "(of any layer) that puts the most there", _largest_head),
    "M-Act": Metric("largest |hidden state| a decoder layer outputs", _summary("max_activation")),
    "first-token M-Act": Metric("largest |hidden state| at the first token that a non-final decoder layer outputs "
                                "(the residual stream later layers read)",
                                _summary("first_token_max_activation_nonfinal")),
    "first-token M-Act over the rest": Metric(
        "the first token's largest |hidden state| in the non-final layers over the largest at any other position",
        _first_token_share),
    "gate mean": Metric("mean gate score", _summary("gate_mean")),
    "gate < 0.1": Metric("share of the gate scores below 0.1", _summary("gate_below_0.1")),
    "held-out loss": Metric("held-out loss (nats per token)", lambda run: _finite_or_inf(run["heldout_loss"])),
    "loss above the floor": Metric("held-out loss above the corpus's exact entropy (nats per token)", _above_floor),
    **{f"held-out loss at {m}x": Metric(f"held-out loss (nats per token) at {m} x the training length, without YaRN",
                                        _extrapolated_loss(m)) for m in (2, 4, 8)},
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
    test: str = "sign"  # "sign" or "mcnemar"
    opposite: bool = False  # the claim is the paper's opposite (`side` is the claim's side)


QUANT_VARIANTS = ("g1-elementwise", "g1-headwise", "ns-sigmoid", "input-independent", "sdpa-rmsnorm")
NAMES = {"g1-elementwise": "G1 elementwise", "g1-headwise": "G1 headwise", "ns-sigmoid": "NS-sigmoid",
         "input-independent": "the input-independent gate", "sdpa-rmsnorm": "RMSNorm on the SDPA output (no gate)",
         "baseline": "the baseline", "g2-value": "G2 (values)", "g5-dense": "G5 (after o_proj)"}
PAPER_QUANT = {"w4a4": "follow-up work: gated models lose less under W4A4"}
TABLE1_PAIRS = (("g1-elementwise", "baseline", "5.761 vs 6.026"), ("g1-elementwise", "g1-headwise", "5.761 vs 5.792"),
                ("g1-headwise", "g2-value", "5.792 vs 5.820"), ("g2-value", "baseline", "5.820 vs 6.026"),
                ("g1-elementwise", "g5-dense", "5.761 vs 6.017"))
FAILURE_MARGIN = 0.1  # nats: a run at a higher rate fails when its held-out loss exceeds its standard-rate one by more


def _sink_rows(family: str, label: str, metric: str, setup: float) -> tuple[Direction, Direction]:
    """A family's sink (set-up row: the baseline's `metric` above `setup`) and G1 elementwise's removal of it."""
    return (Direction(f"{family}/sink", f"{label}: the baseline has a strong attention sink: {metric} above "
                      f"{setup:g}", family, metric, "baseline", "above", setup, against=None, paper="0.467"),
            Direction(f"{family}/sink-removal", f"{label}: G1 elementwise removes the sink: its {metric} below a "
                      "third of the baseline's", family, metric, "g1-elementwise", "below", 1 / 3, comparison="ratio",
                      requires=(f"{family}/sink",), paper="0.048 / 0.467"))


def _failure_row(family: str, setting: str) -> Direction:
    return Direction(f"{family}/failures", f"{setting}, G1 elementwise fails less often than the baseline (a failure: "
                     f"held-out loss more than {FAILURE_MARGIN:g} nats above the same model's at the standard rate)",
                     family, "held-out loss", "g1-elementwise", "below", FAILURE_MARGIN, lr=("high", "standard"),
                     test="mcnemar", paper="PPL 7.33 vs 9.20 at 8e-3; the baseline spikes, the gated model does not")


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
    # --- the same sink with QK-norm on (the paper's architecture): a robustness check of the one-layer set-up
    *_sink_rows("qk-norm", "with QK-norm", "F-Attn", 0.3),
    # --- the sink in a deeper model, judged per head (the paper's maps are per head)
    *_sink_rows("deep", "deeper model", "largest head's F-Attn", 0.3),
    # --- the four-layer model (the first deep-sink set-up): on seeds 30-41 G1 elementwise, not the baseline, held one
    Direction("four-layer/g1-sink", "4-layer model, the paper's opposite: G1 elementwise has a strong attention sink: "
              "its largest head's F-Attn above 0.3", "four-layer", "largest head's F-Attn", "g1-elementwise", "above",
              0.3, against=None, paper="G1 0.048 (no sink)", opposite=True),
    # --- massive activations in the one-layer models (their only layer's output: nothing reads it)
    Direction("m-act/g1-elementwise", "G1 elementwise lowers massive activations: its M-Act below half the "
              "baseline's", "main", "M-Act", "g1-elementwise", "below", 0.5, comparison="ratio", paper="94 / 1053"),
    Direction("m-act/g1-elementwise/high-lr", "... at the high learning rate", "main", "M-Act", "g1-elementwise",
              "below", 0.5, comparison="ratio", lr="high"),
    Direction("m-act/sdpa-rmsnorm/high-lr", "at the high learning rate, RMSNorm on the SDPA output (no gate)'s M-Act "
              "below half the baseline's", "main", "M-Act", "sdpa-rmsnorm", "below", 0.5, comparison="ratio",
              lr="high", paper="not reported"),
    # --- held-out loss beyond the training length (no YaRN): the one-layer models at 2x, 4x and 8x
    *(Direction(f"extrapolation/{m}x", f"at {m}x the training length, G1 elementwise's held-out loss below the "
                "baseline's", "main", f"held-out loss at {m}x", "g1-elementwise", "below",
                paper="table 5: the gated model loses less beyond its training length") for m in (2, 4, 8)),
    *(Direction(f"m-act/{v}", f"{NAMES[v]}'s M-Act below the baseline's", "main", "M-Act", v, "below", 1.0,
                comparison="ratio", paper=paper) for v, paper in (
        ("g1-headwise", "98 / 1053"), ("ns-sigmoid", "892 / 1053"), ("input-independent", "471 / 1053"),
        ("sdpa-rmsnorm", "not reported"))),
    # --- massive activations where the paper measures them: the first token's residual stream, non-final layers
    Direction("mact/massive", "M-Act model: the baseline's largest activation in the non-final layers is at the "
              "first token, over twice the largest elsewhere", "mact", "first-token M-Act over the rest", "baseline",
              "above", 2.0, against=None, paper="massive activations at the first token"),
    Direction("mact/m-act", "M-Act model: G1 elementwise lowers the first token's massive activation: below the "
              "baseline's", "mact", "first-token M-Act", "g1-elementwise", "below", 1.0, comparison="ratio",
              requires=("mact/massive",), paper="94 / 1053"),
    Direction("mact/m-act/half", "M-Act model: ... below half the baseline's", "mact", "first-token M-Act",
              "g1-elementwise", "below", 0.5, comparison="ratio", requires=("mact/massive",), paper="94 / 1053"),
    *_sink_rows("mact", "M-Act model", "largest head's F-Attn", 0.3),
    # --- table 1: held-out loss, paired by seed, on a corpus the models do not saturate
    Direction("table1/not-saturated", "table 1's models: the baseline's held-out loss lies over 0.1 nats above the "
              "corpus's entropy (room to rank the variants)", "table1", "loss above the floor", "baseline", "above",
              0.1, against=None),
    *(Direction(f"table1/{v}-vs-{w}", f"table 1's ranking: {NAMES[v]}'s held-out loss below {NAMES[w]}'s",
                "table1", "held-out loss", v, "below", against=w, requires=("table1/not-saturated",),
                paper=f"PPL {paper}") for v, w, paper in TABLE1_PAIRS),
    # --- table 1 on a corpus the models learn (within 0.1 nats of its entropy on the tuning seeds)
    *(Direction(f"table1-learned/{v}-vs-{w}", f"table 1's ranking on a corpus the models learn: {NAMES[v]}'s "
                f"held-out loss below {NAMES[w]}'s", "table1-learned", "held-out loss", v, "below", against=w,
                paper=f"PPL {paper}") for v, w, paper in TABLE1_PAIRS),
    # --- stability at a high learning rate (table 2): a failure rate over many seeds, and the loss spikes
    _failure_row("stability", "at the high learning rate"),
    Direction("stability/spikes", "smaller loss spikes at the high rate for G1 elementwise than for the baseline",
              "stability", "loss spike", "g1-elementwise", "below", lr="high",
              paper="3T-token curves: baseline spikes to 10.37, gated under 2.17"),
    # --- the mechanism: RMSNorm on the SDPA output changes the attention output without a sigmoid gate
    Direction("stability/failures/sdpa-rmsnorm", "at the high learning rate, RMSNorm on the SDPA output (no gate) "
              "fails less often than the baseline (a failure as in stability/failures)", "stability",
              "held-out loss", "sdpa-rmsnorm", "below", FAILURE_MARGIN, lr=("high", "standard"), test="mcnemar",
              paper="not reported"),
    Direction("stability/spikes/sdpa-rmsnorm", "smaller loss spikes at the high rate for RMSNorm on the SDPA output "
              "(no gate) than for the baseline", "stability", "loss spike", "sdpa-rmsnorm", "below", lr="high",
              paper="not reported"),
    # --- the gate's sparsity in the 6-layer M-Act model (exploratory: that set-up was chosen on 2 tuning seeds)
    Direction("six-layer/sparse-gate/mean", "exploratory, 6-layer model: G1 elementwise's gate is sparse: mean "
              "score below 0.3", "six-layer", "gate mean", "g1-elementwise", "below", 0.3, against=None,
              paper="0.116"),
    Direction("six-layer/sparse-gate/near-zero", "exploratory, 6-layer model: G1 elementwise's gate is sparse: more "
              "than half its scores below 0.1", "six-layer", "gate < 0.1", "g1-elementwise", "above", 0.5,
              against=None, paper="histogram mode near 0"),
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
