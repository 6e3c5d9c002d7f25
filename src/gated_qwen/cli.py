"""The `gated-qwen` command. Each subcommand lives beside the code it drives and registers itself here.

Building the parser imports no model code (no torch, Transformers, Triton or PEFT): the subcommands import what they
need when they run, so `gated-qwen --help` answers at once. Every subcommand's errors end here, in one format:
`gated-qwen: error: <one line>`, with exit status 2 (refused: a bad input, flag or destination; nothing was written)
or 1 (a conversion's verification failed; nothing was written). Set `GATED_QWEN_TRACEBACK=1` to see the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Modules that define `register(subparsers)`: it adds one or more subcommands whose `func(args) -> int` runs them.
COMMAND_MODULES = [
    "gated_qwen.analysis.cli",
    "gated_qwen.conversion.cli",
    "gated_qwen.hub",
]

REFUSED = 2  # a bad input, flag or destination (argparse uses 2 for bad flags too)


class Parser(argparse.ArgumentParser):
    """argparse with the package's one error format (`gated-qwen: error: ...`, exit status 2)."""

    def error(self, message: str):
        self.exit(REFUSED, f"gated-qwen: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="gated-qwen",
        description="Gated attention (Qiu et al., 2025) for Hugging Face Transformers: convert, analyse, reproduce.",
        epilog="Exit status: 0 done, 1 a conversion's verification failed, 2 refused (the one-line message says why). "
               "Nothing is written unless the status is 0.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return f"{error.strerror}{where}"
    return " ".join(str(error).split()) or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("gated-qwen: interrupted; nothing was written.", file=sys.stderr)
        return 130
    except Exception as error:
        if os.environ.get("GATED_QWEN_TRACEBACK"):
            raise
        expected = isinstance(error, (ValueError, OSError)) or type(error).__name__.startswith("StrictDataclass")
        message = _one_line(error) if expected else (
            f"unexpected {type(error).__name__}: {_one_line(error)} (please report this; GATED_QWEN_TRACEBACK=1 "
            "shows where it happened)")
        print(f"gated-qwen: error: {message}", file=sys.stderr)
        return getattr(error, "exit_code", REFUSED)


if __name__ == "__main__":
    sys.exit(main())
