"""The `gated-qwen` command. Each subcommand lives beside the code it drives and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that define `register(subparsers)`: it adds one or more subcommands whose `func(args) -> int` runs them.
COMMAND_MODULES = [
    "gated_qwen.analysis.cli",
    "gated_qwen.conversion.cli",
    "gated_qwen.hub",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gated-qwen",
        description="Gated attention (Qiu et al., 2025) for Hugging Face Transformers: convert, analyse, reproduce.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
