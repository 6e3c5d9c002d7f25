"""Every direction row judged on made-up runs (`miniature.judge`): per-seed numbers, tuning seeds left out, set-up
rows that make a direction "not testable here", the per-head and non-final-layer measures, table 1's losses against
the corpus's floor, failures judged by the exact McNemar test, a family declared untestable, and the corrections
and detectable effects each row carries."""

import json
import math
from pathlib import Path

import pytest

from gated_qwen.analysis.miniature import stats
from gated_qwen.analysis.miniature.directions import DIRECTIONS, METRICS, Direction
from gated_qwen.analysis.miniature.judge import evaluate, judge
from gated_qwen.analysis.miniature.presets import PLANS
from gated_qwen.analysis.quantize import SCHEMES


def run(variant, seed, f_attn=0.5, m_act=100.0, gate=None, below=None, loss=2.0, rise=0.1, lr=0.01, increases=None,
        recall=None, heads=None, first=None, other=None, floor=None):
    """A `train_and_measure` result with what the rows read; `recall`: (without, with YaRN) at 1x, 2x, 4x of 32;
    `heads`: per layer, each head's F-Attn; `first` / `other`: the largest |hidden state| at the first token / at
    any other position in the non-final layers; `floor`: the corpus's entropy."""
    rows = [{"length": 32 * m, "recall": {"accuracy": a}, "recall_yarn": {"accuracy": b}}
            for m, (a, b) in zip((1, 2, 4), recall or [(1.0, 1.0)] * 3)]
    layers = [{"first_token_attention_per_head": h} for h in (heads or [[f_attn]])]
    return {"variant": variant, "seed": seed, "learning_rate": lr, "heldout_loss": loss, "loss_max_rise": rise,
            "entropy_floor": floor,
            "analysis": {"summary": {"first_token_attention": f_attn, "max_activation": m_act, "gate_mean": gate,
                                     "gate_below_0.1": below, "first_token_max_activation_nonfinal": first,
                                     "other_max_activation_nonfinal": other}, "layers": layers},
            "quantization": {s: {"increase": x} for s, x in zip(SCHEMES, increases or (0.01,) * 4)},
            "extrapolation": rows}


def family(runs, seeds, tuning=(), rates=(0.01, 0.04)):
    return {"runs": {(r["variant"], r["learning_rate"], r["seed"]): r for r in runs},
            "learning_rates": {"standard": rates[0], "high": rates[1]}, "seeds": list(seeds),
            "tuning_seeds": list(tuning)}


def row(name):
    return next(d for d in DIRECTIONS if d.name == name)


def verdicts_of(judged):
    return {d["name"]: d["verdict"] for d in judged}


def test_the_rows_are_declared_once_with_known_metrics_families_and_set_ups():
    names = [d.name for d in DIRECTIONS]
    assert len(names) == len(set(names))
    # a family some plan trains or declares untestable, or one an earlier confirmatory report judged
    reports = [json.loads(path.read_text()) for path in
               (Path(__file__).resolve().parents[2] / "benchmarks" / "reproduce").glob("confirm*.json")]
    earlier = {f for report in reports for f in (*report["meta"]["seeds"], *report["plan"]["untestable"])}
    families = {f.name for plan in PLANS.values() for f in plan.families} | {
        name for plan in PLANS.values() for name, _ in plan.untestable} | earlier
    for d in DIRECTIONS:
        assert d.metric in METRICS and d.side in ("above", "below") and d.comparison in ("difference", "ratio")
        assert d.family in families and d.test in ("sign", "mcnemar")
        assert d.test == "sign" or (d.against and isinstance(d.lr, tuple)), d.name  # failures: two models, two rates
        assert all(names.index(r) < names.index(d.name) for r in d.requires), d.name  # set-ups judged first
    # every scheme, for G1 and each control of the main models, and for the M-Act model
    assert {d.name for d in DIRECTIONS if d.name.startswith("quant/")} == {
        f"quant/{s}/{v}" for s in SCHEMES for v in ("g1-elementwise", "g1-headwise", "ns-sigmoid", "input-independent",
                                                    "sdpa-rmsnorm")}
    assert {d.name for d in DIRECTIONS if d.name.startswith("mact/quant/")} == {f"mact/quant/{s}" for s in SCHEMES}
    # every family a row names is trained or declared untestable by the confirmatory run, or an earlier one judged it
    confirm = PLANS["confirm"]
    planned = {f.name for f in confirm.families} | dict(confirm.untestable).keys()
    assert planned <= {d.family for d in DIRECTIONS} <= planned | earlier


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
    assert all_below["sign_test"] == {"above": 0, "below": 6, "p": 2 / 64} and all_below["p"] == 2 / 64
    assert all_below["detectable"]["raw"] == stats.detectable("sign", 6)
    one_above = judged([0.06, 0.12, 0.03, 0.09, 0.15, 0.3])  # the last ratio 0.5: 6 seeds need all six
    assert one_above["verdict"] == "inconclusive" and one_above["interval"]["high"] == pytest.approx(0.5)
    at_edge = judged([0.06, 0.12, 0.03, 0.09, 0.15, 0.2])  # the last ratio exactly a third
    assert at_edge["interval"]["high"] == pytest.approx(1 / 3) and at_edge["verdict"] == "inconclusive"
    assert at_edge["p"] == 2 * 7 / 64  # the tie counts against excluding a third, as in the interval
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


def test_the_deeper_model_is_judged_on_its_largest_head():
    """Two layers of four heads: the baseline's sink sits in one head (0.9) that the mean over heads dilutes to
    0.3; G1's largest head is 0.2, so its ratio to the baseline's largest is 0.22."""
    seeds = list(range(12))
    base_heads = [[0.1, 0.1, 0.1, 0.1], [0.9, 0.1, 0.1, 0.1]]
    g1_heads = [[0.05, 0.2, 0.05, 0.05], [0.1, 0.05, 0.05, 0.05]]
    runs = [run("baseline", s, f_attn=0.2, heads=base_heads) for s in seeds]
    runs += [run("g1-elementwise", s, f_attn=0.07, heads=g1_heads) for s in seeds]
    judged, _ = judge({"deep": family(runs, seeds)})
    by_name = {d["name"]: d for d in judged}
    assert by_name["deep/sink"]["per_seed"][0]["value"] == 0.9 and by_name["deep/sink"]["verdict"] == "yes"
    assert by_name["deep/sink-removal"]["per_seed"][0]["value"] == pytest.approx(0.2 / 0.9)
    assert by_name["deep/sink-removal"]["verdict"] == "yes"
    assert by_name["deep/sink-removal"]["adjusted"] == {"holm": "yes", "fdr": "yes"}  # 2 rows, p = 2 / 4096 each
    # the same model judged on the mean over heads would see no sink (0.2 < 0.3)
    assert METRICS["F-Attn"].value(runs[0]) == 0.2 and METRICS["largest head's F-Attn"].value(runs[0]) == 0.9


def test_the_four_layer_row_is_g1s_own_largest_head_and_says_it_claims_the_paper_s_opposite():
    """G1's largest head holds 0.7 on ten seeds of twelve and 0.2 on two (as on seeds 30-41): the interval of the
    median runs from the 3rd smallest to the 3rd largest, 0.7 to 0.7, above 0.3, so the reverse finding says yes;
    on six seeds each way it cannot. The baseline is not read (the row needs no baseline sink)."""
    seeds = list(range(120, 132))
    heads = lambda top: [[0.1, 0.1, 0.1, 0.1], [top, 0.1, 0.1, 0.1]]  # noqa: E731
    g1 = [run("g1-elementwise", s, f_attn=0.2, heads=heads(0.2 if s in (124, 131) else 0.7)) for s in seeds]
    judged, _ = judge({"four-layer": family(g1, seeds)})
    assert [d["name"] for d in judged] == ["four-layer/g1-sink"]
    g1_sink = judged[0]
    assert [e["value"] for e in g1_sink["per_seed"].values()] == [0.2 if s in (124, 131) else 0.7 for s in seeds]
    assert g1_sink["verdict"] == "yes" and g1_sink["interval"]["low"] == 0.7 and g1_sink["p"] == 2 * 79 / 4096
    assert g1_sink["comparison"].endswith("the claim's side (the paper's opposite): above 0.3")
    half = [run("g1-elementwise", s, heads=heads(0.2 if s % 2 else 0.7)) for s in seeds]
    assert judge({"four-layer": family(half, seeds)})[0][0]["verdict"] == "inconclusive"


def test_the_m_act_model_is_judged_at_the_first_token_of_its_non_final_layers():
    seeds = list(range(10, 22))
    runs = [run("baseline", s, m_act=500.0, first=300.0 + s, other=40.0, heads=[[0.8, 0.1]]) for s in seeds]
    runs += [run("g1-elementwise", s, m_act=600.0, first=(0.4 if s % 6 else 1.2) * (300 + s), other=40.0,
                 heads=[[0.6, 0.1]]) for s in seeds]
    judged, _ = judge({"mact": family(runs, seeds)})
    by_name = {d["name"]: d for d in judged}
    assert by_name["mact/massive"]["per_seed"][10]["value"] == pytest.approx(310 / 40)
    assert by_name["mact/massive"]["verdict"] == "yes"
    m_act = by_name["mact/m-act"]
    # the final layer's output (M-Act, 600 vs 500) is not what is judged: the first token's in earlier layers is
    assert m_act["per_seed"][10]["measured"] == {"g1-elementwise": pytest.approx(0.4 * 310), "baseline": 310.0}
    assert [round(e["value"], 6) for e in m_act["per_seed"].values()] == [0.4 if s % 6 else 1.2 for s in seeds]
    # 10 of 12 at 0.4, 2 (seeds 12 and 18) at 1.2: the interval [x_(3), x_(10)] = [0.4, 0.4] lies below 1 and 0.5
    assert m_act["interval"]["rank"] == 3 and m_act["interval"]["high"] == pytest.approx(0.4)
    assert m_act["verdict"] == by_name["mact/m-act/half"]["verdict"] == "yes"
    assert by_name["mact/sink-removal"]["per_seed"][10]["value"] == pytest.approx(0.6 / 0.8)
    assert by_name["mact/sink-removal"]["verdict"] == "no"


def test_table_1_rows_read_the_loss_and_rest_on_its_floor():
    seeds = list(range(12))
    losses = {"baseline": 3.0, "g1-elementwise": 2.8, "g1-headwise": 2.85, "g2-value": 2.9, "g5-dense": 2.95}
    runs = [run(v, s, loss=x + 0.01 * s, floor=1.5) for v, x in losses.items() for s in seeds]
    judged, not_run = judge({"table1": family(runs, seeds)})
    verdicts = verdicts_of(judged)
    assert verdicts == {"table1/not-saturated": "yes", **{f"table1/{pair}": "yes" for pair in (
        "g1-elementwise-vs-baseline", "g1-elementwise-vs-g1-headwise", "g1-headwise-vs-g2-value",
        "g2-value-vs-baseline", "g1-elementwise-vs-g5-dense")}}
    first = next(d for d in judged if d["name"] == "table1/g1-headwise-vs-g2-value")["per_seed"][3]
    assert first == {"value": pytest.approx(-0.05), "measured": {"g1-headwise": pytest.approx(2.88),
                                                                  "g2-value": pytest.approx(2.93)}}
    # a saturated corpus (loss 0.05 above its floor): the ranking is not testable here
    saturated = [dict(r, entropy_floor=r["heldout_loss"] - 0.05) for r in runs]
    verdicts = verdicts_of(judge({"table1": family(saturated, seeds)})[0])
    assert verdicts["table1/not-saturated"] == "no"
    assert {v for k, v in verdicts.items() if k != "table1/not-saturated"} == {"not testable here"}


def test_failures_are_judged_by_the_exact_mcnemar_test():
    """30 seeds; a run fails when its held-out loss at the high rate exceeds its standard-rate one by over 0.1
    nats. The baseline fails on 7 seeds, G1 on 1 of those and on none other: 6 discordant pairs, all one way."""
    seeds = list(range(30, 60))
    runs = [run(v, s, loss=2.0) for v in ("baseline", "g1-elementwise") for s in seeds]
    runs += [run("baseline", s, loss=2.7 if s < 37 else 2.05, lr=0.04, rise=0.2) for s in seeds]
    runs += [run("g1-elementwise", s, loss=2.5 if s == 30 else 2.05, lr=0.04, rise=0.2) for s in seeds]
    judged, _ = judge({"stability": family(runs, seeds, tuning=range(10))})
    failures = next(d for d in judged if d["name"] == "stability/failures")
    assert failures["mcnemar"] == {"variant_only": 0, "against_only": 6, "pairs": 30, "variant_failures": 1,
                                   "against_failures": 7, "p": pytest.approx(2 / 64), "verdict": "yes"}
    assert failures["verdict"] == "yes" and failures["p"] == pytest.approx(2 / 64) and failures["median"] is None
    assert failures["per_seed"][31] == {"value": -1.0, "measured": {"g1-elementwise": pytest.approx(0.05),
                                                                    "baseline": pytest.approx(0.7)}}
    assert failures["per_seed"][30]["value"] == 0.0 and failures["per_seed"][40]["value"] == 0.0  # both; neither
    assert failures["detectable"]["raw"] == stats.detectable("mcnemar", 30)
    assert failures["detectable"]["holm"] == stats.detectable("mcnemar", 30, stats.ALPHA / 2)  # 2 rows tested


def test_judge_with_set_ups_first_and_untestable_families():
    seeds = list(range(10, 16))
    main = [run("baseline", s, f_attn=0.7, m_act=100.0, loss=1.9, lr=0.01) for s in seeds]
    main += [run("g1-elementwise", s, f_attn=0.05, m_act=300.0, gate=0.27, below=0.73, loss=1.9, lr=0.01)
             for s in seeds]
    long = [run("baseline", s, f_attn=0.2, recall=[(1.0, 0.5), (0.3, 0.4), (0.1, 0.2)]) for s in seeds]
    long += [run("g1-elementwise", s, f_attn=0.1, recall=[(1.0, 0.9), (0.3, 0.6), (0.1, 0.1)]) for s in seeds]
    judged, not_run = judge({"main": family(main, seeds, tuning=(0, 1)), "long": family(long, seeds)})
    verdicts = verdicts_of(judged)
    assert {k: verdicts[k] for k in ("sink", "sink-removal/g1-elementwise", "sparse-gate/mean",
                                     "sparse-gate/near-zero", "m-act/g1-elementwise")} == {
        "sink": "yes", "sink-removal/g1-elementwise": "yes",  # 0.7 > 0.3; 0.05 / 0.7 < 1/3
        "sparse-gate/mean": "yes", "sparse-gate/near-zero": "yes",  # 0.27 < 0.3; 0.73 > 0.5
        "m-act/g1-elementwise": "no"}  # 300 / 100 = 3, above a half
    # six seeds: p = 2 / 64 at best, which no correction over these rows keeps
    assert {d["adjusted"]["holm"] for d in judged} <= {"inconclusive", "not testable here"}
    # the baseline forms no sink on the long-context corpus (0.2): its directions are not testable here
    assert verdicts["long/sink"] == "no"
    assert {verdicts[f"long/{k}"] for k in ("yarn-1x", "yarn-drop", "yarn-2x", "yarn-4x")} == {"not testable here"}
    assert next(d for d in judged if d["name"] == "long/yarn-1x")["not_testable_because"] == ["long/sink"]
    # no high-rate runs, no M-Act model, no controls: not run
    assert "mact/m-act" in not_run and "quant/w4a4/ns-sigmoid" in not_run and "m-act/g1-headwise" in not_run
    assert "m-act/g1-elementwise/high-lr" in not_run and "stability/failures" in not_run
    assert set(verdicts) | set(not_run) == {d.name for d in DIRECTIONS}
    # with a sink, the long-context rows are judged: YaRN at 1x costs the baseline 0.5 and G1 0.1
    long = [dict(r, analysis={**r["analysis"], "summary": {"first_token_attention": 0.5}}) for r in long]
    judged, _ = judge({"long": family(long, seeds)})
    assert verdicts_of(judged) == {"long/sink": "yes", "long/recall/baseline": "yes",
                                   "long/recall/g1-elementwise": "yes", "long/yarn-1x": "yes", "long/yarn-drop": "yes",
                                   "long/yarn-2x": "yes", "long/yarn-4x": "no"}
    drop = next(d for d in judged if d["name"] == "long/yarn-drop")
    assert drop["per_seed"][10] == {"value": pytest.approx(0.1 - 0.5),
                                    "measured": {"g1-elementwise": pytest.approx(0.1), "baseline": pytest.approx(0.5)}}
    # a family the preset declares untestable: its rows say why, with no runs and no test
    judged, not_run = judge({"main": family(main, seeds)}, untestable={"long": "no set-up found"})
    long_rows = [d for d in judged if d["family"] == "long"]
    assert len(long_rows) == 7 and all(d["verdict"] == "not testable here" and d["p"] is None and
                                       d["not_testable_because"] == ["no set-up found"] and
                                       d["adjusted"] == {"holm": "not testable here", "fdr": "not testable here"}
                                       for d in long_rows)


def test_numbers_at_zero_and_diverged_runs():
    """A G1 run whose F-Attn and M-Act collapsed to 0 gives a ratio of 0; a baseline at 0 an infinite one; 0 / 0 no
    number (the seed is left out); a diverged (NaN) loss counts as infinitely bad, so a diverged run fails."""
    seeds = list(range(6))
    main = [run("baseline", s, f_attn=0.0 if s == 5 else 0.5, m_act=0.0 if s < 2 else 100.0) for s in seeds]
    main += [run("g1-elementwise", s, f_attn=0.0, m_act=0.0 if s < 1 else 10.0) for s in seeds]
    judged, _ = judge({"main": family(main, seeds)})
    by_name = {d["name"]: d for d in judged}
    removal = by_name["sink-removal/g1-elementwise"]
    assert math.isnan(removal["per_seed"][5]["value"]) and removal["interval"]["n"] == 5  # 0 / 0 left out
    assert removal["detectable"]["raw"] is None  # 5 seeds detect nothing
    act = by_name["m-act/g1-elementwise"]
    assert math.isnan(act["per_seed"][0]["value"]) and act["per_seed"][1]["value"] == math.inf
    stability = [run(v, s) for v in ("baseline", "g1-elementwise") for s in seeds]
    stability += [run("baseline", s, loss=math.nan, lr=0.04) for s in seeds]
    stability += [run("g1-elementwise", s, loss=2.05, lr=0.04) for s in seeds]
    judged, _ = judge({"stability": family(stability, seeds)})
    failures = next(d for d in judged if d["name"] == "stability/failures")
    assert failures["mcnemar"]["against_failures"] == 6 and failures["verdict"] == "yes"


def test_a_difference_row_reads_the_change_between_two_rates():
    d = Direction("x", "x", "main", "held-out loss", "g1-elementwise", "below", lr=("high", "standard"))
    runs = {("g1-elementwise", 0.04, 0): run("g1-elementwise", 0, loss=2.5, lr=0.04),
            ("g1-elementwise", 0.01, 0): run("g1-elementwise", 0, loss=2.0),
            ("baseline", 0.04, 0): run("baseline", 0, loss=3.0, lr=0.04), ("baseline", 0.01, 0): run("baseline", 0)}
    rates = {"standard": 0.01, "high": 0.04}
    result = evaluate(d, lambda v, rate, s: runs.get((v, rates[rate], s)), [0], [], {})
    assert result["per_seed"][0] == {"value": pytest.approx(0.5 - 1.0),
                                     "measured": {"g1-elementwise": 0.5, "baseline": 1.0}}
