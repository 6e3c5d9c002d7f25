"""The miniature's plans and runs: which runs a plan trains (each once), the demo's and the confirmatory run's
seeds, short stages before the main one, and the sink profile and loss spikes against values worked out by hand."""

import dataclasses

import pytest
import torch

from gated_qwen.analysis.miniature.presets import planned_runs
from gated_qwen.analysis.miniature.runs import loss_spikes, sink_profile


def test_sink_profile_by_hand():
    per_query = torch.zeros(2, 2, 1, 9)  # 2 documents, 2 layers, 1 head, 9 positions (query 0 left out)
    per_query[:, 0, 0] = torch.tensor([1.0, 0.8, 0.8, 0.0, 0.0, 0.8, 0.8, 0.0, 0.0])
    per_query[:, 1, 0] = 0.2
    triggers = torch.zeros(2, 9, dtype=torch.bool)
    triggers[:, [3, 4, 7, 8]] = True  # the layer-0 head attends to BOS exactly where the query is no trigger
    profile = sink_profile(per_query, triggers)
    assert profile["by_part"] == pytest.approx([0.5, 0.1, 0.5, 0.1])  # positions 1-2, 3-4, 5-6, 7-8
    assert profile["other"] == pytest.approx(0.5) and profile["trigger"] == pytest.approx(0.1)
    assert profile["other_per_layer_head"] == [[pytest.approx(0.8)], [pytest.approx(0.2)]]
    assert profile["trigger_share"] == pytest.approx(0.5)
    assert set(sink_profile(per_query, None)) == {"by_part"}


def test_planned_runs_train_the_high_learning_rate_for_the_chosen_variants():
    from gated_qwen.analysis.miniature.presets import PAIR, PLANS, Family, Plan, customised, training_key
    from gated_qwen.analysis.miniature.runs import unique_runs

    preset = customised(PLANS["smoke"].main, seeds=(4, 5), high_lr_variants=PAIR)
    assert planned_runs(preset, ["baseline", "ns-sigmoid", "g1-elementwise"]) == [
        (v, lr, seed) for seed in (4, 5) for v, lr in (("baseline", 1e-2), ("ns-sigmoid", 1e-2),
                                                      ("g1-elementwise", 1e-2), ("baseline", 4e-2),
                                                      ("g1-elementwise", 4e-2))]
    assert planned_runs(dataclasses.replace(preset, high_lr_variants=()), ["baseline"]) == [
        ("baseline", 1e-2, 4), ("baseline", 1e-2, 5)]
    # a run two families share (same model, variant, rate and seed) is trained once, at its first family
    more_seeds = dataclasses.replace(preset, seeds=(4, 5, 6), tuning_seeds=(0, 1, 2))
    other_model = dataclasses.replace(preset, num_hidden_layers=2)
    plan = Plan((Family("main", preset, ("baseline", "ns-sigmoid")), Family("stability", more_seeds),
                 Family("deep", other_model)))
    runs = unique_runs(plan)
    assert [(p is preset, v, lr, seed) for p, v, lr, seed in runs[:5]] == [
        (True, "baseline", 1e-2, 4), (True, "ns-sigmoid", 1e-2, 4), (True, "baseline", 4e-2, 4),
        (True, "baseline", 1e-2, 5), (True, "ns-sigmoid", 1e-2, 5)]
    keys = [(training_key(p), v, lr, seed) for p, v, lr, seed in runs]
    assert len(keys) == len(set(keys)) == 6 + (12 - 4) + 8  # the stability family adds G1 and seed 6
    assert training_key(more_seeds) == training_key(preset) != training_key(other_model)


def test_the_demo_and_the_confirmatory_run_have_fresh_disjoint_seeds():
    """The demo's and the confirmatory run's seeds: none a seed any of their set-ups was chosen on (0-9), enough for a
    95% interval (and for Holm's correction to keep a unanimous row: 12 seeds at least), the confirmatory run's
    evidence never a seed the demo reports (tests/analysis/test_seed_ledger.py: nor any committed run), table 1 on
    at least 30 seeds, and the stability family's controls at the high rate."""
    from gated_qwen.analysis.miniature.presets import PLANS

    demo, confirm = PLANS["default"], PLANS["confirm"]
    demo_seeds = {seed for f in demo.families for seed in f.preset.seeds}
    assert [f.name for f in demo.families] == ["main"] and len(demo_seeds) >= 12
    for family in (*demo.families, *confirm.families):
        assert len(family.preset.seeds) >= 12 and not set(family.preset.seeds) & set(range(10)), family.name
        assert set(family.preset.tuning_seeds) <= set(range(10)), family.name
        if family in confirm.families:
            assert not set(family.preset.seeds) & demo_seeds, family.name
    families = {f.name: f for f in confirm.families}
    assert len(families["table1-learned"].preset.seeds) >= 30
    assert len(families["table1-learned"].preset.tuning_seeds) >= 6
    assert families["stability"].preset.high_lr_variants == ("baseline", "g1-elementwise", "sdpa-rmsnorm")


def test_loss_spikes():
    assert loss_spikes([5.0, 4.0, 3.0, 2.0], window=1) == {"max_rise": 0.0, "diverged": False}
    assert loss_spikes([5.0, 3.0, 4.5, 2.0], window=1)["max_rise"] == pytest.approx(1.5)
    assert loss_spikes([4.0, 2.0, 4.0, 2.0], window=2)["max_rise"] == pytest.approx(0.0)  # smoothed away
    assert loss_spikes([3.0, float("nan")], window=1)["diverged"] is True


def test_short_stages_train_before_the_main_one():
    """`Preset.short_stages`: steps on shorter documents first, in order (the paper's pretraining before its
    long-context stage; a curriculum of lengths), logged with the rest; the memory estimate counts the largest
    stage's documents."""
    from gated_qwen.analysis.footprint import training_bytes
    from gated_qwen.analysis.miniature.presets import PLANS, customised
    from gated_qwen.analysis.miniature.runs import train_and_measure

    preset = customised(PLANS["smoke"].main, steps=2, short_stages=((8, 3), (12, 1)), extrapolation=(1,))
    result, model = train_and_measure(preset, "g1-elementwise", 1e-2, seed=1)
    assert len(result["train_loss"]) == 6 and model.config.max_position_embeddings == preset.seq_len
    one_stage = customised(preset, short_stages=())
    assert training_bytes(one_stage) == training_bytes(preset)  # 3 x 4 x 8 tokens: fewer than 2 x 4 x 24
    assert training_bytes(customised(preset, short_stages=((8, 10**6), (12, 1)))) - training_bytes(one_stage) == (
        8 * 4 * (8 * 10**6 - 2 * 24))
