"""Property-based: whatever flags and config.json values a user gives, every command ends with status 0, 1 or 2; on
an error, one line (`gated-qwen: error: ...`, the last on stderr, never "unexpected", never a traceback), and a
refusal writes nothing. Hypothesis draws the inputs (derandomized: the same examples on every run, so CI is
reproducible); a failure it finds is a class of bad input without a clear message."""

import contextlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import TINY
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import Qwen3Config, Qwen3ForCausalLM

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.cli import main

SETTINGS = settings(derandomize=os.environ.get("EXPLORE") is None, deadline=None, max_examples=int(os.environ.get("EXPLORE", 12)), database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

JSON_VALUES = st.recursive(
    # Sizes stay small enough to build (one absurd one, which no allocation survives), so no example can exhaust memory.
    st.none() | st.booleans() | st.integers(-3, 300) | st.just(10**12) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6)
FLAG_TEXT = st.one_of(st.integers(-2, 10**13).map(str), st.floats(allow_nan=True).map(str), st.text(max_size=10))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A stock Qwen3 folder and a GatedQwen folder (the built-in corpus's 64-id vocabulary), made once."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**TINY)).save_pretrained(root / "qwen3")
    GatedQwenForCausalLM(GatedQwenConfig(**{**TINY, "vocab_size": 64})).save_pretrained(root / "gated")
    return root


def tree(root: Path) -> dict[str, bytes | str]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() and not p.is_symlink() else "other"
            for p in sorted(root.rglob("*"))}


def check(folders: Path, model: str, config_edit: tuple[str, object] | None, argv: list[str], output: str) -> None:
    """Runs `gated-qwen ARGV` (MODEL and OUT in ARGV replaced by a fresh copy of the model folder with
    `config_edit` applied, and an output path beside it) and asserts the properties of the module docstring."""
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        shutil.copytree(folders / model, scratch / "model")
        if config_edit is not None:
            config = json.loads((scratch / "model" / "config.json").read_text())
            key, value = config_edit
            if value is DELETE:
                config.pop(key, None)
            else:
                config[key] = value
            (scratch / "model" / "config.json").write_text(json.dumps(config))
        before = tree(scratch)
        argv = [str(scratch / "model") if a == "MODEL" else str(scratch / output) if a == "OUT" else a for a in argv]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as done:  # argparse's refusals
                code = done.code
        err = err.getvalue()
        assert code in (0, 1, 2), (argv, code, err[-2000:])
        assert "Traceback" not in err and "unexpected" not in err, (argv, err[-2000:])
        if code == 0:
            assert (scratch / output).exists() or output == "none", argv
            return
        lines = err.replace("\r", "\n").splitlines()
        assert lines and lines[-1].startswith("gated-qwen: error: "), (argv, err[-2000:])
        assert sum(line.startswith("gated-qwen: error: ") for line in lines) == 1, (argv, err[-2000:])
        assert tree(scratch) == before, argv  # nothing written on refusal


DELETE = object()
GATED_KEYS = sorted(GatedQwenConfig(**TINY).to_dict()) + ["auto_map", "model_type", "unknown_field"]
QWEN3_KEYS = sorted(Qwen3Config(**TINY).to_dict()) + ["model_type"]


def config_edits(keys: list[str]):
    return st.none() | st.tuples(st.sampled_from(keys), st.just(DELETE) | JSON_VALUES)


@SETTINGS
@given(edit=config_edits(QWEN3_KEYS),
       add_gate=st.none() | st.sampled_from(["elementwise", "headwise", "dense", "{}", '{"gate_position": 3}', "["])
       | st.dictionaries(st.sampled_from(["gate_position", "gate_granularity", "gate_activation", "gate_layers"]),
                         JSON_VALUES, max_size=2).map(json.dumps),
       shard=st.none() | FLAG_TEXT)
@example(edit=("id2label", []), add_gate=None, shard=None)  # found by this test: AttributeError in Transformers
@example(edit=("dtype", []), add_gate=None, shard=None)  # found by this test: IndexError in Transformers
def test_convert_with_any_config_and_flags(folders, edit, add_gate, shard):
    argv = ["convert", "MODEL", "OUT", "--from", "qwen3", "--no-verify"]
    argv += ["--add-gate", add_gate] if add_gate is not None else []
    argv += [f"--max-shard-size={shard}"] if shard is not None else []
    check(folders, "qwen3", edit, argv, "out")


@SETTINGS
@given(edit=config_edits(GATED_KEYS), repo_id=st.none() | st.text(max_size=20),
       name=st.none() | st.text(max_size=20), license=st.none() | st.text(max_size=8))
@example(edit=("auto_map", 10**12), repo_id=None, name=None, license=None)  # found by this test
@example(edit=("dtype", []), repo_id=None, name=None, license=None)  # found by this test
def test_card_with_any_config_and_flags(folders, edit, repo_id, name, license):
    argv = ["card", "MODEL"]
    for flag, value in (("--repo-id", repo_id), ("--model-name", name), ("--license", license)):
        argv += [f"{flag}={value}"] if value is not None else []
    check(folders, "gated", edit, argv, "model/README.md")


@SETTINGS
@given(edit=config_edits(GATED_KEYS), lengths=st.lists(FLAG_TEXT, min_size=1, max_size=2),
       sequences=st.none() | FLAG_TEXT, yarn=st.none() | FLAG_TEXT)
@example(edit=("hidden_size", 48), lengths=["8"], sequences=None, yarn=None)  # weights of another shape
def test_eval_ppl_with_any_config_and_flags(folders, edit, lengths, sequences, yarn):
    argv = ["eval-ppl", "MODEL", "--out", "OUT", "--lengths", *lengths]
    argv += [f"--sequences={sequences}"] if sequences is not None else []
    argv += [f"--yarn={yarn}"] if yarn is not None else []
    check(folders, "gated", edit, argv, "rows.json")


@SETTINGS
@given(edit=config_edits(GATED_KEYS), length=FLAG_TEXT, map_tokens=st.none() | FLAG_TEXT,
       map_layers=st.none() | st.lists(st.integers(-3, 5).map(str), min_size=1, max_size=2))
def test_analyze_with_any_config_and_flags(folders, edit, length, map_tokens, map_layers):
    argv = ["analyze", "MODEL", "--out", "OUT", f"--length={length}"]
    argv += [f"--map-tokens={map_tokens}"] if map_tokens is not None else []
    argv += ["--map-layers", *map_layers] if map_layers is not None else []
    check(folders, "gated", edit, argv, "analysis")

