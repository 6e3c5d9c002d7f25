"""The statistics behind every verdict of `gated-qwen reproduce`: one number per seed, an exact 95% interval for
their median, and the three-way verdict.

Each direction compares, seed by seed, a variant with the baseline trained on the same seed (or a variant's own
number with a fixed level). Seeds are independent draws of the whole training run, so the per-seed numbers are
independent; nothing else is assumed about them (no normality, no equal variances, no symmetry).

The interval is the sign test's: the distribution-free confidence interval for the median of the per-seed numbers,
`[x_(k), x_(n+1-k)]` (order statistics, k-th smallest and k-th largest), with the largest `k` whose coverage
`1 - 2 P(B <= k - 1)`, `B ~ Binomial(n, 1/2)`, is at least 95%. Its coverage is exact, not asymptotic (reported with
the interval: at n = 10 it is 97.9%). Below 6 seeds no such interval exists (at 5 seeds `[min, max]` covers the median
only 93.75% of the time): the interval is then unbounded and the verdict inconclusive. The interval excludes a level
`t` exactly when the two-sided exact sign test of "median = t" rejects at 1 - coverage, so the verdict is that test.

The verdict (issue 30): **yes** when the interval lies wholly beyond the threshold in the paper's direction, **no**
when it lies wholly beyond it the other way, **inconclusive** otherwise (a bound equal to the threshold does not
exclude it). A monotone change of scale (a ratio or its logarithm) moves the order statistics with it, so the
verdict on a ratio is the same as on the log-ratio.
"""

from __future__ import annotations

import math

CONFIDENCE = 0.95
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
