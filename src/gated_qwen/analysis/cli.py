"""The parser of `gated-qwen analyze`, `gated-qwen eval-ppl` and `gated-qwen reproduce`: flags, their types and
help; `commands` runs them (reading inputs with `inputs`, checking memory with `memory`).

What only a running command needs (plots, statistics) it imports when it runs. Outputs go through
`gated_qwen.files`: `--out` may not be, contain or lie inside MODEL or an input file, appears whole or not at all,
and replaces an existing one only with `--overwrite`. Bad input raises `ValueError` with the reason, which the
`gated-qwen` command prints as one line (exit status 2).
"""

from __future__ import annotations

import argparse
import math

from .commands import run_analyze, run_eval_ppl
from .miniature.command import run_reproduce
from .quantize import SCHEMES


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _length(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (a token is predicted from the ones before it), got {text}")
    return value


def _seed(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"a seed must be in [0, 2**32 - 1], got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _yarn_factor(text: str) -> float:
    value = float(text)
    if not value > 1 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"YaRN factor must be > 1 (the context extension ratio), got {text}")
    return value


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"give a comma-separated list of names, got {text!r}")
    return list(dict.fromkeys(names))


def _quant_schemes(text: str) -> list[str]:
    """`--quant`: comma-separated names of `quantize.SCHEMES`, or `all`."""
    names = list(SCHEMES)
    chosen = names if text == "all" else [name.strip() for name in text.split(",")]
    unknown = [name for name in chosen if name not in names]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown scheme(s) {', '.join(map(repr, unknown))}; give a comma-separated "
                                         f"list of {', '.join(names)}, or all")
    return list(dict.fromkeys(chosen))


def _add_model_inputs(parser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a GatedQwen model folder (save_pretrained)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", metavar="FILE", help="held-out text, tokenized with MODEL's tokenizer")
    source.add_argument("--tokens", metavar="FILE", help="safetensors file with `input_ids` [N, S] (e.g. the "
                        "heldout.safetensors of a reproduce run); default: the built-in synthetic corpus")
    parser.add_argument("--batch-size", type=_positive_int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="auto", help="cpu, cuda, ... (default: cuda when available)")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "analyze", help="F-Attn, M-Act, gate statistics and attention maps of a model (report.md, report.json, PNGs)")
    _add_model_inputs(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (created whole or not at all)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out")
    parser.add_argument("--length", type=_length, default=2048, help="tokens per sequence (default 2048)")
    parser.add_argument("--sequences", type=_positive_int, default=1, help="sequences to average over (default 1)")
    parser.add_argument("--map-tokens", type=_positive_int, default=32, help="attention maps of the first N tokens")
    parser.add_argument("--map-layers", type=int, nargs="+", help="layers to draw (default: first, middle, last)")
    parser.add_argument("--quant", type=_quant_schemes, metavar="SCHEMES",
                        help="also the held-out perplexity under fake quantization of every decoder linear layer, in "
                        "float and under each of these comma-separated schemes: w8a8-tensor, w8a8-token, w4a8, w4a4, "
                        "or all (docs/analysis.md)")
    parser.set_defaults(func=run_analyze)

    parser = subparsers.add_parser("eval-ppl", help="perplexity against context length, with and without YaRN")
    _add_model_inputs(parser)
    parser.add_argument("--lengths", type=_length, nargs="+", required=True, help="context lengths")
    parser.add_argument("--yarn", type=_yarn_factor, metavar="FACTOR",
                        help="also evaluate with YaRN extending the trained context by FACTOR")
    parser.add_argument("--sequences", type=_positive_int, default=8, help="windows per length (default 8)")
    parser.add_argument("--out", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.set_defaults(func=run_eval_ppl)

    parser = subparsers.add_parser(
        "reproduce", help="train tiny baseline/gated models on built-in data, analyse them, write report.md (the demo)")
    parser.add_argument("--preset", default="default",
                        help="smoke: seconds; default: the demo, the one-layer models on 12 seeds; confirm: every "
                        "family on fresh seeds the demo never reports (make confirm); large: a GPU "
                        "(docs/analysis.md)")
    parser.add_argument("--variants", help="comma-separated subset of the variants (default: all; the report lists "
                                           "them, e.g. baseline,g1-elementwise)")
    parser.add_argument("--steps", type=_positive_int, help="training steps per run")
    parser.add_argument("--hidden-size", type=_positive_int, help="model width (heads keep their number)")
    parser.add_argument("--layers", type=_positive_int, help="decoder layers")
    parser.add_argument("--seq-len", type=_length, help="training context length")
    parser.add_argument("--batch-size", type=_positive_int, help="sequences per step")
    parser.add_argument("--learning-rates", type=_positive_float, nargs=2, metavar=("STANDARD", "HIGH"))
    parser.add_argument("--seeds", "--seed", type=_seed, nargs="+", metavar="SEED",
                        help="train every model once per seed (default: the preset's; seeds a set-up was chosen on "
                        "are never evidence)")
    parser.add_argument("--corpus",
                        help="bigram-backcopy (default): sinks throughout the sequence; repeats: spans copied from "
                        "far back (the corpus of earlier demos); recall: key -> value recall; trigram: a second-order "
                        "chain with a known entropy (table 1's models)")
    parser.add_argument("--qk-norm", action="store_true", default=None,
                        help="RMSNorm on queries and keys, as in Qwen3 and the paper (off in the demo: see README)")
    parser.add_argument("--no-clip", action="store_true", help="no gradient clipping (default: clip at norm 1)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument("--families", type=_names, metavar="NAMES",
                        help="comma-separated families of the preset to train, main among them (default: all of "
                        "them; confirm: main, qk-norm, deep, mact, table1, stability; the options above change only "
                        "the main models)")
    parser.add_argument("--jobs", type=_positive_int, help="runs trained at once (default: one per CPU core on CPU)")
    parser.add_argument("--out", default="runs/reproduce", metavar="DIR", help="output folder (default runs/reproduce)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out")
    parser.set_defaults(func=run_reproduce)
