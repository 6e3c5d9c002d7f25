"""The statistics behind `reproduce`'s verdicts, against hand computation: the binomial tail and the sign test's
interval (exact fractions, and its coverage by simulation), the sign test's p-value, the three-way verdict at, above
and below its edges, and every direction row judged on made-up runs (per-seed numbers, tuning seeds left out, set-up
rows that make a direction "not testable here")."""

import math
import random

import pytest

from gated_qwen.analysis import stats
from gated_qwen.analysis.directions import DIRECTIONS, METRICS, Direction, evaluate, judge
from gated_qwen.analysis.quantize import SCHEMES


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


# ------------------------------------------------------------------------------------------- the direction rows
def run(variant, seed, f_attn=0.5, m_act=100.0, gate=None, below=None, loss=2.0, rise=0.1, lr=0.01, increases=None,
        recall=None):
    """A `train_and_measure` result with what the rows read; `recall`: (without, with YaRN) at 1x, 2x, 4x of 32."""
    rows = [{"length": 32 * m, "recall": {"accuracy": a}, "recall_yarn": {"accuracy": b}}
            for m, (a, b) in zip((1, 2, 4), recall or [(1.0, 1.0)] * 3)]
    return {"variant": variant, "seed": seed, "learning_rate": lr, "heldout_loss": loss, "loss_max_rise": rise,
            "analysis": {"summary": {"first_token_attention": f_attn, "max_activation": m_act, "gate_mean": gate,
                                     "gate_below_0.1": below}},
            "quantization": {s: {"increase": x} for s, x in zip(SCHEMES, increases or (0.01,) * 4)},
            "extrapolation": rows}


def family(runs, seeds, tuning=(), rates=(0.01, 0.04)):
    return {"runs": {(r["variant"], r["learning_rate"], r["seed"]): r for r in runs},
            "learning_rates": {"standard": rates[0], "high": rates[1]}, "seeds": list(seeds),
            "tuning_seeds": list(tuning)}


def row(name):
    return next(d for d in DIRECTIONS if d.name == name)


def test_the_rows_are_declared_once_with_known_metrics_and_set_ups():
    names = [d.name for d in DIRECTIONS]
    assert len(names) == len(set(names))
    for d in DIRECTIONS:
        assert d.metric in METRICS and d.side in ("above", "below") and d.comparison in ("difference", "ratio")
        assert d.family in ("main", "mact", "long")
        assert all(names.index(r) < names.index(d.name) for r in d.requires), d.name  # set-ups judged first
    # every scheme, for G1 and each control of the main models, and for the M-Act model
    assert {d.name for d in DIRECTIONS if d.name.startswith("quant/")} == {
        f"quant/{s}/{v}" for s in SCHEMES for v in ("g1-elementwise", "g1-headwise", "ns-sigmoid", "input-independent",
                                                    "sdpa-rmsnorm")}
    assert {d.name for d in DIRECTIONS if d.name.startswith("mact/quant/")} == {f"mact/quant/{s}" for s in SCHEMES}


def test_sink_removal_judged_on_made_up_seeds():
    """Baseline F-Attn 0.6 on every seed; G1's gives ratios G1 / baseline per seed, held against a third."""
    removal = row("sink-removal/g1-elementwise")

    def judged(g1_values, tuning=()):
        seeds = list(range(len(g1_values)))
        runs = [run("baseline", s, f_attn=0.6) for s in seeds] + [
            run("g1-elementwise", s, f_attn=f) for s, f in zip(seeds, g1_values)]
        fam = family(runs, seeds, tuning)
        get = lambda v, rate, s: fam["runs"].get((v, fam["learning_rates"][rate], s))  # noqa: E731
        return evaluate(removal, get, seeds, list(tuning), {"sink": "yes"})

    all_below = judged([0.06, 0.12, 0.03, 0.09, 0.15, 0.18])  # ratios 0.1, 0.2, 0.05, 0.15, 0.25, 0.3
    assert all_below["verdict"] == "yes" and all_below["seeds"] == [0, 1, 2, 3, 4, 5]
    assert all_below["interval"]["low"] == pytest.approx(0.05) and all_below["interval"]["high"] == pytest.approx(0.3)
    assert all_below["per_seed"][2] == {"value": pytest.approx(0.05),
                                        "measured": {"g1-elementwise": 0.03, "baseline": 0.6}}
    assert all_below["median"] == pytest.approx((0.15 + 0.2) / 2)
    assert all_below["sign_test"] == {"above": 0, "below": 6, "p": 2 / 64}
    one_above = judged([0.06, 0.12, 0.03, 0.09, 0.15, 0.3])  # the last ratio 0.5: 6 seeds need all six
    assert one_above["verdict"] == "inconclusive" and one_above["interval"]["high"] == pytest.approx(0.5)
    at_edge = judged([0.06, 0.12, 0.03, 0.09, 0.15, 0.2])  # the last ratio exactly a third
    assert at_edge["interval"]["high"] == pytest.approx(1 / 3) and at_edge["verdict"] == "inconclusive"
    # ten seeds allow one the other way: the interval runs from the 2nd smallest to the 2nd largest
    ten = judged([0.06, 0.12, 0.03, 0.09, 0.15, 0.3, 0.06, 0.12, 0.03, 0.09])
    assert ten["verdict"] == "yes" and ten["interval"]["high"] == pytest.approx(0.25)
    assert judged([0.3, 0.36, 0.24, 0.42, 0.3, 0.33])["verdict"] == "no"  # ratios 0.4 - 0.7, all above a third
    assert judged([0.06] * 5)["verdict"] == "inconclusive"  # 5 seeds: no 95% interval
    # tuning seeds are never evidence: seeds 0 and 1 left out (listed under meta), four seeds remain
    tuned = judged([0.06, 0.12, 0.03, 0.09, 0.15, 0.18], tuning=(0, 1))
    assert tuned["seeds"] == [2, 3, 4, 5] and list(tuned["per_seed"]) == [2, 3, 4, 5]
    assert tuned["meta"] == {"tuning_seeds": [0, 1], "tuning_seeds_in_this_run": [0, 1]}
    assert tuned["verdict"] == "inconclusive"


def test_judge_every_family_with_set_ups_first():
    seeds = list(range(10, 16))
    main = [run("baseline", s, f_attn=0.7, m_act=100.0, loss=1.9, lr=0.01) for s in seeds]
    main += [run("g1-elementwise", s, f_attn=0.05, m_act=300.0, gate=0.27, below=0.73, loss=1.9, lr=0.01)
             for s in seeds]
    main += [run("baseline", s, loss=2.7, rise=0.3 + 0.01 * s, lr=0.04) for s in seeds]  # a plateau at the high rate
    main += [run("g1-elementwise", s, loss=1.9, rise=0.3, lr=0.04) for s in seeds]
    long = [run("baseline", s, f_attn=0.2, recall=[(1.0, 0.5), (0.3, 0.4), (0.1, 0.2)]) for s in seeds]
    long += [run("g1-elementwise", s, f_attn=0.1, recall=[(1.0, 0.9), (0.3, 0.6), (0.1, 0.1)]) for s in seeds]
    judged, not_run = judge({"main": family(main, seeds, tuning=(0, 1)), "long": family(long, seeds)})
    verdicts = {d["name"]: d["verdict"] for d in judged}
    assert {k: verdicts[k] for k in ("sink", "sink-removal/g1-elementwise", "sparse-gate/mean",
                                     "sparse-gate/near-zero", "m-act/g1-elementwise", "stability/baseline-degrades",
                                     "stability/degradation", "stability/loss")} == {
        "sink": "yes", "sink-removal/g1-elementwise": "yes",  # 0.7 > 0.3; 0.05 / 0.7 < 1/3
        "sparse-gate/mean": "yes", "sparse-gate/near-zero": "yes",  # 0.27 < 0.3; 0.73 > 0.5
        "m-act/g1-elementwise": "no",  # 300 / 100 = 3, above a half
        "stability/baseline-degrades": "yes", "stability/degradation": "yes", "stability/loss": "yes"}
    spikes = next(d for d in judged if d["name"] == "stability/spikes")  # rise 0.3 vs 0.4 .. 0.45: G1 smaller
    assert spikes["verdict"] == "yes" and spikes["per_seed"][10]["value"] == pytest.approx(-0.1)
    # the baseline forms no sink on the long-context corpus (0.2): its directions are not testable here
    assert verdicts["long/sink"] == "no"
    assert {verdicts[f"long/{k}"] for k in ("yarn-1x", "yarn-drop", "yarn-2x", "yarn-4x")} == {"not testable here"}
    assert next(d for d in judged if d["name"] == "long/yarn-1x")["not_testable_because"] == ["long/sink"]
    # no M-Act model, and no NS-sigmoid, input-independent, G1 headwise or RMSNorm runs: not run
    assert "mact/m-act" in not_run and "quant/w4a4/ns-sigmoid" in not_run and "m-act/g1-headwise" in not_run
    assert "m-act/g1-elementwise/high-lr" not in not_run
    assert set(verdicts) | set(not_run) == {d.name for d in DIRECTIONS}
    # with a sink, the long-context rows are judged: YaRN at 1x costs the baseline 0.5 and G1 0.1
    long = [dict(r, analysis={"summary": {"first_token_attention": 0.5}}) for r in long]
    judged, _ = judge({"long": family(long, seeds)})
    verdicts = {d["name"]: d["verdict"] for d in judged}
    assert verdicts == {"long/sink": "yes", "long/recall/baseline": "yes", "long/recall/g1-elementwise": "yes",
                        "long/yarn-1x": "yes", "long/yarn-drop": "yes", "long/yarn-2x": "yes", "long/yarn-4x": "no"}
    drop = next(d for d in judged if d["name"] == "long/yarn-drop")
    assert drop["per_seed"][10] == {"value": pytest.approx(0.1 - 0.5),
                                    "measured": {"g1-elementwise": pytest.approx(0.1), "baseline": pytest.approx(0.5)}}


def test_numbers_at_zero_and_diverged_runs():
    """A G1 run whose F-Attn and M-Act collapsed to 0 gives a ratio of 0; a baseline at 0 an infinite one; 0 / 0 no
    number (the seed is left out); a diverged (NaN) loss counts as infinitely bad."""
    seeds = list(range(6))
    main = [run("baseline", s, f_attn=0.0 if s == 5 else 0.5, m_act=0.0 if s < 2 else 100.0) for s in seeds]
    main += [run("g1-elementwise", s, f_attn=0.0, m_act=0.0 if s < 1 else 10.0) for s in seeds]
    main += [run("baseline", s, loss=math.nan, lr=0.04) for s in seeds]
    main += [run("g1-elementwise", s, loss=3.0, lr=0.04) for s in seeds]
    judged, _ = judge({"main": family(main, seeds)})
    by_name = {d["name"]: d for d in judged}
    removal = by_name["sink-removal/g1-elementwise"]
    assert math.isnan(removal["per_seed"][5]["value"]) and removal["interval"]["n"] == 5  # 0 / 0 left out
    act = by_name["m-act/g1-elementwise"]
    assert math.isnan(act["per_seed"][0]["value"]) and act["per_seed"][1]["value"] == math.inf
    assert by_name["stability/loss"]["per_seed"][0]["value"] == -math.inf
    assert by_name["stability/loss"]["verdict"] == "yes"


def test_a_difference_row_reads_the_change_between_two_rates():
    d = Direction("x", "x", "main", "held-out loss", "g1-elementwise", "below", lr=("high", "standard"))
    runs = {("g1-elementwise", 0.04, 0): run("g1-elementwise", 0, loss=2.5, lr=0.04),
            ("g1-elementwise", 0.01, 0): run("g1-elementwise", 0, loss=2.0),
            ("baseline", 0.04, 0): run("baseline", 0, loss=3.0, lr=0.04), ("baseline", 0.01, 0): run("baseline", 0)}
    rates = {"standard": 0.01, "high": 0.04}
    result = evaluate(d, lambda v, rate, s: runs.get((v, rates[rate], s)), [0], [], {})
    assert result["per_seed"][0] == {"value": pytest.approx(0.5 - 1.0),
                                     "measured": {"g1-elementwise": 0.5, "baseline": 1.0}}
