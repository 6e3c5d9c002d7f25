"""The seed ledger (benchmarks/reproduce/seeds.json) is what the committed reports, the presets and search.py say,
derived again here; it holds every evidence and tuning seed of every committed report; `seeds.py --check` (what
`make confirm` runs first) refuses a plan that trains a seed in it, in one line, and passes one that does not."""

import json
import subprocess
import sys
from pathlib import Path

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
    # the confirmatory report before this ledger: main, qk-norm and mact on 30-41, four-layer 120-131, stability 60-119
    assert {*range(30, 42), *range(60, 132)} <= ledger


def test_reused_seeds_are_named():
    ledger = {"seeds": [3, 30, 31]}
    main = PLANS["default"].families[0]
    plan = Plan((Family("main", main.preset.__class__(seeds=(29, 30, 31))),
                 Family("other", main.preset.__class__(seeds=(500,)))))
    assert seeds.reused(plan, ledger) == {"main": [30, 31]}


def test_check_refuses_in_one_line():
    # the demo's preset trains seeds 10-21, which its committed report used
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reproduce" / "seeds.py"), "--check", "default"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and "main: 10, 11" in done.stderr and "Traceback" not in done.stderr
