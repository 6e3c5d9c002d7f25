"""Property-based: whatever flags and config.json values a user gives, every command ends with status 0, 1 or 2; on
an error, one line (`gated-qwen: error: ...`, the last on stderr, never "unexpected", never a traceback; before it
only progress bars), and a refusal writes nothing. `reproduce` is refused before any worker starts or not at all:
its training is replaced by `Accepted` (see `test_reproduce_with_any_flags`).

Hypothesis draws the inputs, derandomized and without an example database: the same examples on every run and
machine. `EXPLORE=N` draws N fresh random examples per test instead, to look for the next class of bad input;
`EXPLORE_TRAINING=1` also trains what `reproduce` accepts (2 steps, one process), to find flags refused too late.
Each class found is fixed where it is read and pinned here with an `@example`."""

import contextlib
import functools
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.helpers import PROGRESS_BAR, TINY

pytest.importorskip("hypothesis", reason="needs the dev extra: pip install 'gated-qwen[dev]'")

from hypothesis import HealthCheck, event, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM  # noqa: E402
from gated_qwen.analysis.miniature import corpora, presets, runs  # noqa: E402
from gated_qwen.cli import main  # noqa: E402
from gated_qwen.conversion.formats import TO_FORMATS  # noqa: E402

EXPLORE = os.environ.get("EXPLORE")
TRAIN = bool(os.environ.get("EXPLORE_TRAINING"))
SETTINGS = settings(derandomize=EXPLORE is None, deadline=None, max_examples=int(EXPLORE or 12), database=None,
                    suppress_health_check=[HealthCheck.too_slow])

JSON_VALUES = st.recursive(
    # Sizes stay small enough to build (one absurd one, which no allocation survives), so no example can exhaust memory.
    st.none() | st.booleans() | st.integers(-3, 300) | st.just(10**12) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6)
# Numbers a run is quick with, or absurd ones that no memory holds; those between (a --length of a million) are
# accepted and run for hours, which is what they ask for.
NUMBER_TEXT = st.one_of(st.integers(-2, 100).map(str), st.integers(10**11, 10**13).map(str),
                        st.floats(allow_nan=True).map(str))
FLAG_TEXT = NUMBER_TEXT | st.text(max_size=10)
# Mostly (3 in 4) sizes a tiny model runs with, so that the examples also reach the work past the parser.
SIZE = st.integers(0, 3).flatmap(lambda kind: FLAG_TEXT if kind == 0 else st.integers(-1, 70).map(str))
# What a progress bar draws on stderr (tqdm: "desc:  50%|#####     | 1/2 [00:01<00:01, 1.0run/s]").
class Accepted(BaseException):  # not an Exception: it passes the command's error handling, as Ctrl-C does
    """Raised where `reproduce` would start training: its flags passed every check made before any worker starts."""


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


def check(folders: Path | None, model: str | None, config_edit: tuple[str, object] | None, argv: list[str],
          output: str, files: dict[str, bytes] | None = None) -> int | str:
    """Runs `gated-qwen ARGV` (MODEL and OUT in ARGV replaced by a fresh copy of the model folder with
    `config_edit` applied and `files` (name -> content) written into it, and an output path beside it), asserts the
    properties of the module docstring and returns the exit status (or "accepted")."""
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        if model is not None:
            shutil.copytree(folders / model, scratch / "model")
            for name, content in (files or {}).items():
                (scratch / "model" / name).write_bytes(content)
        if config_edit is not None:
            config = json.loads((scratch / "model" / "config.json").read_text())
            key, value = config_edit
            if value is DELETE:
                config.pop(key, None)
            else:
                config[key] = value
            (scratch / "model" / "config.json").write_text(json.dumps(config))
        before = tree(scratch)
        (scratch / "text.txt").write_text("a b a b " * 40)
        argv = [str(scratch / "model") if a == "MODEL" else str(scratch / output) if a == "OUT" else
                str(scratch / "text.txt") if a == "TEXT" else a for a in argv]
        before = tree(scratch)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as done:  # argparse's refusals
                code = done.code
            except Accepted:
                code = "accepted"
        err = err.getvalue()
        event(f"status {code}")  # what the examples reached: pytest --hypothesis-show-statistics
        assert code in (0, 1, 2, "accepted"), (argv, code, err[-2000:])
        assert "Traceback" not in err and "error: unexpected" not in err, (argv, err[-2000:])
        if code == 0:
            assert (scratch / output).exists(), argv
            return code
        assert tree(scratch) == before, argv  # nothing written on refusal (no staging folder, no parent left)
        if code == "accepted":
            return code
        lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
        assert lines and lines[-1].startswith("gated-qwen: error: "), (argv, err[-2000:])
        assert all(PROGRESS_BAR.match(line) for line in lines[:-1]), (argv, err[-2000:])
        return code


DELETE = object()
GATED_KEYS = sorted(GatedQwenConfig(**TINY).to_dict()) + ["auto_map", "model_type", "unknown_field"]
QWEN3_KEYS = sorted(Qwen3Config(**TINY).to_dict()) + ["model_type"]


def config_edits(keys: list[str]):
    return st.none() | st.tuples(st.sampled_from(keys), st.just(DELETE) | JSON_VALUES)


def flags(drawn: dict) -> list[str]:
    """The command-line flags of `drawn` (flag -> None for a switch, a list for several values, or one value)."""
    argv = []
    for flag, value in drawn.items():
        if value is None:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *value]
        else:
            argv.append(f"{flag}={value}")  # a value that starts with "-" stays a value
    return argv


@SETTINGS
@given(edit=config_edits(QWEN3_KEYS),
       add_gate=st.none() | st.sampled_from(["elementwise", "headwise", "dense", "{}", '{"gate_position": 3}', "["])
       | st.dictionaries(st.sampled_from(["gate_position", "gate_granularity", "gate_activation", "gate_layers"]),
                         JSON_VALUES, max_size=2).map(json.dumps),
       shard=st.none() | FLAG_TEXT, switches=st.sets(st.sampled_from(["--carry-code", "--allow-o-proj-bias"])))
@example(edit=("id2label", []), add_gate=None, shard=None, switches=set())  # found: AttributeError in Transformers
@example(edit=("dtype", []), add_gate=None, shard=None, switches=set())  # found: IndexError in Transformers
def test_convert_with_any_config_and_flags(folders, edit, add_gate, shard, switches):
    argv = ["convert", "MODEL", "OUT", "--from", "qwen3", "--no-verify", *sorted(switches)]
    argv += ["--add-gate", add_gate] if add_gate is not None else []
    argv += [f"--max-shard-size={shard}"] if shard is not None else []
    check(folders, "qwen3", edit, argv, "out")


@SETTINGS
@given(edit=config_edits(GATED_KEYS), to=st.sampled_from(TO_FORMATS), shard=st.none() | FLAG_TEXT,
       switches=st.sets(st.sampled_from(["--carry-code", "--allow-o-proj-bias", "--verify"])))
@example(edit=("return_dict", None), to="release", shard=None, switches=set())  # found: verify read a tuple
@example(edit=("output_hidden_states", [None]), to="release", shard=None, switches=set())  # found: a base field
def test_export_with_any_config_and_flags(folders, edit, to, shard, switches):
    argv = ["convert", "MODEL", "OUT", "--to", to, *sorted(switches)]
    argv += [f"--max-shard-size={shard}"] if shard is not None else []
    check(folders, "gated", edit, argv, "out")


@SETTINGS
@given(edit=config_edits(GATED_KEYS), repo_id=st.none() | st.text(max_size=20),
       name=st.none() | st.text(max_size=20), license=st.none() | st.text(max_size=8),
       base_model=st.none() | st.text(max_size=20))
@example(edit=("auto_map", 10**12), repo_id=None, name=None, license=None, base_model=None)  # found by this test
@example(edit=("dtype", []), repo_id=None, name=None, license=None, base_model=None)  # found by this test
def test_card_with_any_config_and_flags(folders, edit, repo_id, name, license, base_model):
    argv = ["card", "MODEL"]
    for flag, value in (("--repo-id", repo_id), ("--model-name", name), ("--license", license),
                        ("--base-model", base_model)):
        argv += [f"{flag}={value}"] if value is not None else []
    check(folders, "gated", edit, argv, "model/README.md")


@SETTINGS
@given(edit=config_edits(GATED_KEYS), lengths=st.lists(SIZE, min_size=1, max_size=2),
       sequences=st.none() | SIZE, yarn=st.none() | FLAG_TEXT, batch=st.none() | SIZE)
@example(edit=("hidden_size", 48), lengths=["8"], sequences=None, yarn=None, batch=None)  # weights of another shape
@example(edit=None, lengths=["8"], sequences=str(10**11), yarn=None, batch=None)  # found: windows of 24 TB sampled
def test_eval_ppl_with_any_config_and_flags(folders, edit, lengths, sequences, yarn, batch):
    argv = ["eval-ppl", "MODEL", "--out", "OUT", "--lengths", *lengths]
    for flag, value in (("--sequences", sequences), ("--yarn", yarn), ("--batch-size", batch)):
        argv += [f"{flag}={value}"] if value is not None else []
    check(folders, "gated", edit, argv, "rows.json")


QUANT = st.lists(st.sampled_from(["w8a8-tensor", "w8a8-token", "w4a8", "w4a4", "all", "w2", ""]), min_size=1,
                 max_size=3).map(",".join)


@SETTINGS
@given(edit=config_edits(GATED_KEYS), length=SIZE, map_tokens=st.none() | SIZE,
       map_layers=st.none() | st.lists(st.integers(-3, 5).map(str), min_size=1, max_size=2),
       quant=st.none() | QUANT, sequences=st.none() | SIZE)
@example(edit=("return_dict", False), length="8", map_tokens=None, map_layers=None, quant="w4a4", sequences=None)
def test_analyze_with_any_config_and_flags(folders, edit, length, map_tokens, map_layers, quant, sequences):
    argv = ["analyze", "MODEL", "--out", "OUT", f"--length={length}"]
    argv += [f"--sequences={sequences}"] if sequences is not None else []
    argv += [f"--map-tokens={map_tokens}"] if map_tokens is not None else []
    argv += ["--map-layers", *map_layers] if map_layers is not None else []
    argv += [f"--quant={quant}"] if quant is not None else []
    check(folders, "gated", edit, argv, "analysis")


REPRODUCE_FLAGS = st.fixed_dictionaries({}, optional={
    "--preset": st.sampled_from([*presets.PLANS, "huge"]) | st.text(max_size=8),
    "--variants": st.lists(st.sampled_from([*presets.VARIANTS, "g9", ""]), min_size=1, max_size=3).map(",".join)
    | st.text(max_size=12),
    "--steps": SIZE, "--hidden-size": SIZE, "--layers": SIZE, "--seq-len": SIZE, "--batch-size": SIZE,
    "--learning-rates": st.lists(FLAG_TEXT, min_size=1, max_size=3),
    "--seeds": st.lists(st.integers(-1, 2**32).map(str) | FLAG_TEXT, min_size=1, max_size=3),
    "--corpus": st.sampled_from([*corpora.CORPORA, "wiki"]) | st.text(max_size=8), "--jobs": SIZE,
    "--families": st.sampled_from(["main", "main,long", "long", "main,x", ""]) | st.text(max_size=8),
    **dict.fromkeys(["--qk-norm", "--no-clip", "--bf16"], st.none()),
})


# With EXPLORE_TRAINING: flags that pass the parser, so that most examples train (what a late refusal hides in), on
# the smoke preset (the others' evaluation alone takes minutes).
SMALL = st.integers(1, 40).map(str)
VALID_REPRODUCE_FLAGS = st.fixed_dictionaries({}, optional={
    "--variants": st.lists(st.sampled_from(list(presets.VARIANTS)), min_size=1, max_size=3).map(",".join),
    "--hidden-size": SMALL, "--layers": st.integers(1, 3).map(str), "--seq-len": st.integers(2, 40).map(str),
    "--batch-size": SMALL, "--corpus": st.sampled_from(list(corpora.CORPORA)),
    "--learning-rates": st.lists(st.floats(1e-30, 1e30).map(str), min_size=2, max_size=2),
    "--seeds": st.lists(st.integers(0, 2**32 - 1).map(str), min_size=1, max_size=2),
    **dict.fromkeys(["--qk-norm", "--no-clip", "--bf16"], st.none()),
})


@SETTINGS
@given(drawn=VALID_REPRODUCE_FLAGS if TRAIN else REPRODUCE_FLAGS)
def test_reproduce_with_any_flags(drawn):
    """Refused in one line, writing nothing, before any worker starts, or accepted; with `EXPLORE_TRAINING=1`, what
    is accepted is also trained (2 steps) and must succeed: a refusal then comes too late."""
    argv = ["reproduce", "--out", "OUT", *flags(drawn)]
    if TRAIN:
        argv += ["--preset", "smoke", "--steps", "2", "--jobs", "1", "--families", "main"]

    def accepted(*args, **kwargs):
        raise Accepted

    with mock.patch.object(runs, "run_all", accepted):
        early = check(None, None, None, argv, "out")
    if TRAIN and early == "accepted":
        assert check(None, None, None, argv, "out") == 0, argv


# ------------------------------------------------------------------------------------------- malformed input files
def nested_json(depth: int) -> bytes:
    return ("{\"a\": " + "[" * depth + "]" * depth + "}").encode()


JSON_TEXT = (JSON_VALUES.map(lambda value: json.dumps(value).encode()) | st.integers(0, 20_000).map(nested_json)
             | st.binary(max_size=40))
WORDLEVEL = {"version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": {"type": "Whitespace"},
             "post_processor": None, "decoder": None,
             "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1, "b": 2}, "unk_token": "[UNK]"}}


def edited_json(base: dict, paths: list[tuple[str, ...]]):
    """`base` with the value at one of `paths` (keys into nested objects) replaced by any JSON value, or removed."""
    def edit(choice):
        path, value = choice
        data = json.loads(json.dumps(base))
        inner = data
        for key in path[:-1]:
            inner = inner[key]
        if value is DELETE:
            inner.pop(path[-1], None)
        else:
            inner[path[-1]] = value
        return json.dumps(data).encode()
    return st.tuples(st.sampled_from(paths), st.just(DELETE) | JSON_VALUES).map(edit)


TOKENIZERS = st.fixed_dictionaries({}, optional={
    "tokenizer.json": JSON_TEXT | edited_json(WORDLEVEL, [("model",), ("model", "type"), ("model", "vocab"),
                                                          ("model", "unk_token"), ("pre_tokenizer",), ("version",)]),
    "tokenizer_config.json": st.one_of(JSON_TEXT, edited_json({"tokenizer_class": "PreTrainedTokenizerFast"},
                                                              [("tokenizer_class",)])),
})


@functools.cache
def weights(folders: Path) -> bytes:
    return (folders / "gated" / "model.safetensors").read_bytes()


def damaged_safetensors(folders: Path, how: tuple) -> bytes:
    """The gated model's model.safetensors damaged `how`: ("cut", fraction) truncated, ("header", key, field, value)
    its header's entry for one tensor (dtype, shape or offsets) replaced, ("bytes", position, byte) one byte set."""
    import struct

    data = weights(folders)
    if how[0] == "cut":
        return data[: int(len(data) * how[1])]
    if how[0] == "bytes":
        position = how[1] % len(data)
        return data[:position] + bytes([how[2]]) + data[position + 1:]
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    names = sorted(name for name in header if name != "__metadata__")
    header[names[how[1] % len(names)]][how[2]] = how[3]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + length:]


DAMAGE = st.one_of(
    st.tuples(st.just("cut"), st.floats(0, 0.999)),
    st.tuples(st.just("bytes"), st.integers(0, 2**20), st.integers(0, 255)),
    st.tuples(st.just("header"), st.integers(0, 30), st.sampled_from(["dtype", "shape", "data_offsets"]),
              st.sampled_from(["F16", "BF16", "I8", "F8_E4M3", "X9"]) | JSON_VALUES
              | st.lists(st.integers(-2, 10**7), max_size=3)))
READERS = {"analyze": ["analyze", "MODEL", "--length", "8", "--out", "OUT"], "eval-ppl": ["eval-ppl", "MODEL",
           "--lengths", "8", "--sequences", "1", "--out", "OUT"], "card": ["card", "MODEL"],
           "convert": ["convert", "MODEL", "OUT", "--to", "release", "--no-verify"]}
OUTPUT = {"analyze": "analysis", "eval-ppl": "rows.json", "card": "model/README.md", "convert": "out"}


@SETTINGS
@given(text=JSON_TEXT, command=st.sampled_from(sorted(READERS)))
@example(text=nested_json(100_000), command="analyze")  # found: RecursionError in json
@example(text=nested_json(100_000), command="card")
@example(text=nested_json(100_000), command="convert")
def test_any_config_json_text(folders, text, command):
    check(folders, "gated", None, READERS[command], OUTPUT[command], {"config.json": text})


@SETTINGS
@given(files=TOKENIZERS, command=st.sampled_from(["analyze", "eval-ppl"]))
@example(files={"tokenizer.json": b"[1, 2]"}, command="eval-ppl")  # found: TypeError in Transformers
@example(files={"tokenizer.json": json.dumps({**WORDLEVEL, "model": {**WORDLEVEL["model"], "unk_token": 3}}).encode(),
                "tokenizer_config.json": b'{"tokenizer_class": 3}'}, command="eval-ppl")  # found: tokenizers' Exception
def test_any_tokenizer_files(folders, files, command):
    argv = [*READERS[command][:2], "--text", "TEXT", *READERS[command][2:]]
    check(folders, "gated", None, argv, OUTPUT[command], {"tokenizer.json": json.dumps(WORDLEVEL).encode(), **files})


@SETTINGS
@given(how=DAMAGE, command=st.sampled_from(sorted(READERS)))
@example(how=("cut", 0.5), command="eval-ppl")  # found: SafetensorError from Transformers
@example(how=("header", 0, "dtype", "F16"), command="analyze")  # found: the same, a header that lies
@example(how=("header", 0, "data_offsets", [0, 10**7]), command="eval-ppl")
def test_any_damaged_safetensors(folders, how, command):
    check(folders, "gated", None, READERS[command], OUTPUT[command],
          {"model.safetensors": damaged_safetensors(folders, how)})
