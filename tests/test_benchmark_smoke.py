"""Smoke test of `benchmarks/model_cpu.py --quick`, and of the checks the benchmark relies on: that its equality check
catches a wrong weight mapping, and that its FLOP count gives a gate's extra FLOPs as the paper's formula does."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "model_cpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("model_cpu", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_quick_run_checks_equal_logits_and_reports_every_pair(bench, capsys):
    threads = torch.get_num_threads()
    rows = bench.main(["--quick"])
    assert torch.get_num_threads() == threads  # main() puts the thread count back
    table = capsys.readouterr().out
    assert [r["pair"] for r in rows] == [p.name for p in bench.PAIRS]
    for pair, row in zip(bench.PAIRS, rows):
        assert f"| {pair.name} |" in table
        if pair.map_weights is None:
            assert row["max_diff"] is None
        else:  # the script asserted equal logits before timing; the row carries the measured difference
            assert row["max_diff"] is not None and row["max_diff"] <= bench.EQUALITY_ATOL
        for kind in ("train", "decode"):
            assert row[kind]["a"] > 0 and row[kind]["b"] > 0
            assert row[kind]["ratio"] == pytest.approx(row[kind]["b"] / row[kind]["a"])
    # Qwen3, Qwen3.5, Qwen3-MoE and Qwen3-Next (all full attention) are compared for equality
    assert sum(p.map_weights is not None for p in bench.PAIRS) == 4


def test_equality_check_catches_a_wrong_qwen3_5_mapping(bench):
    """Reading Qwen3.5's q_proj as [all q | all gate] instead of per head [q_h | gate_h] must fail the check."""
    s = bench.parse_args(["--quick"])
    reference, ours = bench.qwen3_5(s), bench.gated()(s)

    def wrong(state, model):
        out = bench.qwen3_5_to_g1(state, model)
        for name, tensor in state.items():
            if name.endswith("q_proj.weight"):
                q, g = tensor.chunk(2, dim=0)
                out[name], out[name.replace("q_proj", "gate.g_proj")] = q.clone(), g.clone()
        return out

    ours.load_state_dict(wrong(reference.state_dict(), ours), strict=True)
    with pytest.raises(AssertionError, match="do not compute the same function"):
        bench.check_same_logits(reference, ours, s.vocab)
    ours.load_state_dict(bench.qwen3_5_to_g1(reference.state_dict(), ours), strict=True)
    bench.check_same_logits(reference, ours, s.vocab)


def test_flops_count_gives_the_g1_gate_its_extra_flops(bench):
    """A G1 elementwise gate adds 2 * hidden * H * D FLOPs per token per layer; headwise 2 * hidden * H."""
    s = bench.parse_args(["--quick"])
    base = bench.flops_per_token(bench.NO_GATE(s), context=10.0)
    per_layer = 2 * s.hidden * s.heads * s.layers
    assert bench.flops_per_token(bench.gated()(s), 10.0) - base == per_layer * s.head_dim
    assert bench.flops_per_token(bench.gated(gate_granularity="headwise")(s), 10.0) - base == per_layer
    assert bench.flops_per_token(bench.qwen3_5(s), 10.0) == bench.flops_per_token(bench.gated()(s), 10.0)
