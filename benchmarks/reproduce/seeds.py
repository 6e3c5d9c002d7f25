"""The seed ledger: every seed a committed report, search or tuning run has trained on, derived from the committed
reports beside this file (each report's `meta.seeds`, every family's `tuning_seeds` in its `plan`), the presets'
tuning seeds, search.py's candidates' seeds and the earlier set-up experiments (seeds 0-5, `RECORDED`).
A confirmatory run's evidence must lie outside it: `make confirm` calls `--check` first.

    .venv/bin/python benchmarks/reproduce/seeds.py --write   # derive the ledger again into seeds.json
    .venv/bin/python benchmarks/reproduce/seeds.py --check   # exit 2 with one line if the confirm plan reuses a seed
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LEDGER = HERE / "seeds.json"
# Seeds known only from the record: the set-up experiments that chose the main, M-Act and long-context set-ups
# (`git show 9dc75e1:benchmarks/RESULTS.md`, "tuning seeds 0-5").
RECORDED = {"set-up experiments (git show 9dc75e1:benchmarks/RESULTS.md)": list(range(0, 6))}


def derive() -> dict:
    """{"sources": {where: [seeds]}, "seeds": every seed, sorted}: see the module docstring."""
    sys.path.insert(0, str(HERE))
    import search

    from gated_qwen.analysis.miniature.presets import PLANS

    sources: dict[str, set[int]] = {k: set(v) for k, v in RECORDED.items()}
    for path in sorted(HERE.glob("*.json")):
        if path == LEDGER:
            continue
        report = json.loads(path.read_text())
        for family, seeds in report["meta"]["seeds"].items():
            sources.setdefault(f"{path.name}: {family}", set()).update(seeds)
        for family, preset in report["plan"]["families"].items():
            sources.setdefault(f"{path.name}: {family} tuning", set()).update(preset["tuning_seeds"])
    for name, plan in PLANS.items():
        for family in plan.families:
            sources.setdefault(f"presets {name}: {family.name} tuning", set()).update(family.preset.tuning_seeds)
    for family, candidates in search.FAMILIES.items():
        for candidate in candidates():
            sources.setdefault(f"search.py {family}", set()).update(candidate[4])
    sources = {k: sorted(v) for k, v in sources.items() if v}
    return {"sources": sources, "seeds": sorted(set().union(*sources.values()))}


def reused(plan, ledger: dict) -> dict[str, list[int]]:
    """Each family of `plan` (a `presets.Plan`) whose evidence seeds lie in `ledger`, with those seeds."""
    used = set(ledger["seeds"])
    found = {f.name: sorted(used.intersection(f.preset.seeds)) for f in plan.families}
    return {name: seeds for name, seeds in found.items() if seeds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true", help="derive the ledger into seeds.json")
    group.add_argument("--check", metavar="PRESET", nargs="?", const="confirm",
                       help="refuse (exit 2) a preset whose evidence seeds are in the ledger (default: confirm)")
    args = parser.parse_args(argv)
    if args.write:
        LEDGER.write_text(json.dumps(derive(), indent=1) + "\n")
        return 0
    from gated_qwen.analysis.miniature.presets import PLANS
    from gated_qwen.analysis.miniature.verdicts import seed_list

    found = reused(PLANS[args.check], json.loads(LEDGER.read_text()))
    if found:
        listed = "; ".join(f"{name}: {seed_list(seeds)}" for name, seeds in found.items())
        print(f"--preset {args.check} trains seeds an earlier run used ({listed}; benchmarks/reproduce/seeds.json); "
              "choose seeds outside the ledger.", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
