"""The set-up searches, on tuning seeds only (2-9; never evidence): the candidates of each new model
family, in the order declared here, with the rule that picks one, both written before any of them ran. Each run's
set-up numbers go to one JSON line (`--out`, appended; runs already there are skipped, so a search resumes), and a
table per family is printed. benchmarks/RESULTS.md reports what each search found.

    nice -n 19 .venv/bin/python benchmarks/reproduce/search.py FAMILY [FAMILY ...] --out runs/search.jsonl --jobs 2
    ... --candidates D1,M1      # only these candidates (their names' first word), e.g. the next one a rule needs
    ... --variants baseline --seeds 2   # a rule's first check alone (a candidate that fails it needs no more runs)
    .venv/bin/python benchmarks/reproduce/search.py --table runs/search.jsonl   # the tables again, no training

Families and their rules:
- table1: the loss ranking's corpus and model. Rule: the first candidate whose baseline's held-out loss lies at
  least 0.1 nats above the corpus's exact entropy floor on every tuning seed (not saturated) with no run diverged.
- deep-sink: the sink in a deeper model (2-4 layers, 4 heads, 64-128 tokens). Rule: the first candidate (cheapest
  first) whose baseline has a head with F-Attn above 0.5 (largest over layers and heads) on every tuning seed.
- mact: the M-Act model (6 layers). Rule: the first candidate whose baseline's largest activation in the non-final
  layers sits at the first token and is at least twice the largest at any other position, on every tuning seed.
- stability: failure rates at the high rate (4e-2) and twice it (one-layer main models, seeds 2-9). Rule for the
  optional second row: 8e-2 if it fails the baseline more often than 4e-2 does (held-out loss above its
  standard-rate loss on the same seed plus 0.1 nats); none otherwise.
- long: a long-context baseline that recalls at its training length (256 tokens). Rule: the first candidate whose
  baseline's recall at the training length is above 0.9 on seed 2, then kept if baseline and G1 both are on seed 3.

The searches that choose a set-up on enough seeds: each candidate's baseline alone, on the six tuning
seeds 2-7; a candidate passes when its baseline passes the family's check on at least 5 of the 6 (`AT_LEAST`), and
the rule picks the first candidate, in the order declared, that passes. Seeds run in order, and a candidate stops
as soon as it is decided (5 passes, or 2 failures); a later candidate runs only while no earlier one has passed.
- deep-sink-6: the sink in a deeper model, judged per head. Check: a head of the baseline (any layer) with F-Attn
  above 0.5. Candidates: K1, the first search's choice (D3: 4 layers of 4 heads of 16, 64 tokens), whose seeds 2 and 3
  passed (0.713, 0.537); K2 the same with QK-norm (the paper's architecture); K3 6 layers; K4 4 layers at 128 tokens.
  None passing: the family is not testable here.
- table1-learned: a corpus table 1's models learn. Check: the baseline's held-out loss within 0.1 nats of the
  corpus's exact entropy floor. Candidates: U1, T1's model on a smaller trigram corpus (16 tokens x 4 successors:
  256 contexts instead of 4096); U2, 32 tokens x 4 successors at 2000 steps. A candidate that passes says only that
  the models learn it: whether table 1's comparisons fit the confirmatory run's budget at its spread needs the five
  variants on the same seeds, a further step. None passing: table 1's rows are not testable here.
- table1-spread: that further step, declared once U1 had passed (on all six seeds): U1's five variants on the same
  six tuning seeds. For each table-1 comparison, the seeds on the paper's side give the seeds the row would need
  (benchmarks/reproduce/power.py's rule: 80% power at Holm's level over 56 rows, chance k/6 to (k+1)/8); table 1 is
  testable in the confirmatory run only if each comparison's count fits its budget (about 2 hours of 2 cores with
  the other families: at ~15 CPU-seconds a model, at most about 40 seeds of five variants beside them).
- deep-sink-1h: the sink in a deeper model with one attention head per layer (Bigram-Backcopy), so that no spare
  head can hold a dormant sink. Check: a head of the baseline (any layer) with F-Attn above 0.5. Candidates,
  cheapest first: H1 2 layers of one head of 64 (the main models' head) at 32 tokens, H2 4 layers at 32, H3 2 layers
  at 64, H4 4 layers at 64. None passing: the family is not testable here.
- recall-1tok: recall for the YaRN rows, by one layer (one head of 64), on KeyValueRecall (each fact one token,
  8 keys x 8 values; chance 1/8), at 128 or 256 tokens, with room for the facts at 4x (R3: 2x). Check: the
  baseline's recall at its training length above 0.9 (64 held-out documents). Candidates, cheapest first: R1 two
  facts a document at 128 tokens, after a first stage at 32 tokens (one fact: found before it has a rival), 2000
  steps each; R2 the same without the first stage, 3000 steps at 128; R3 four facts a document at 128 tokens,
  3000 steps after 3000 at 32; R4 R2 at 6000 steps; R5 R2 with hidden 128 and one head of 128; R6 two facts at
  256 tokens, 2000 steps after 3000 at 32. None passing: the YaRN rows are not testable here.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, as_completed, wait
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path

from gated_qwen.analysis.miniature import corpora as data
from gated_qwen.analysis.miniature import presets, runs

MAIN = presets.MAIN
# The first long-context model (one layer, heads of 128, RoPE base 10k, 3000 steps at 32 tokens then 1000 at 256,
# one fact per 128 tokens), from which the long-context candidates start.
LONG_CONTEXT_MODEL = replace(MAIN, head_dim=128, seq_len=256, steps=1000, short_stages=((32, 3000),),
                             extrapolation=(1, 2, 4), extrapolation_documents=64,
                             language=data.KeyValueRecall(keys=8, values=8, tokens_per_fact=128))
EXTRA = dict(extrapolation=(1,), extrapolation_documents=8)  # set-up numbers only: nothing beyond the training length


def _table1():
    model = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, seq_len=32,
                 steps=1000, **EXTRA)
    variants = ("baseline", "g1-elementwise", "g1-headwise", "g2-value", "g5-dense")
    return [(name, replace(MAIN, **model, **extra), variants, (1e-2,), (2, 3)) for name, extra in (
        ("T1 trigram V64 S4, 2 layers, 32 tokens, 1000 steps", dict(language=data.TrigramLanguage(64, 4))),
        ("T2 trigram V64 S4, QK-norm", dict(language=data.TrigramLanguage(64, 4), use_qk_norm=True)),
        ("T3 trigram V128 S4", dict(language=data.TrigramLanguage(128, 4))),
    )]


def _deep_sink():
    model = dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, **EXTRA)
    return [(f"D{i + 1} {layers} layers, {length} tokens", replace(MAIN, **model, num_hidden_layers=layers,
                                                                   seq_len=length), ("baseline", "g1-elementwise"),
             (1e-2,), (2, 3)) for i, (layers, length) in enumerate(((2, 64), (2, 128), (4, 64), (4, 128)))]


def _mact():
    model = dict(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_qk_norm=True,
                 seq_len=64, steps=1200, **EXTRA)
    return [(name, replace(MAIN, **model, language=language), ("baseline", "g1-elementwise"), (1e-2,), (2, 3))
            for name, language in (("M1 6 layers, repeats 0.2", data.SyntheticLanguage(repeat_rate=0.2)),
                                   ("M2 6 layers, bigram-backcopy", data.BigramBackcopy()),
                                   ("M3 6 layers, trigram V64 S4", data.TrigramLanguage(64, 4)))]


def _stability():
    seeds = tuple(range(2, 10))
    main = replace(MAIN, **EXTRA)
    return [("S1 one layer, clip 1 (the main models)", main, ("baseline", "g1-elementwise"), (1e-2, 4e-2, 8e-2),
             seeds)]


def _long():
    curriculum = ((32, 1500), (64, 1000), (128, 1000))
    base = replace(LONG_CONTEXT_MODEL, extrapolation=(1,), extrapolation_documents=64)
    many = data.KeyValueRecall(keys=32, values=8, tokens_per_fact=32)  # 8 facts at 256 tokens, 32 at 1024
    return [(name, replace(base, **extra), ("baseline",), (1e-2,), (2,)) for name, extra in (
        ("L1 2 layers, curriculum 32-64-128-256, 8 facts", dict(num_hidden_layers=2, short_stages=curriculum,
                                                               language=many)),
        ("L2 2 layers, curriculum, 2 facts (fewer distractors)", dict(num_hidden_layers=2, short_stages=curriculum)),
        ("L3 1 layer, curriculum, 8 facts", dict(short_stages=curriculum, language=many)),
        ("L4 2 layers, 2 heads of 64, curriculum, 8 facts", dict(num_hidden_layers=2, num_attention_heads=2,
                                                                num_key_value_heads=2, head_dim=64,
                                                                short_stages=curriculum, language=many)),
    )]


SIX = tuple(range(2, 8))  # the six tuning seeds: a candidate passes on at least AT_LEAST of them
AT_LEAST = 5


def _deep_sink_six():
    model = dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_hidden_layers=4, seq_len=64, **EXTRA)
    return [(name, replace(MAIN, **{**model, **extra}), ("baseline",), (1e-2,), SIX) for name, extra in (
        ("K1 4 layers, 64 tokens (D3)", {}),
        ("K2 4 layers, 64 tokens, QK-norm", dict(use_qk_norm=True)),
        ("K3 6 layers, 64 tokens", dict(num_hidden_layers=6)),
        ("K4 4 layers, 128 tokens", dict(seq_len=128)),
    )]


def _table1_learned():
    model = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, seq_len=32,
                 steps=1000, **EXTRA)
    return [(name, replace(MAIN, **{**model, **extra}), ("baseline",), (1e-2,), SIX) for name, extra in (
        ("U1 trigram V16 S4, 2 layers, 32 tokens, 1000 steps", dict(language=data.TrigramLanguage(16, 4))),
        ("U2 trigram V32 S4, 2000 steps", dict(language=data.TrigramLanguage(32, 4), steps=2000)),
    )]


def _table1_spread():
    name, preset, _, rates, seeds = _table1_learned()[0]
    return [(name, preset, ("baseline", "g1-elementwise", "g1-headwise", "g2-value", "g5-dense"), rates, seeds)]


def _deep_sink_one_head():
    model = dict(num_attention_heads=1, num_key_value_heads=1, head_dim=64, **EXTRA)  # the main models' one head
    return [(name, replace(MAIN, **model, num_hidden_layers=layers, seq_len=length), ("baseline",), (1e-2,), SIX)
            for name, layers, length in (("H1 2 layers of one head of 64, 32 tokens", 2, 32),
                                         ("H2 4 layers of one head, 32 tokens", 4, 32),
                                         ("H3 2 layers of one head, 64 tokens", 2, 64),
                                         ("H4 4 layers of one head, 64 tokens", 4, 64))]


def _recall_one_layer():
    model = dict(seq_len=128, steps=3000, extrapolation=(1,), extrapolation_documents=64,
                 language=data.KeyValueRecall(keys=8, values=8, tokens_per_fact=64))  # 2 facts at 128 tokens, 8 at 4x
    four = data.KeyValueRecall(keys=8, values=8, tokens_per_fact=32)  # 4 facts at 128 tokens, 8 at 2x
    return [(name, replace(MAIN, **{**model, **extra}), ("baseline",), (1e-2,), SIX) for name, extra in (
        ("R1 1 layer, 128 tokens, 8 keys x 8 values, 2 facts, 2000 steps at 32 tokens then 2000", dict(
            steps=2000, short_stages=((32, 2000),))),
        ("R2 1 layer, 128 tokens, 2 facts, 3000 steps", {}),
        ("R3 1 layer, 128 tokens, 4 facts, 3000 steps at 32 tokens then 3000", dict(short_stages=((32, 3000),),
                                                                                   language=four)),
        ("R4 1 layer, 128 tokens, 2 facts, 6000 steps", dict(steps=6000)),
        ("R5 1 layer of one head of 128 (hidden 128), 128 tokens, 2 facts, 3000 steps", dict(
            hidden_size=128, head_dim=128, intermediate_size=384)),
        ("R6 1 layer, 256 tokens, 2 facts, 3000 steps at 32 tokens then 2000", dict(
            seq_len=256, steps=2000, short_stages=((32, 3000),),
            language=data.KeyValueRecall(keys=8, values=8, tokens_per_fact=128))),
    )]


FAMILIES = {"table1": _table1, "deep-sink": _deep_sink, "mact": _mact, "stability": _stability, "long": _long,
            "deep-sink-6": _deep_sink_six, "table1-learned": _table1_learned, "table1-spread": _table1_spread,
            "deep-sink-1h": _deep_sink_one_head, "recall-1tok": _recall_one_layer}
# The checks of the six-seed searches, on one run's set-up numbers (`summary`).
def _head_sink(row: dict) -> bool:
    return row["f_attn_max_head"] > 0.5


CHECKS = {"deep-sink-6": _head_sink, "deep-sink-1h": _head_sink,
          "table1-learned": lambda row: row["heldout_loss"] - row["floor"] < 0.1,
          "recall-1tok": lambda row: row["recall"] > 0.9}


def decision(rows: list[dict], check, seeds: tuple[int, ...]) -> str | None:
    """"passes" (the check holds on AT_LEAST of `seeds`), "fails" (it can no longer) or None (undecided)."""
    passed = sum(bool(check(row)) for row in rows)
    if passed >= AT_LEAST:
        return "passes"
    return "fails" if len(rows) - passed > len(seeds) - AT_LEAST else None


def decisions(family: str, rows: list[dict]) -> dict[str, str | None]:
    """Each candidate's decision, in the order declared, from the runs in `rows`."""
    return {name: decision([r for r in rows if r["candidate"] == name], CHECKS[family], tuning)
            for name, _, _, _, tuning in FAMILIES[family]()}


def chosen(family: str, rows: list[dict]) -> str | None:
    """The rule's choice: the first candidate that passes once every earlier one has failed; None while none has
    (or while an earlier one is undecided)."""
    for name, found in decisions(family, rows).items():
        if found != "fails":
            return name if found == "passes" else None
    return None


def summary(family: str, candidate: str, result: dict, preset) -> dict:
    """The set-up numbers of one run."""
    layers, s = result["analysis"]["layers"], result["analysis"]["summary"]
    floor = getattr(preset.language, "entropy_floor", None)
    recall = result["extrapolation"][0].get("recall")
    return {
        "family": family, "candidate": candidate, "variant": result["variant"], "lr": result["learning_rate"],
        "seed": result["seed"], "heldout_loss": result["heldout_loss"],
        "floor": floor(preset.seq_len) if floor else None, "final_train_loss": result["final_train_loss"],
        "f_attn": s["first_token_attention"],
        "f_attn_max_head": max(max(e["first_token_attention_per_head"]) for e in layers),
        "m_act": s["max_activation"], "m_act_first_nonfinal": s.get("first_token_max_activation_nonfinal"),
        "m_act_other_nonfinal": s.get("other_max_activation_nonfinal"), "gate_mean": s["gate_mean"],
        "recall": recall and recall["accuracy"], "seconds": result["seconds"]["train"] + result["seconds"]["measure"],
    }


def _run(job: tuple) -> dict:
    family, candidate, preset, variant, lr, seed = job
    started = time.process_time()
    result, _ = runs.train_and_measure(preset, variant, lr, seed, threads=1)
    return {**summary(family, candidate, result, preset), "cpu_seconds": time.process_time() - started}


def _key(row: dict) -> tuple:
    return row["candidate"], row["variant"], row["lr"], row["seed"]


def run(families: list[str], out: Path, jobs: int, candidates: list[str] | None = None,
        variants: list[str] | None = None, seeds: list[int] | None = None) -> None:
    done = {_key(json.loads(line)) for line in out.read_text().splitlines()} if out.exists() else set()
    todo = [(family, name, preset, v, lr, seed) for family in families for name, preset, chosen, rates, tuning
            in FAMILIES[family]() for seed in tuning for lr in rates for v in chosen
            if (name, v, lr, seed) not in done and (candidates is None or name.split()[0] in candidates)
            and (variants is None or v in variants) and (seeds is None or seed in seeds)]
    print(f"{len(todo)} runs ({len(done)} already in {out})", flush=True)
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        for future in as_completed([pool.submit(_run, job) for job in todo]):
            row = future.result()
            with out.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


def run_rule(family: str, out: Path, jobs: int, only: list[str] | None = None) -> None:
    """The six-seed searches: runs each undecided candidate's seeds in order, `jobs` at a time, until the rule has
    chosen a candidate or every candidate has failed. The runs in `out` count and are not repeated, also those that
    another search process appends meanwhile (`only`: the candidates this process runs, by their first word; the
    rule still reads every candidate's runs)."""
    candidates = {name: (preset, tuning) for name, preset, _, _, tuning in FAMILIES[family]()
                  if only is None or name.split()[0] in only}
    running = {}
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        while True:
            rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
            found = decisions(family, rows)
            settled = chosen(family, rows) is not None or all(v == "fails" for v in found.values())
            started = {(name, seed) for name, seed in running.values()}
            ran = {(r["candidate"], r["seed"]) for r in rows}
            for name, (preset, tuning) in candidates.items():
                if settled or found[name] == "passes":
                    break  # no candidate after one that passed runs
                if found[name] == "fails":
                    continue
                for seed in tuning:
                    if len(running) < jobs and (name, seed) not in ran | started:
                        future = pool.submit(_run, (family, name, preset, "baseline", 1e-2, seed))
                        running[future] = (name, seed)
                        started.add((name, seed))
                if found[name] != "fails" and len(running) >= jobs:
                    break  # a later candidate waits while an earlier one may still pass
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                running.pop(future)
                row = future.result()
                with out.open("a") as handle:
                    handle.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    print(f"{family}: {decisions(family, rows)}; chosen: {chosen(family, rows)}", flush=True)


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.3g}" if isinstance(x, float) and math.isfinite(x) else str(x)


def table(out: Path) -> str:
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    keys = ("candidate", "variant", "lr", "seed", "heldout_loss", "floor", "f_attn", "f_attn_max_head", "m_act",
            "m_act_first_nonfinal", "m_act_other_nonfinal", "gate_mean", "recall", "seconds", "cpu_seconds")
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in sorted(rows, key=lambda r: (r["family"], r["candidate"], r["lr"], r["variant"], r["seed"])):
        lines.append("| " + " | ".join(_fmt(row.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help=", ".join(FAMILIES))
    parser.add_argument("--out", type=Path, default=Path("runs/search.jsonl"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--table", type=Path, help="print the tables of this file and exit")
    parser.add_argument("--candidates", type=lambda text: text.split(","), help="only these candidates (e.g. D1,M1)")
    parser.add_argument("--variants", type=lambda text: text.split(","), help="only these variants (a rule's first "
                        "check: the baseline)")
    parser.add_argument("--seeds", type=int, nargs="+", help="only these of the candidates' tuning seeds")
    args = parser.parse_args()
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {list(FAMILIES)}")
    if args.table:
        print(table(args.table))
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for family in [f for f in args.families if f in CHECKS]:
        run_rule(family, args.out, args.jobs, args.candidates)
    if other := [f for f in args.families if f not in CHECKS]:
        run(other, args.out, args.jobs, args.candidates, args.variants, args.seeds)
    print(table(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
