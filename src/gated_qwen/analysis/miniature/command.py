"""What `gated-qwen reproduce` does once its flags are parsed (`analysis.cli`): the plan the flags ask for, every
check before training (seeds, corpus lengths, memory, configs), the runs, the held-out documents and the report,
written through `gated_qwen.files` (whole or not at all; an existing output replaced only with `--overwrite`).

The report's `meta` says which rows judged it: the commit that last changed `directions.py` as run
(`directions_commit`), whether the file is unchanged from that commit (`directions_file_clean`) and whether the
whole working tree was clean (`tree_clean`), from git where the package runs from a checkout (None elsewhere).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ...files import check_output, output_folder
from ..footprint import check_training_fits
from . import runs
from .corpora import CORPORA, HELDOUT_SEED
from .presets import PLANS, VARIANTS, customised, extrapolation_lengths, model_config, plan_dict, training_key
from .report import write_reproduce
from .runs import held_out, unique_runs


def run_reproduce(args) -> int:
    plan = reproduce_plan(args)
    out = dict(overwrite=args.overwrite, create_parents=True)
    check_output(args.out, **out)
    jobs = check_reproduce(plan, args)
    hardware = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                else f"{os.cpu_count()} CPU cores ({runs.cpu_name()})")
    provenance = directions_provenance()
    with output_folder(args.out, **out) as folder:
        started = time.perf_counter()
        results = runs.family_runs(plan, runs.run_all(plan, folder / "models", jobs))
        _save_held_out(folder, plan)
        meta = {"preset": args.preset, "seeds": {f.name: list(f.preset.seeds) for f in plan.families}, "jobs": jobs,
                "device": hardware, "seconds": time.perf_counter() - started, **provenance,
                "environment": runs.environment(), "families": list(plan_dict(plan)["families"])}
        text = write_reproduce(folder, plan, results, meta)
    print(text.split("## Plots")[0].strip())
    print(f"\nWrote {args.out}/report.md, report.json, directions.json, plots and models in {meta['seconds']:.0f} s.")
    return 0


def _git(folder: Path, *command: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(folder), *command], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def directions_provenance(path: Path | None = None) -> dict:
    """`directions_commit` (the last commit that changed `path`, default this package's directions.py) and its
    committer date, `directions_file_clean` (the file as run is that commit's), `tree_clean` (no change, staged or
    not, and no untracked file in the working tree), `head`, the file's `directions_sha256` and when the run started
    (`started_at`, UTC); the git values are None where the file is not in a git checkout."""
    path = Path(path or Path(__file__).with_name("directions.py")).resolve()
    folder = path.parent
    commit = _git(folder, "log", "-1", "--format=%H", "--", path.name)
    status = _git(folder, "status", "--porcelain", "--", path.name)
    tree = _git(folder, "status", "--porcelain")
    return {"directions_commit": commit or None, "directions_commit_date": commit and _git(
                folder, "log", "-1", "--format=%cI", commit) or None,
            "directions_file_clean": None if status is None or not commit else status == "",
            "tree_clean": None if tree is None else tree == "", "head": _git(folder, "rev-parse", "HEAD"),
            "directions_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def reproduce_plan(args):
    """The `presets.Plan` the flags ask for (refused with the reason when they name no preset, corpus or variant, or
    a width the heads do not divide): the size flags and `--variants` change the main models, `--seeds` every family's
    seeds, `--families` which families run."""
    if args.preset not in PLANS:
        raise ValueError(f"--preset {args.preset!r} is not a preset; choose one of {', '.join(PLANS)}.")
    if args.corpus and args.corpus not in CORPORA:
        raise ValueError(f"--corpus {args.corpus!r} is not a corpus; choose one of {', '.join(CORPORA)}.")
    plan = PLANS[args.preset]
    main = plan.main
    size = {}
    if args.hidden_size:
        if args.hidden_size % main.num_attention_heads:
            raise ValueError(f"--hidden-size {args.hidden_size} must be a multiple of the {main.num_attention_heads} "
                             "attention heads.")
        size = dict(hidden_size=args.hidden_size, head_dim=args.hidden_size // main.num_attention_heads,
                    intermediate_size=3 * args.hidden_size)
    main = customised(
        main, steps=args.steps, num_hidden_layers=args.layers, seq_len=args.seq_len, batch_size=args.batch_size,
        learning_rates=tuple(args.learning_rates) if args.learning_rates else None,
        language=CORPORA[args.corpus]() if args.corpus else None, use_qk_norm=args.qk_norm,
        max_grad_norm=0.0 if args.no_clip else None, bf16=args.bf16 or None, **size)
    variants = list(dict.fromkeys(args.variants.split(","))) if args.variants else list(plan.families[0].variants)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}.")
    families = [dataclasses.replace(plan.families[0], preset=main, variants=tuple(variants)), *plan.families[1:]]
    if args.families is not None:
        names = [f.name for f in plan.families]
        unknown = [name for name in args.families if name not in names]
        if unknown or "main" not in args.families:
            raise ValueError(f"--families: {unknown or 'main is missing'}; choose main and any of {names[1:]} "
                             f"(the preset {args.preset!r} trains these).")
        families = [f for f in families if f.name in args.families]
    if args.seeds:
        seeds = tuple(dict.fromkeys(args.seeds))
        families = [dataclasses.replace(f, preset=dataclasses.replace(f.preset, seeds=seeds)) for f in families]
    return dataclasses.replace(plan, families=tuple(families))


def check_reproduce(plan, args) -> int:
    """Everything a `reproduce` run could fail on after training started, checked before any worker starts: the
    seeds, each family's corpus at every length it is drawn at, the memory of the main models' runs at once and each
    variant's config. Returns the number of runs at once (`--jobs`, or one per CPU core)."""
    for family in plan.families:
        chosen = family.preset
        if HELDOUT_SEED in chosen.seeds:
            raise ValueError(f"--seeds {HELDOUT_SEED} draws the held-out documents; choose another seed.")
        check_length = getattr(chosen.language, "check_length", None)
        lengths = sorted({chosen.seq_len, *(n for n, _ in chosen.short_stages), *extrapolation_lengths(chosen)})
        for length in lengths[::-1] if check_length else []:  # the longest first: its limit holds for all
            try:
                check_length(length)
            except ValueError as error:
                what = "the main models (--seq-len, --corpus)" if family.name == "main" else f"the {family.name} models"
                raise ValueError(f"{what}, trained at {chosen.seq_len} tokens and measured at "
                                 f"{', '.join(map(str, lengths))}: {error}") from None
    count = len(unique_runs(plan))
    jobs = args.jobs or (1 if torch.cuda.is_available() else min(count, os.cpu_count() or 1))
    check_training_fits(plan.main, min(jobs, count), args, "cuda" if torch.cuda.is_available() else "cpu")
    for family in plan.families:  # a size the model refuses fails now, not in a worker
        for variant in family.variants:
            model_config(family.preset, variant)
    return jobs


def _save_held_out(folder: Path, plan) -> None:
    """The held-out documents each family was measured on, as safetensors beside the report: heldout.safetensors
    for the main models, heldout_<family>.safetensors for each other family with its own model or corpus."""
    saved = set()
    for family in plan.families:
        preset = family.preset
        if training_key(preset) in saved:
            continue
        saved.add(training_key(preset))
        name = "heldout.safetensors" if family.name == "main" else f"heldout_{family.name}.safetensors"
        if hasattr(preset.language, "recall_targets"):  # drawn per length
            tensors = {f"input_ids_{n}": held_out(preset, n).contiguous() for n in extrapolation_lengths(preset)}
        else:
            tensors = {"input_ids": held_out(preset).contiguous()}
        save_file(tensors, str(folder / name))
