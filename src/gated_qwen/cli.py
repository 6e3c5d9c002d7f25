"""The `gated-qwen` command. Each subcommand lives beside the code it drives and registers itself here.

The package's import (torch, Transformers, the model) comes first, as for any user of the package; what a subcommand
alone needs it imports when it runs. Every subcommand's errors end here, in one format:
`gated-qwen: error: <one line>`, with exit status 2 (refused: a bad input, flag or destination; nothing was written)
or 1 (a conversion's verification failed; nothing was written). Set `GATED_QWEN_TRACEBACK=1` to see the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from .analysis import cli as analysis
from .conversion import cli as conversion
from .import_noise import quiet_import_noise
from .integrations import model_card

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
    # Each module's `register(subparsers)` adds its subcommands, whose `func(args) -> int` runs them.
    for module in (analysis, conversion, model_card):
        module.register(subparsers)
    return parser


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return f"{error.strerror}{where}"
    return " ".join(str(error).split()) or type(error).__name__


class _Stdout:
    """The command's stdout, whose failure (a closed pipe, a full device) is remembered, not raised: what a command
    prints is a summary of outputs it has written already, so the exit status stays the outputs' (see `main`)."""

    def __init__(self, stream):
        self.stream, self.failed = stream, None

    def write(self, text: str) -> int:
        self._try(self.stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._try(self.stream.flush)

    def _try(self, method, *args) -> None:
        if self.failed is not None:
            return
        try:
            method(*args)
        except OSError as error:
            self.failed = error
            try:  # what is still buffered goes nowhere, so that the interpreter's flush at exit fails on nothing
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.stream.fileno())
                os.close(devnull)
            except (OSError, ValueError, AttributeError):
                pass

    def __getattr__(self, name):
        return getattr(self.stream, name)


def main(argv: list[str] | None = None) -> int:
    """Runs a command; its exit status tells the truth about its outputs: 0 when they were written, even when
    printing its summary then failed (stdout a closed pipe or a full device: said on stderr in one line)."""
    args = build_parser().parse_args(argv)
    quiet_import_noise()
    for stream in (sys.stdout, sys.stderr):  # a path whose name is not UTF-8 is printed with its odd bytes as
        try:  # \udcXX (Python's way for stderr), never an encoding error after the outputs were written
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):
            pass
    if sys.stdout is None:  # no stdout at all (`>&-`): print writes nothing, and nothing fails
        return _run(args)
    stdout = sys.stdout = _Stdout(sys.stdout)
    try:
        status = _run(args)
    finally:
        stdout.flush()
        sys.stdout = stdout.stream
    if stdout.failed is not None and status == 0:
        print(f"gated-qwen: could not write to stdout ({_one_line(stdout.failed)}); the command's outputs were "
              "written.", file=sys.stderr)
    return status


def _run(args) -> int:
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("gated-qwen: interrupted; nothing was written.", file=sys.stderr)
        return 130
    except Exception as error:
        if os.environ.get("GATED_QWEN_TRACEBACK"):
            raise
        # ModuleNotFoundError: an optional package that is not installed (the message names its extra)
        expected = (isinstance(error, (ValueError, OSError, ModuleNotFoundError))
                    or type(error).__name__.startswith("StrictDataclass"))
        if expected:
            message = _one_line(error)
        elif isinstance(error, MemoryError):  # what the memory checks could not foresee (a library's own copies)
            message = ("out of memory: this needs more memory than this process may use (the machine's, its "
                       "cgroup's, `ulimit -v`); nothing was written; run it where more is free")
        else:
            message = (f"unexpected {type(error).__name__}: {_one_line(error)} (please report this; "
                       "GATED_QWEN_TRACEBACK=1 shows where it happened)")
        print(f"gated-qwen: error: {message}", file=sys.stderr)
        return getattr(error, "exit_code", REFUSED)


if __name__ == "__main__":
    sys.exit(main())
