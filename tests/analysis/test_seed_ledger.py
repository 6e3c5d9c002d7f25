"""The seed ledger (benchmarks/reproduce/seeds.json) is what the committed reports, the presets and search.py say,
derived again here; it holds every evidence and tuning seed of every committed report; `seeds.py --check` (what
`make confirm` runs first) refuses a plan that trains a seed in it, in one line, and passes one that does not."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "reproduce"))
import seeds  # noqa: E402

from gated_qwen.analysis.miniature.presets import PLANS, Family, Plan  # noqa: E402


def test_ledger_is_derived():
    assert json.loads(seeds.LEDGER.read_text()) == seeds.derive()


def test_ledger_holds_every_committed_seed():
    ledger = set(json.loads(seeds.LEDGER.read_text())["seeds"])
    for path in seeds.HERE.glob("*.json"):
        if path != seeds.LEDGER:
            report = json.loads(path.read_text())
            for family, used in report["meta"]["seeds"].items():
                assert set(used) <= ledger, (path.name, family)
                assert set(report["plan"]["families"][family]["tuning_seeds"]) <= ledger, (path.name, family)
    # confirm-30-41.json: main, qk-norm and mact on 30-41, four-layer 120-131, stability 60-119; confirm.json: 1000-1039
    assert {*range(30, 42), *range(60, 132), *range(1000, 1040)} <= ledger


def test_reused_seeds_are_named():
    ledger = {"seeds": [3, 30, 31]}
    main = PLANS["default"].families[0]
    plan = Plan((Family("main", main.preset.__class__(seeds=(29, 30, 31))),
                 Family("other", main.preset.__class__(seeds=(500,)))))
    assert seeds.reused(plan, ledger) == {"main": [30, 31]}


@pytest.mark.parametrize(("preset", "used"), [("default", "main: 10-21;"), ("confirm", "six-layer: 1000-1011;")])
def test_check_refuses_a_preset_whose_report_is_committed_in_one_line(preset, used):
    """demo.json ran the default preset's seeds and confirm.json the confirm preset's, so both are refused: `make
    confirm` (which checks first) refuses until a plan declares seeds outside the ledger."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reproduce" / "seeds.py"), "--check", preset],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and used in done.stderr and "Traceback" not in done.stderr
