"""The statistics behind `reproduce`'s verdicts, against hand computation: the binomial tail and the sign test's
interval (exact fractions, and its coverage by simulation), the sign test's p-value and the one that matches the
interval, the three-way verdict at, above and below its edges; the exact McNemar test (by hand, and against the
binomial tail); Holm's and Benjamini-Hochberg's corrections (by hand, at their edges, and their error rates by
simulation); the corrected verdicts of a report's rows; the smallest detectable effect (by hand and by simulation).
The rows judged on made-up runs: test_judge.py."""

import math
import random

import pytest

from gated_qwen.analysis.miniature import stats


def test_binomial_tail_by_hand():
    assert stats.binomial_half_cdf(0, 6) == 1 / 64
    assert stats.binomial_half_cdf(1, 6) == 7 / 64  # 1 + 6
    assert stats.binomial_half_cdf(1, 10) == 11 / 1024  # 1 + 10
    assert stats.binomial_half_cdf(2, 12) == 79 / 4096  # 1 + 12 + 66
    assert stats.binomial_half_cdf(-1, 5) == 0 and stats.binomial_half_cdf(5, 5) == 1


@pytest.mark.parametrize("n, rank, coverage", [
    (5, None, None),  # [min, max] covers 1 - 2/32 = 93.75% < 95%: no 95% interval
    (6, 1, 1 - 2 / 64),
    (8, 1, 1 - 2 / 256),
    (9, 2, 1 - 2 * 10 / 512),
    (10, 2, 1 - 2 * 11 / 1024),
    (12, 3, 1 - 2 * 79 / 4096),  # k = 4 would cover 1 - 2 * 299 / 4096 = 85%
])
def test_the_sign_test_interval_by_hand(n, rank, coverage):
    values = random.Random(n).sample(range(100), n)
    interval = stats.median_interval([float(v) for v in values])
    ordered = sorted(values)
    assert stats.interval_rank(n) == rank and interval["rank"] == rank and interval["n"] == n
    if rank is None:
        assert interval["low"] is interval["high"] is None and interval["coverage"] == 1.0
    else:
        assert (interval["low"], interval["high"]) == (ordered[rank - 1], ordered[n - rank])
        assert interval["coverage"] == pytest.approx(coverage, abs=1e-12)


@pytest.mark.parametrize("n", [6, 10])
def test_the_interval_covers_the_median_as_often_as_it_says(n):
    """20,000 samples of n seeds from a skewed continuous distribution whose median is known (exponential, median
    ln 2): the share of intervals that hold it is the stated coverage (standard error 0.0012)."""
    rng = random.Random(1)
    trials, held = 20_000, 0
    for _ in range(trials):
        interval = stats.median_interval([rng.expovariate(1.0) for _ in range(n)])
        held += interval["low"] <= math.log(2) <= interval["high"]
    assert held / trials == pytest.approx(stats.median_interval([0.0] * n)["coverage"], abs=0.006)


def test_sign_test_by_hand():
    assert stats.sign_test([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 0.0) == {"above": 6, "below": 0, "p": 2 / 64}
    assert stats.sign_test([0.1, 0.2, 0.3, 0.4, 0.5, -0.6], 0.0) == {"above": 5, "below": 1, "p": 2 * 7 / 64}
    assert stats.sign_test([0.0, 0.2, 0.3, 0.4, 0.5, 0.6], 0.0) == {"above": 5, "below": 0, "p": 2 / 32}  # tie out
    assert stats.sign_test([1.0, 1.0], 1.0) == {"above": 0, "below": 0, "p": 1.0}
    assert stats.median([3.0, 1.0, 2.0]) == 2.0 and stats.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert stats.median([]) is None


@pytest.mark.parametrize("low, high, side, expected", [
    (0.01, 2.0, "above", "yes"), (0.01, 2.0, "below", "no"),  # wholly above the threshold 0
    (-2.0, -0.01, "below", "yes"), (-2.0, -0.01, "above", "no"),  # wholly below
    (0.0, 2.0, "above", "inconclusive"), (-2.0, 0.0, "below", "inconclusive"),  # a bound at the threshold
    (-1.0, 1.0, "above", "inconclusive"), (-1.0, 1.0, "below", "inconclusive"),  # straddling it
    (None, None, "above", "inconclusive"),  # too few seeds: unbounded
    (-math.inf, -1.0, "below", "yes"), (1.0, math.inf, "below", "no"),  # infinite bounds (ratios over 0) are bounds
])
def test_the_verdict_rule_at_above_and_below_its_edges(low, high, side, expected):
    assert stats.verdict({"low": low, "high": high}, 0.0, side) == expected


def test_the_verdict_of_a_ratio_against_a_third():
    third = 1 / 3
    assert stats.verdict({"low": 0.1, "high": 0.3333}, third, "below") == "yes"
    assert stats.verdict({"low": 0.1, "high": third}, third, "below") == "inconclusive"
    assert stats.verdict({"low": 0.34, "high": 0.9}, third, "below") == "no"
    with pytest.raises(ValueError, match="'above' or 'below'"):
        stats.verdict({"low": 0.1, "high": 0.2}, third, "lower")



# ------------------------------------------------------------------------------------ the p-value of an interval
def test_the_interval_p_value_by_hand():
    assert stats.interval_p([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 0.0) == 2 / 64  # all six above
    assert stats.interval_p([0.0, 0.2, 0.3, 0.4, 0.5, 0.6], 0.0) == 2 * 7 / 64  # a tie counts against excluding
    assert stats.interval_p([-0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 0.0) == 2 * 7 / 64
    assert stats.interval_p([0.1] * 5, 0.0) == 2 / 32  # 5 seeds: never below 5%
    assert stats.interval_p([], 0.0) == 1.0 and stats.interval_p([1.0, -1.0], 0.0) == 1.0


def test_the_interval_p_value_is_at_most_5_percent_exactly_when_the_verdict_is_decided():
    """On random numbers with ties at the threshold (0, 1 or 2 per sample), 5 to 25 seeds, either side."""
    rng = random.Random(7)
    for _ in range(3000):
        n = rng.randint(5, 25)
        values = [rng.choice((0.0, rng.gauss(0.8, 1.0))) if rng.random() < 0.1 else rng.gauss(0.8, 1.0)
                  for _ in range(n)]
        side = rng.choice(("above", "below"))
        decided = stats.verdict(stats.median_interval(values), 0.0, side) != "inconclusive"
        assert (stats.interval_p(values, 0.0) <= stats.ALPHA) == decided, (values, side)


# ------------------------------------------------------------------------------------------ the McNemar test
def test_mcnemar_by_hand():
    both, neither = (True, True), (False, False)
    fewer = [(False, True)] * 6 + [both] * 3 + [neither] * 21  # G1 never fails where the baseline fails 6 times
    test = stats.mcnemar(fewer)
    assert test == {"variant_only": 0, "against_only": 6, "pairs": 30, "variant_failures": 3, "against_failures": 9,
                    "p": pytest.approx(2 / 64), "verdict": "yes"}
    assert stats.mcnemar(fewer, paper="above")["verdict"] == "no"
    five = stats.mcnemar([(False, True)] * 5 + [neither] * 25)  # 5 discordant pairs: p = 2/32 > 5%
    assert five["p"] == pytest.approx(2 / 32) and five["verdict"] == "inconclusive"
    more = stats.mcnemar([(True, False)] * 7 + [(False, True)])  # 7 vs 1: 2 P(B <= 1), B ~ Binomial(8, 1/2)
    assert more["p"] == pytest.approx(2 * stats.binomial_half_cdf(1, 8)) == pytest.approx(18 / 256)
    assert more["verdict"] == "inconclusive"
    more = stats.mcnemar([(True, False)] * 9 + [(False, True)])  # 9 vs 1: 2 * 11 / 1024 < 5%, the wrong way
    assert more["p"] == pytest.approx(22 / 1024) and more["verdict"] == "no"
    even = stats.mcnemar([(True, False)] * 3 + [(False, True)] * 3 + [both] * 4)
    assert even["p"] == 1.0 and even["verdict"] == "inconclusive"
    assert stats.mcnemar([both, neither]) == {"variant_only": 0, "against_only": 0, "pairs": 2, "variant_failures": 1,
                                              "against_failures": 1, "p": 1.0, "verdict": "inconclusive"}
    with pytest.raises(ValueError, match="'above' or 'below'"):
        stats.mcnemar(fewer, paper="less")


# ---------------------------------------------------------------------------------------- corrections across rows
@pytest.mark.parametrize("p, holm, fdr", [
    ([0.01, 0.04, 0.03, 0.005], [True, False, False, True], [True, True, True, True]),
    # Holm: 0.001 <= 0.05/3, 0.012 <= 0.05/2, 0.04 <= 0.05; BH: all <= k * 0.05 / 3
    ([0.001, 0.04, 0.012], [True, True, True], [True, True, True]),
    # BH steps up: 0.03 <= 2 * 0.05 / 3 rejects it and the smaller 0.02 (above 0.05 / 3); Holm stops at 0.02
    ([0.02, 0.03, 0.2], [False, False, False], [True, True, False]),
    # at the edges: exactly alpha / m (Holm) and k * alpha / m (BH) are rejected, a hair above is not
    ([0.0125, 0.5, 0.5, 0.5], [True, False, False, False], [True, False, False, False]),
    ([0.0125 + 1e-9, 0.5, 0.5, 0.5], [False, False, False, False], [False, False, False, False]),
    ([0.025, 0.025, 0.9, 0.9], [False, False, False, False], [True, True, False, False]),
    ([0.025 + 1e-9, 0.025 + 1e-9, 0.9, 0.9], [False, False, False, False], [False, False, False, False]),
    ([0.05], [True], [True]), ([0.05 + 1e-9], [False], [False]), ([], [], []),
])
def test_holm_and_benjamini_hochberg_by_hand(p, holm, fdr):
    assert stats.holm(p) == holm
    assert stats.benjamini_hochberg(p) == fdr


def test_the_corrections_hold_their_error_rates():
    """5,000 reports of 20 rows, all true nulls (uniform p-values): Holm rejects any in at most 5% of them (the
    family-wise error; about 1 - 0.95**... = 4.9% for independent rows), and so does BH (with every null true, its
    false discovery rate is the family-wise error); with 10 false nulls (p-values near 0) BH finds all of those more
    often than Holm."""
    rng = random.Random(3)
    trials = 5000
    holm_any = sum(any(stats.holm([rng.random() for _ in range(20)])) for _ in range(trials)) / trials
    bh_any = sum(any(stats.benjamini_hochberg([rng.random() for _ in range(20)])) for _ in range(trials)) / trials
    assert holm_any <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials) and bh_any <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    mixed = [[rng.random() * 0.004 for _ in range(10)] + [rng.random() for _ in range(10)] for _ in range(500)]
    assert sum(sum(stats.benjamini_hochberg(p)[:10]) for p in mixed) > sum(sum(stats.holm(p)[:10]) for p in mixed)


def _row(name, verdict, p, requires=()):
    return {"name": name, "verdict": verdict, "p": p, "requires": list(requires)}


def test_the_corrected_verdicts_of_a_report():
    """Over the tested rows only; a kept yes / no stays, one not kept is inconclusive, an inconclusive row stays so;
    a row whose set-up row is not yes under a correction is not testable under it."""
    rows = [_row("setup", "yes", 0.004), _row("a", "yes", 0.001, requires=("setup",)),
            _row("b", "no", 0.03), _row("c", "inconclusive", 0.2), _row("d", "not testable here", 0.001, ("x",)),
            _row("e", "yes", 0.002, requires=("b",))]
    stats.adjust(rows)  # 5 tested: Holm 0.001 <= 0.01, 0.002 <= 0.0125, 0.004 <= 0.0167, 0.03 > 0.025 stops
    assert {r["name"]: r["adjusted"] for r in rows} == {
        "setup": {"holm": "yes", "fdr": "yes"}, "a": {"holm": "yes", "fdr": "yes"},
        "b": {"holm": "inconclusive", "fdr": "no"},  # BH: 0.03 <= 4 * 0.05 / 5
        "c": {"holm": "inconclusive", "fdr": "inconclusive"},
        "d": {"holm": "not testable here", "fdr": "not testable here"},
        "e": {"holm": "not testable here", "fdr": "not testable here"}}  # its set-up row "b" is no / inconclusive
    weak_setup = [_row("setup", "yes", 0.04), _row("a", "yes", 0.001, requires=("setup",))]
    stats.adjust(weak_setup)  # Holm: 0.001 <= 0.025, then 0.04 <= 0.05: both kept
    assert [r["adjusted"]["holm"] for r in weak_setup] == ["yes", "yes"]
    weak_setup = [_row("setup", "yes", 0.04), _row("a", "yes", 0.001, ("setup",)), _row("z", "no", 0.04)]
    stats.adjust(weak_setup)  # Holm: 0.001 <= 0.0167, 0.04 > 0.025: the set-up row falls, and the row resting on it
    assert [r["adjusted"]["holm"] for r in weak_setup] == ["inconclusive", "not testable here", "inconclusive"]


# ----------------------------------------------------------------------------------- smallest detectable effect
@pytest.mark.parametrize("n, needed", [(5, None), (6, 6), (8, 8), (9, 8), (10, 9), (12, 10), (20, 15), (30, 21)])
def test_seeds_needed_match_the_interval(n, needed):
    assert stats.seeds_needed(n) == needed
    if needed is not None:  # the interval's rank k allows k - 1 seeds on the other side
        assert n - needed == stats.interval_rank(n) - 1


def test_the_smallest_detectable_effect_by_hand_and_by_simulation():
    six = stats.detectable("sign", 6)
    assert six["seeds"] == 6 and six["share"] == pytest.approx(0.8 ** (1 / 6), abs=1e-3)  # q**6 = 80%
    assert stats.detectable("sign", 5) is None and stats.detectable("sign", 6, alpha=0.01) is None
    failures = stats.detectable("mcnemar", 30)
    assert failures["seeds"] == 6  # 2 / 2**6 <= 5% < 2 / 2**5
    assert stats.detectable("mcnemar", 30, alpha=0.05 / 60)["seeds"] == 12  # 2 / 2**12 <= 0.00083 < 2 / 2**11
    with pytest.raises(ValueError, match="'sign' or 'mcnemar'"):
        stats.detectable("t", 10)
    # at that effect, the tests say yes in 80% of simulated runs
    rng = random.Random(5)
    twenty = stats.detectable("sign", 20)
    hits = sum(stats.verdict(stats.median_interval([1.0 if rng.random() < twenty["share"] else -1.0
                                                    for _ in range(20)]), 0.0, "above") == "yes" for _ in range(4000))
    assert hits / 4000 == pytest.approx(0.8, abs=0.025)
    hits = sum(stats.mcnemar([(False, rng.random() < failures["share"]) for _ in range(30)])["verdict"] == "yes"
               for _ in range(2000))
    assert hits / 2000 == pytest.approx(0.8, abs=0.03)
