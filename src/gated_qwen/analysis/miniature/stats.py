"""The statistics behind every verdict of `gated-qwen reproduce`: one number per seed, an exact 95% interval for
their median and the three-way verdict; the exact McNemar test for a failure rate; the corrections across the rows
of one report (Holm, Benjamini-Hochberg); and the smallest effect a row can detect at its number of seeds.

Each direction compares, seed by seed, a variant with the baseline trained on the same seed (or a variant's own
number with a fixed level). Seeds are independent draws of the whole training run, so the per-seed numbers are
independent; nothing else is assumed about them (no normality, no equal variances, no symmetry).

The interval is the sign test's: the distribution-free confidence interval for the median of the per-seed numbers,
`[x_(k), x_(n+1-k)]` (order statistics, k-th smallest and k-th largest), with the largest `k` whose coverage
`1 - 2 P(B <= k - 1)`, `B ~ Binomial(n, 1/2)`, is at least 95%. Its coverage is exact, not asymptotic (reported with
the interval: at n = 10 it is 97.9%). Below 6 seeds no such interval exists (at 5 seeds `[min, max]` covers the median
only 93.75% of the time): the interval is then unbounded and the verdict inconclusive. The interval excludes a level
`t` exactly when the two-sided exact sign test of "median = t" rejects at 1 - coverage, so the verdict is that test.

The verdict: **yes** when the interval lies wholly beyond the threshold in the paper's direction, **no**
when it lies wholly beyond it the other way, **inconclusive** otherwise (a bound equal to the threshold does not
exclude it). A monotone change of scale (a ratio or its logarithm) moves the order statistics with it, so the
verdict on a ratio is the same as on the log-ratio. The row's p-value (`interval_p`) is the interval's own: the
smallest 1 - coverage at which the interval excludes the threshold, so that p <= 5% exactly when the verdict is yes
or no (a value on the threshold counts against excluding it, as in the interval).

A failure rate (a run fails, or not, per seed, for two variants trained on the same seeds) is judged by
the exact McNemar test (`mcnemar`): of the seeds where one variant fails and the other does not (the discordant
pairs), the share that goes each way is Binomial(discordant, 1/2) when both fail equally often; the two-sided exact
binomial test on them (SciPy's `binomtest`) gives the p-value, and the verdict is yes / no when p <= 5% and the
failures lean the paper's way / the other way, inconclusive otherwise.

Across the rows of one report (`adjust`): Holm's step-down procedure bounds the chance of any false yes or no
(family-wise error) at 5%, Benjamini-Hochberg's step-up procedure (SciPy's `false_discovery_control`) the expected
share of false ones among those declared (false discovery rate) at 5%. A row keeps its yes or no under a correction
when the correction rejects its p-value, and is inconclusive otherwise.
"""

from __future__ import annotations

import math

CONFIDENCE = 0.95
ALPHA = 1 - CONFIDENCE
POWER = 0.8  # the power at which `detectable` states a row's smallest detectable effect
VERDICTS = ("yes", "no", "inconclusive")


def binomial_half_cdf(k: int, n: int) -> float:
    """P(B <= k) for B ~ Binomial(n, 1/2), exactly (integer arithmetic, then one division)."""
    if k < 0:
        return 0.0
    return sum(math.comb(n, i) for i in range(min(k, n) + 1)) / 2**n


def interval_rank(n: int, confidence: float = CONFIDENCE) -> int | None:
    """The largest k with `1 - 2 P(B <= k - 1) >= confidence` (B ~ Binomial(n, 1/2)): the order statistics
    `x_(k)`, `x_(n+1-k)` bound the interval; None when not even `[min, max]` reaches `confidence`."""
    best = None
    for k in range(1, n // 2 + 1):
        if 1 - 2 * binomial_half_cdf(k - 1, n) < confidence:
            break
        best = k
    return best


def median(values: list[float]) -> float | None:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return None
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> dict:
    """The sign test's interval for the median of `values` (finite or infinite numbers, one per seed): `low`,
    `high` (None: unbounded, too few values), `coverage` (exact; 1 when unbounded), `rank` k and `n`."""
    ordered, n = sorted(values), len(values)
    k = interval_rank(n, confidence)
    if k is None:
        return {"low": None, "high": None, "coverage": 1.0, "rank": None, "n": n}
    return {"low": ordered[k - 1], "high": ordered[n - k], "coverage": 1 - 2 * binomial_half_cdf(k - 1, n),
            "rank": k, "n": n}


def sign_test(values: list[float], level: float) -> dict:
    """The exact two-sided sign test of "the median is `level`": how many values lie `above` and `below` it (those
    equal to it are dropped, as usual) and the p-value, `min(1, 2 P(B <= min(above, below)))`, B ~ Binomial(above +
    below, 1/2)."""
    above = sum(v > level for v in values)
    below = sum(v < level for v in values)
    p = min(1.0, 2 * binomial_half_cdf(min(above, below), above + below)) if above + below else 1.0
    return {"above": above, "below": below, "p": p}


def verdict(interval: dict, threshold: float, paper: str) -> str:
    """"yes" / "no" / "inconclusive" for `interval` (from `median_interval`) against `threshold`, the paper's
    direction being that the median lies `"above"` or `"below"` it."""
    if paper not in ("above", "below"):
        raise ValueError(f"`paper` must be 'above' or 'below', got {paper!r}.")
    low, high = interval["low"], interval["high"]
    if low is None or high is None:
        return "inconclusive"
    if low > threshold:
        return "yes" if paper == "above" else "no"
    if high < threshold:
        return "yes" if paper == "below" else "no"
    return "inconclusive"


def interval_p(values: list[float], threshold: float) -> float:
    """The p-value that matches `median_interval`'s verdict: `min(1, 2 P(B <= m))`, B ~ Binomial(n, 1/2), with m the
    smaller of the counts of values at or below and at or above `threshold` (a value on it counts for both sides, as
    the interval does not exclude a threshold it touches). The interval of coverage 1 - q excludes `threshold`
    exactly when this p-value is at most q; so p <= 5% exactly when `verdict` says yes or no."""
    n = len(values)
    if n == 0:
        return 1.0
    m = min(sum(v <= threshold for v in values), sum(v >= threshold for v in values))
    return min(1.0, 2 * binomial_half_cdf(m, n))


def mcnemar(failures: list[tuple[bool, bool]], paper: str = "below") -> dict:
    """The exact McNemar test of paired failures `[(variant failed, against failed), ...]` (one pair per seed):
    `variant_only` / `against_only` (the discordant pairs), `p` (two-sided exact binomial test on them, SciPy's
    `binomtest`; 1 without any) and the `verdict`: the paper's side is that the variant fails less (`"below"`) or
    more (`"above"`) often; yes / no when p <= 5% and the discordant pairs lean its way / the other way."""
    from scipy.stats import binomtest  # the analysis extra

    if paper not in ("above", "below"):
        raise ValueError(f"`paper` must be 'above' or 'below', got {paper!r}.")
    variant_only = sum(mine and not theirs for mine, theirs in failures)
    against_only = sum(theirs and not mine for mine, theirs in failures)
    discordant = variant_only + against_only
    p = float(binomtest(variant_only, discordant, 0.5).pvalue) if discordant else 1.0
    fewer = variant_only < against_only  # the variant fails less often
    verdict = "inconclusive" if p > ALPHA or variant_only == against_only else (
        "yes" if fewer == (paper == "below") else "no")
    return {"variant_only": variant_only, "against_only": against_only, "pairs": len(failures),
            "variant_failures": sum(mine for mine, _ in failures),
            "against_failures": sum(theirs for _, theirs in failures), "p": p, "verdict": verdict}


def holm(p_values: list[float], alpha: float = ALPHA) -> list[bool]:
    """Holm's step-down procedure: the hypotheses it rejects, in the order given. Sorted ascending, the i-th smallest
    p-value (i = 0, 1, ...) is rejected while every one up to it is at most alpha / (m - i); the first that is not
    stops it."""
    m = len(p_values)
    rejected = [False] * m
    for i, index in enumerate(sorted(range(m), key=lambda j: p_values[j])):
        if p_values[index] > alpha / (m - i):
            break
        rejected[index] = True
    return rejected


def benjamini_hochberg(p_values: list[float], alpha: float = ALPHA) -> list[bool]:
    """Benjamini-Hochberg's step-up procedure at false discovery rate `alpha`: the hypotheses it rejects (those whose
    adjusted p-value, SciPy's `false_discovery_control`, is at most `alpha`), in the order given."""
    if not p_values:
        return []
    from scipy.stats import false_discovery_control  # the analysis extra

    return [bool(q <= alpha) for q in false_discovery_control(p_values, method="bh")]


def adjust(rows: list[dict]) -> None:
    """Adds `adjusted: {"holm": verdict, "fdr": verdict}` to every row (dicts with `verdict`, `p` and `requires`,
    in the order judged, set-up rows first): over the rows that were tested (verdict yes, no or inconclusive), a row
    keeps its yes or no where the correction rejects its p-value and is inconclusive otherwise; a row that was not
    testable stays so, and a row whose set-up rows are not yes under the correction is not testable under it."""
    tested = [row for row in rows if row["verdict"] in VERDICTS]
    decisions = {"holm": holm([row["p"] for row in tested]),
                 "fdr": benjamini_hochberg([row["p"] for row in tested])}
    for name, rejected in decisions.items():
        kept = {id(row): keep for row, keep in zip(tested, rejected)}
        verdicts: dict[str, str] = {}
        for row in rows:
            if row["verdict"] not in VERDICTS or any(verdicts.get(r) != "yes" for r in row["requires"]):
                verdict = "not testable here"
            else:
                verdict = row["verdict"] if kept[id(row)] else "inconclusive"
            row.setdefault("adjusted", {})[name] = verdicts[row["name"]] = verdict


def seeds_needed(n: int, alpha: float = ALPHA) -> int | None:
    """The fewest of `n` seeds that must lie on the paper's side of a row's threshold (the rest on the other side)
    for its sign test to reject at `alpha`; None when even all `n` are too few."""
    for m in range(n // 2, -1, -1):  # m seeds on the other side
        if 2 * binomial_half_cdf(m, n) <= alpha:
            return n - m
    return None


def _binomial_at_least(k: int, n: int, q: float) -> float:
    """P(Binomial(n, q) >= k)."""
    return sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(k, n + 1))


def _smallest_rate(k: int, n: int, power: float) -> float:
    """The smallest rate q (to 0.001) with P(Binomial(n, q) >= k) >= power (bisection: it grows with q)."""
    low, high = 0.0, 1.0
    while high - low > 1e-4:
        middle = (low + high) / 2
        low, high = (low, middle) if _binomial_at_least(k, n, middle) >= power else (middle, high)
    return round(high, 3)


def detectable(test: str, n: int, alpha: float = ALPHA, power: float = POWER) -> dict | None:
    """The smallest effect a row detects with probability `power` at `n` seeds and level `alpha`, or None when no
    effect can be detected at all:
    - for the sign test ("sign"): `share`, the share of seeds on the paper's side of the threshold (the chance that
      one seed lands there) at which the test says yes with that power, and `seeds`, how many of the `n` must;
    - for the exact McNemar test ("mcnemar"): `share`, the rate at which the against-variant fails where the variant
      never does (the difference in failure rates, with no discordant pair the other way), and `seeds`, the
      discordant pairs that takes (all one way)."""
    if test == "sign":
        k = seeds_needed(n, alpha)
    elif test == "mcnemar":
        k = next((b for b in range(1, n + 1) if 2 * 0.5**b <= alpha), None)
    else:
        raise ValueError(f"`test` must be 'sign' or 'mcnemar', got {test!r}.")
    if k is None:
        return None
    return {"seeds": k, "of": n, "share": _smallest_rate(k, n, power)}
