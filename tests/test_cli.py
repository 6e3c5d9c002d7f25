"""The `gated-qwen` command itself: `--help` of the command and of every subcommand loads no model code (checked in a
fresh interpreter), and every subcommand's failures come out in one format, one line, with the documented exit
status (0 done, 1 verification failed, 2 refused), never as a traceback."""

import json
import subprocess
import sys

import pytest

import gated_qwen.cli
from gated_qwen.cli import build_parser, main

HEAVY = ("torch", "transformers", "triton", "peft")
SUBCOMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)

HELP_IN_A_FRESH_PROCESS = """
import contextlib, io, json, sys
from gated_qwen.cli import main

out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main(sys.argv[1:])
    except SystemExit as done:
        code = done.code
print(json.dumps({"code": code, "help": out.getvalue(),
                  "loaded": sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers", "triton", "peft"})}))
"""


def test_every_subcommand_is_tested_here():
    assert SUBCOMMANDS == ["analyze", "card", "convert", "eval-ppl", "reproduce"]


@pytest.mark.parametrize("args", [["--help"], *([name, "--help"] for name in SUBCOMMANDS)], ids=" ".join)
def test_help_loads_no_model_code(args):
    result = subprocess.run([sys.executable, "-c", HELP_IN_A_FRESH_PROCESS, *args], capture_output=True, text=True,
                            timeout=120, check=True)
    answer = json.loads(result.stdout.splitlines()[-1])
    assert answer["code"] == 0 and "usage: gated-qwen" in answer["help"]
    assert answer["loaded"] == [], f"`gated-qwen {' '.join(args)}` imported {answer['loaded']}"


@pytest.mark.parametrize("args, message", [
    (["convert", "a", "b", "--from", "qwen9"], "argument --from: invalid choice: 'qwen9'"),
    (["analyze"], "the following arguments are required: MODEL, --out"),
    (["eval-ppl", "m", "--lengths", "0"], "argument --lengths: must be a positive integer, got 0"),
    (["nope"], "argument COMMAND: invalid choice: 'nope'"),
])
def test_bad_flags_get_the_same_one_line_format(capsys, args, message):
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"gated-qwen: error: {message}"), err


@pytest.mark.parametrize("args, message", [
    (["convert", "missing-src", "dst", "--from", "qwen3"], "SRC 'missing-src' is not a folder"),
    (["convert", "missing-src", "dst"], "give exactly one of --from FORMAT"),
    (["convert", "dst", "--from", "qwen3"], "give SRC and DST"),
    (["card", "missing"], "MODEL_DIR 'missing' has no config.json"),
    (["analyze", "missing", "--out", "out"], "MODEL 'missing' is not a model folder"),
    (["eval-ppl", "missing", "--lengths", "8"], "MODEL 'missing' is not a model folder"),
    (["reproduce", "--preset", "huge"], "--preset 'huge' is not a preset; choose one of"),
    (["reproduce", "--corpus", "wiki"], "--corpus 'wiki' is not a corpus; choose one of bigram-backcopy, repeats"),
])
def test_every_subcommand_refuses_in_one_line_with_status_2(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"gated-qwen: error: {message}"), err
    assert list(tmp_path.iterdir()) == []


def test_an_unexpected_failure_is_one_line_too_and_the_traceback_is_one_variable_away(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("something\nunforeseen")

    monkeypatch.setattr(gated_qwen.cli, "build_parser", lambda: _parser_running(broken))
    assert main(["card", "x"]) == 2
    err = capsys.readouterr().err
    assert err == ("gated-qwen: error: unexpected RuntimeError: something unforeseen (please report this; "
                   "GATED_QWEN_TRACEBACK=1 shows where it happened)\n")
    monkeypatch.setenv("GATED_QWEN_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="unforeseen"):
        main(["card", "x"])


def _parser_running(func):
    parser = build_parser()
    parser.set_defaults(func=func)
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            sub.set_defaults(func=func)
    return parser
