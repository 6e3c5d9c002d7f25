"""Judges the rows of `directions.DIRECTIONS` on a run's numbers: `evaluate` one row, `judge` every row whose models
were trained (set-up rows first), then the corrections across the rows of the report (`stats.adjust`).

The seeds are each family's own (its preset's `seeds`) less the seeds on which its set-up was chosen (its
`tuning_seeds`, listed under `meta` and never used as evidence). `stats` computes the intervals, p-values and
verdicts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from . import stats
from .directions import DIRECTIONS, METRICS, Direction


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
    """The row's number for one seed and the measurements it comes from (`{variant: value, against: value}`); for
    a McNemar row the number is 1.0 when only the variant failed, -1.0 when only the against-variant did, else 0.0."""
    mine = _measured(row, get, row.variant, seed)
    theirs = None if row.against is None else _measured(row, get, row.against, seed)
    if mine is None or (row.against is not None and theirs is None):
        return None, {}
    if row.against is None:
        return mine, {row.variant: mine}
    measured = {row.variant: mine, row.against: theirs}
    if row.test == "mcnemar":
        return float((mine > row.threshold) - (theirs > row.threshold)), measured
    return (mine - theirs if row.comparison == "difference" else _ratio(mine, theirs)), measured


def _sign_judgement(row: Direction, values: list[float]) -> dict:
    interval = stats.median_interval(values)
    return {"median": stats.median(values),
            "interval": {**interval, "method": "exact sign test (distribution-free interval for the median)"},
            "sign_test": stats.sign_test(values, row.threshold), "p": stats.interval_p(values, row.threshold),
            "verdict": stats.verdict(interval, row.threshold, row.side)}


def _mcnemar_judgement(row: Direction, per_seed: dict) -> dict:
    pairs = [(e["measured"][row.variant] > row.threshold, e["measured"][row.against] > row.threshold)
             for e in per_seed.values() if e["value"] is not None]
    test = stats.mcnemar(pairs, row.side)
    return {"median": None, "interval": None, "mcnemar": test, "p": test["p"], "verdict": test["verdict"]}


def evaluate(row: Direction, get: Callable[[str, str, int], dict | None], seeds: list[int],
             tuning_seeds: list[int], verdicts: dict[str, str]) -> dict:
    """Judges `row` on the runs `get(variant, "standard" | "high", seed)` returns (None: not trained): its number on
    each of `seeds` that is not a tuning seed, the test's p-value and the verdict ("sign": the sign test's 95%
    interval of the median; "mcnemar": the exact McNemar test of the failures); "not testable here" when a row it
    `requires` (in `verdicts`, judged before) is not "yes". Also the smallest effect the test detects at this
    number of seeds (`detectable`, at 5%; the correction's own is added by `judge`)."""
    evidence = [seed for seed in seeds if seed not in tuning_seeds]
    per_seed = {seed: dict(zip(("value", "measured"), seed_value(row, get, seed))) for seed in evidence}
    values = [entry["value"] for entry in per_seed.values() if entry["value"] is not None
              and not math.isnan(entry["value"])]
    judged = _mcnemar_judgement(row, per_seed) if row.test == "mcnemar" else _sign_judgement(row, values)
    blocked = [name for name in row.requires if verdicts.get(name) != "yes"]
    return {
        **declared(row), "seeds": evidence, "per_seed": per_seed, **judged,
        "detectable": {"raw": stats.detectable(row.test, len(values))},
        **({"verdict": "not testable here", "not_testable_because": blocked} if blocked else {}),
        "meta": {"tuning_seeds": list(tuning_seeds), "tuning_seeds_in_this_run": [s for s in seeds if s in tuning_seeds]},
    }


def declared(row: Direction) -> dict:
    """The row as a report writes it before its numbers: every field of its declaration, in words where the code
    names them (the metric's description, the per-seed comparison), so that a report shows which rows it judged."""
    return {"name": row.name, "claim": row.claim, "family": row.family, "metric": METRICS[row.metric].description,
            "comparison": _comparison(row), "test": row.test, "threshold": row.threshold, "side": row.side,
            "paper": row.paper, "requires": list(row.requires)}


def _comparison(row: Direction) -> str:
    """The per-seed number in words, e.g. "g1-elementwise / baseline of F-Attn at the standard rate, below 0.3333"."""
    rate = ("the change from the standard to the high rate" if isinstance(row.lr, tuple) else f"the {row.lr} rate")
    if row.test == "mcnemar":
        return (f"whether {row.variant} and {row.against} fail ({row.metric}, {rate}, above {row.threshold:g}); the "
                f"paper's side: {row.variant} fails {'less' if row.side == 'below' else 'more'} often")
    number = row.variant if row.against is None else (
        f"{row.variant} - {row.against}" if row.comparison == "difference" else f"{row.variant} / {row.against}")
    whose = "the claim's side (the paper's opposite)" if row.opposite else "the paper's side"
    return f"{number} of {row.metric} at {rate}; {whose}: {row.side} {row.threshold:.4g}"


def _trained(row: Direction, family: dict) -> bool:
    """Whether the run trained every model the row reads (at some seed)."""
    rates = row.lr if isinstance(row.lr, tuple) else (row.lr,)
    trained = {(variant, lr) for variant, lr, _ in family["runs"]}
    wanted = [row.variant] + ([row.against] if row.against else [])
    return all((v, family["learning_rates"][rate]) in trained for v in wanted for rate in rates)


def _untestable(row: Direction, reason: str) -> dict:
    """A row of a family the preset declares untestable (no set-up found on the tuning seeds): no runs, no test."""
    return {**declared(row), "seeds": [], "per_seed": {}, "median": None,
            "interval": None, "p": None, "detectable": {"raw": None}, "verdict": "not testable here",
            "not_testable_because": [reason], "meta": {"tuning_seeds": [], "tuning_seeds_in_this_run": []}}


def judge(families: dict[str, dict], untestable: dict[str, str] | None = None) -> tuple[list[dict], list[str]]:
    """Every row of `DIRECTIONS` whose models were trained, judged in order by `evaluate` (set-up rows first, so the
    rows that require them see their verdicts), with the corrections across them (`stats.adjust`: each row's
    `adjusted` verdicts, and `detectable["holm"]` at Holm's strictest level); and the names of the rows whose models
    were not trained (or whose metric the run did not measure, e.g. a length it did not evaluate). `families[name]`:
    `{"runs": {(variant, learning rate, seed): result}, "learning_rates": {"standard": lr, "high": lr}, "seeds",
    "tuning_seeds"}`. `untestable[family]`: the reason a family was not trained (its rows are "not testable here")."""
    verdicts, judged, not_run = {}, [], []
    for row in DIRECTIONS:
        family = families.get(row.family)
        if family is None and row.family in (untestable or {}):
            judged.append(_untestable(row, untestable[row.family]))
            verdicts[row.name] = judged[-1]["verdict"]
            continue
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
    stats.adjust(judged)
    tested = sum(row["verdict"] in stats.VERDICTS for row in judged)
    for row in judged:
        n = len([e for e in row["per_seed"].values() if e["value"] is not None and not math.isnan(e["value"])])
        row["detectable"]["holm"] = stats.detectable(row["test"], n, stats.ALPHA / max(tested, 1)) if n else None
    return judged, not_run
