"""The `gated-qwen` command itself: `--help` of the command and of every subcommand loads no model code (checked in a
fresh interpreter), and every subcommand's failures come out in one format, one line, with the documented exit
status (0 done, 1 verification failed, 2 refused), never as a traceback."""

import json
import os
import re
import subprocess
import sys

import pytest

import gated_qwen.cli
from gated_qwen.cli import build_parser, main
from tests.helpers import assert_refused, refusal_line

# What only a subcommand that runs needs (plots, statistics, the GGUF and ONNX writers); the package's own import
# (torch, Transformers, the model) is the command's too.
SUBCOMMAND_ONLY = ("matplotlib", "scipy", "gguf", "onnx", "onnxruntime", "onnxscript", "mlx", "mlx_lm")
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
print(json.dumps({"code": code, "help": out.getvalue(), "loaded": sorted({m.split(".")[0] for m in sys.modules})}))
"""
PACKAGE_IMPORT = "import json, sys, gated_qwen; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"


def test_every_subcommand_is_tested_here():
    assert SUBCOMMANDS == ["analyze", "card", "convert", "eval-ppl", "reproduce"]


@pytest.mark.parametrize("args", [["--help"], *([name, "--help"] for name in SUBCOMMANDS)], ids=" ".join)
def test_help_loads_what_the_package_does_and_nothing_a_subcommand_alone_needs(args):
    """The command's one lazy boundary: `--help` (of the command and of each subcommand) imports the package, as any
    user of it does, and none of what only a running subcommand needs."""
    result = subprocess.run([sys.executable, "-c", HELP_IN_A_FRESH_PROCESS, *args], capture_output=True, text=True,
                            timeout=300, check=True)
    answer = json.loads(result.stdout.splitlines()[-1])
    assert answer["code"] == 0 and "usage: gated-qwen" in answer["help"]
    package = json.loads(subprocess.run([sys.executable, "-c", PACKAGE_IMPORT], capture_output=True, text=True,
                                        timeout=300, check=True).stdout.splitlines()[-1])
    assert {"torch", "transformers"} <= set(package)
    extra = sorted(set(answer["loaded"]) - set(package))
    assert not set(extra) & set(SUBCOMMAND_ONLY), f"`gated-qwen {' '.join(args)}` imported {extra}"


@pytest.mark.parametrize("args, message", [
    (["convert", "a", "b", "--from", "qwen9"], "argument --from: invalid choice: 'qwen9'"),
    (["analyze"], "the following arguments are required: MODEL, --out"),
    (["eval-ppl", "m", "--lengths", "1"], "argument --lengths: must be at least 2 (a token is predicted from the ones"),
    (["nope"], "argument COMMAND: invalid choice: 'nope'"),
])
def test_bad_flags_get_the_same_one_line_format(capsys, args, message):
    with pytest.raises(SystemExit) as done:  # argparse's refusal
        main(args)
    assert refusal_line(done.value.code, capsys.readouterr().err, message).startswith(f"gated-qwen: error: {message}")


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
    assert assert_refused(capsys, args, message).startswith(f"gated-qwen: error: {message}")
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


def test_running_out_of_memory_midway_is_one_line_and_leaves_nothing(model64, tmp_path, monkeypatch, capsys):
    """A MemoryError the memory check did not foresee (a library's own copies), raised after a shard was written:
    one line saying so, not a bug report, and no DST."""
    import gated_qwen.conversion as conversion

    def half_written(plan, folder, *args, **kwargs):
        (folder / "model-00001-of-00002.safetensors").write_bytes(b"partial")
        raise MemoryError()

    monkeypatch.setattr(conversion, "write_weights", half_written)
    assert_refused(capsys, ["convert", str(model64), str(tmp_path / "out"), "--to", "qwen3_5"],
                   "out of memory: this needs more memory than this process may use", tmp_path / "out", bars=True)


def _parser_running(func):
    parser = build_parser()
    parser.set_defaults(func=func)
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            sub.set_defaults(func=func)
    return parser


# ------------------------------------------------------------------------------ every bad input: one line, status 2
@pytest.fixture
def model64(tmp_path):
    """A tiny GatedQwen folder whose vocabulary is the built-in corpus's (64 ids)."""
    import torch

    from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
    from tests.helpers import TINY

    torch.manual_seed(0)
    GatedQwenForCausalLM(GatedQwenConfig(**{**TINY, "vocab_size": 64})).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_a_malicious_pickle_is_refused_without_suggesting_weights_only_false(model64, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    state = {**load_file(model64 / "model.safetensors"), "payload": Payload()}
    (model64 / "model.safetensors").unlink()
    torch.save(state, model64 / "pytorch_model.bin")
    for args in (["analyze", str(model64), "--length", "8", "--out", str(tmp_path / "analysis")],
                 ["eval-ppl", str(model64), "--lengths", "8"]):
        err = assert_refused(capsys, args, "holds pickled weights that torch.load(weights_only=True) refuses "
                                             "(Trying to load unsupported GLOBAL posix.system)")
        assert "weights_only=False" not in err
    assert not marker.exists() and not (tmp_path / "analysis").exists()


def test_a_refusal_after_the_model_stack_loaded_is_one_line_in_a_fresh_process(model64, tmp_path):
    """What a user sees: the whole stderr of a fresh `gated-qwen` that imported torch, Transformers and whatever they
    import (torchao from the `quant` extra warns about its C extensions at import) and then refused is one line, after
    the progress bar of loading the weights."""
    result = subprocess.run([sys.executable, "-m", "gated_qwen.cli", "analyze", str(model64), "--length", str(10**9),
                             "--out", str(tmp_path / "a")], capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in result.stderr.replace("\r", "\n").splitlines() if line and "%|" not in line]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"gated-qwen: error: --length {10**9} needs about"), result.stderr


def test_tokens_files_without_rows_or_integers_are_refused(model64, tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    for name, ids, message in (("empty", torch.zeros(0, 16, dtype=torch.long), "holds no tokens (`input_ids` is (0, 16))"),
                               ("floats", torch.rand(2, 16), "must hold a 2-D integer tensor `input_ids` [N, S]")):
        save_file({"input_ids": ids}, tmp_path / f"{name}.safetensors")
        assert_refused(capsys, ["eval-ppl", str(model64), "--lengths", "8", "--tokens",
                                  str(tmp_path / f"{name}.safetensors")], message, bars=True)


def test_lengths_that_do_not_fit_in_memory_are_refused_before_allocating(model64, tmp_path, capsys):
    """Refused at once (sampling a billion tokens of the built-in corpus alone would take hours), naming the limit."""
    import torch
    from safetensors.torch import save_file

    from gated_qwen.files.memory import available_memory

    err = assert_refused(capsys, ["analyze", str(model64), "--length", str(10**9), "--out", str(tmp_path / "a")],
                           f"--length {10**9} needs about", bars=True)
    limit = int(re.search(r"the most that fits is about --length (\d+)", err)[1])
    assert 2 <= limit < 10**9 and f"GiB available ({available_memory('cpu')[1]} on this machine)" in err
    err = assert_refused(capsys, ["analyze", str(model64), "--length", str(10**9), "--quant", "w4a4", "--out",
                                    str(tmp_path / "a")], "sequence(s) and its logits (--quant)", bars=True)
    assert int(re.search(r"the most that fits is about --length (\d+)", err)[1]) < 0.9 * limit  # the logits too
    assert_refused(capsys, ["eval-ppl", str(model64), "--lengths", "8", str(10**8)],
                     f"--lengths {10**8} needs about", bars=True)
    for command in (["eval-ppl", str(model64), "--lengths", "8"], ["analyze", str(model64), "--length", "8", "--out",
                                                                     str(tmp_path / "a")]):
        err = assert_refused(capsys, [*command, "--sequences", str(10**11)], f"--sequences {10**11} needs about", bars=True)
        assert "for the held-out windows of 8 tokens" in err  # refused at once: sampling them alone takes hours
    save_file({"input_ids": torch.zeros(2, 8, dtype=torch.long)}, tmp_path / "two.safetensors")  # a file's rows: all
    assert main(["eval-ppl", str(model64), "--lengths", "8", "--sequences", str(10**11), "--tokens",
                 str(tmp_path / "two.safetensors")]) == 0
    assert not (tmp_path / "a").exists()


def test_attention_memory_is_counted_where_it_is_quadratic():
    """With causal masks the fused SDPA kernels need memory linear in the length; a sliding window makes
    Transformers build the whole [length, length] mask."""
    from gated_qwen import GatedQwenConfig
    from gated_qwen.analysis.footprint import forward_bytes
    from tests.helpers import TINY

    full = GatedQwenConfig(**TINY)
    sliding = GatedQwenConfig(**TINY, use_sliding_window=True, sliding_window=64, max_window_layers=0)
    assert forward_bytes(full, 1, 2 * 10**5, 4) == 2 * forward_bytes(full, 1, 10**5, 4)
    assert forward_bytes(sliding, 1, 10**5, 4) - forward_bytes(full, 1, 10**5, 4) == 5 * 10**10


@pytest.mark.parametrize("variant", ["baseline", "g1-elementwise", "g1-headwise", "input-independent"])
def test_the_training_memory_estimate_counts_every_parameter(variant):
    """`training_bytes`, from the preset's sizes alone, against the parameters of the model reproduce builds (16 bytes
    each: weights, gradients, Adam's two moments), on a preset whose memory is almost all parameters: never less, and
    at most the largest (elementwise) gate's parameters more."""
    from gated_qwen import GatedQwenForCausalLM
    from gated_qwen.analysis.footprint import training_bytes
    from gated_qwen.analysis.miniature.presets import PLANS, customised, model_config

    preset = customised(PLANS["large"].main, seq_len=2, batch_size=1, steps=1, eval_documents=1, analysis_documents=1,
                        extrapolation_documents=1, num_hidden_layers=2)
    def parameters(variant: str) -> int:
        return sum(p.numel() for p in GatedQwenForCausalLM(model_config(preset, variant)).parameters())

    assert 16 * parameters(variant) <= training_bytes(preset) <= 1.05 * 16 * parameters("g1-elementwise")


@pytest.mark.parametrize("args, message", [
    (["--seq-len", "1"], "argument --seq-len: must be at least 2"),
    (["--seeds", "0", "-1"], "argument --seeds/--seed: a seed must be in [0, 2**32 - 1], got -1"),
    (["--seeds", str(2**40)], "a seed must be in [0, 2**32 - 1]"),
    (["--batch-size", str(10**9)], f"--batch-size {10**9} needs about"),
    (["--steps", str(10**13)], f"--steps {10**13} needs about"),
    (["--hidden-size", str(64000)], "--hidden-size 64000 needs about"),  # 16 GB of weights, allocated before
    (["--layers", str(10**9)], f"--layers {10**9} needs about"),  # its config alone: a list of 10**9 layer types
    (["--seq-len", str(10**7)], f"--seq-len {10**7} needs about"),
    (["--batch-size", str(10**9), "--steps", "2"], f"--batch-size {10**9} needs about"),  # the flag that can fix it
    (["--variants", "baseline,g9"], "--variants: unknown ['g9']"),
])
def test_reproduce_flags_are_refused_before_any_worker_starts(tmp_path, monkeypatch, capsys, args, message):
    import multiprocessing

    monkeypatch.chdir(tmp_path)
    assert_refused(capsys, ["reproduce", "--preset", "smoke", "--jobs", "2", "--out", "out", *args], message)
    assert multiprocessing.active_children() == [] and list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ the exit status tells the truth
def broken_stdout(kind: str):
    """A stdout that takes nothing: a pipe whose reader has gone, or the full device `/dev/full`."""
    if kind == "closed pipe":
        reader, writer = os.pipe()
        os.close(reader)
        return os.fdopen(writer, "w")
    return open("/dev/full", "w")  # noqa: SIM115 (closed by the test)


@pytest.mark.parametrize("kind", ["closed pipe", "/dev/full"])
def test_a_stdout_that_takes_nothing_does_not_fail_a_command_whose_outputs_were_written(model64, tmp_path,
                                                                                        monkeypatch, capsys, kind):
    """card, analyze and reproduce print a summary once their outputs are written: when stdout cannot take it,
    the status is 0 (the outputs are there, whole) and stderr says in one line that printing failed."""
    commands = {"card": (["card", str(model64)], model64 / "README.md"),
                "analyze": (["analyze", str(model64), "--length", "8", "--out", str(tmp_path / "a")],
                            tmp_path / "a" / "report.md"),
                "reproduce": (["reproduce", "--preset", "smoke", "--steps", "2", "--jobs", "1", "--variants",
                               "baseline", "--seeds", "3", "--families", "main", "--out",
                               str(tmp_path / "r")], tmp_path / "r" / "report.md")}
    for name, (args, written) in commands.items():
        stdout = broken_stdout(kind)
        monkeypatch.setattr(sys, "stdout", stdout)
        capsys.readouterr()
        try:
            code = main(args)
        finally:
            monkeypatch.undo()
            stdout.close()
        lines = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines()
                 if line.startswith("gated-qwen")]
        reason = "Broken pipe" if kind == "closed pipe" else "No space left on device"
        assert code == 0 and written.is_file(), (name, lines)
        assert lines == [f"gated-qwen: could not write to stdout ({reason}); the command's outputs were written."], (
            name, lines)


def test_a_full_stdout_in_a_fresh_process_leaves_the_status_of_the_outputs(model64):
    """The same with the process's own stdout on /dev/full, as `gated-qwen card MODEL > /dev/full` runs: the
    interpreter's last flush at exit fails on nothing (its status would be 120)."""
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "gated_qwen.cli", "card", str(model64)], stdout=full,
                                stderr=subprocess.PIPE, text=True, timeout=300, check=False)
    assert result.returncode == 0 and (model64 / "README.md").is_file(), result.stderr
    assert result.stderr.splitlines() == ["gated-qwen: could not write to stdout (No space left on device); the "
                                          "command's outputs were written."]


# ------------------------------------------------------------------------- bad input files: one line, never unexpected
WORDLEVEL = ('{"version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, '
             '"post_processor": null, "decoder": null, "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1}, '
             '"unk_token": "[UNK]"}}')


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def damaged_header(folder, how: str) -> None:
    """model.safetensors whose header lies about its first tensor: its dtype (F32 said F16, so the bytes do not match
    the shape) or its offsets (beyond the data); or whose `__metadata__` is not a map of strings ("metadata")."""
    import struct

    data = (folder / "model.safetensors").read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    first = sorted(name for name in header if name != "__metadata__")[0]
    if how == "dtype":
        header[first]["dtype"] = "F16"
    elif how == "metadata":
        header["__metadata__"] = {"format": 1}
    else:
        header[first]["data_offsets"][1] += 10**6
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])


def edit_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


BAD_FILES = {  # case -> (how MODEL is damaged, the command's arguments after MODEL, what the line says)
    "config.json nested 100,000 deep: convert": (
        lambda m: (m / "config.json").write_text('{"a": ' + nested(100_000) + "}"), ["convert", "MODEL", "OUT",
                                                                                      "--to", "release"],
        "SRC's config.json ({m}/config.json) is not valid JSON (nested too deeply"),
    "config.json nested 100,000 deep: analyze": (
        lambda m: (m / "config.json").write_text('{"a": ' + nested(100_000) + "}"), ["analyze", "MODEL", "--out",
                                                                                      "OUT"],
        "config.json of MODEL '{m}' ({m}/config.json) is not valid JSON (nested too deeply"),
    "config.json nested 100,000 deep: card": (
        lambda m: (m / "config.json").write_text('{"a": ' + nested(100_000) + "}"), ["card", "MODEL"],
        "MODEL_DIR's config.json ({m}/config.json) is not valid JSON (nested too deeply"),
    "--eval-results nested 5,000 deep": (
        lambda m: (m.parent / "results.json").write_text(nested(5_000)), ["card", "MODEL", "--eval-results",
                                                                          "MODEL/../results.json"],
        "--eval-results '{m}/../results.json' is not valid JSON (nested too deeply"),
    "a truncated model.safetensors: analyze": (
        lambda m: (m / "model.safetensors").write_bytes((m / "model.safetensors").read_bytes()[:2000]),
        ["analyze", "MODEL", "--length", "8", "--out", "OUT"],
        "MODEL '{m}': model.safetensors is not a readable safetensors file (a header of"),
    "a truncated model.safetensors: eval-ppl": (
        lambda m: (m / "model.safetensors").write_bytes((m / "model.safetensors").read_bytes()[:2000]),
        ["eval-ppl", "MODEL", "--lengths", "8"], "MODEL '{m}': model.safetensors is not a readable safetensors file"),
    "a header whose dtype lies": (lambda m: damaged_header(m, "dtype"), ["analyze", "MODEL", "--out", "OUT"],
                                  "MODEL '{m}': model.safetensors is not a readable safetensors file"),
    "a header whose offsets lie": (lambda m: damaged_header(m, "offsets"), ["eval-ppl", "MODEL", "--lengths", "8"],
                                   "MODEL '{m}': model.safetensors is not a readable safetensors file"),
    **{f"a header whose __metadata__ is not a map of strings: {command}": (
        lambda m: damaged_header(m, "metadata"), args, f"{where}model.safetensors{within} is not a readable safetensors "
        'file (its __metadata__ is {{"format": 1}}, not a map of strings)') for command, args, where, within in (
            ("convert", ["convert", "MODEL", "OUT", "--to", "release"], "", " in SRC"),
            ("convert --no-verify", ["convert", "MODEL", "OUT", "--to", "release", "--no-verify"], "", " in SRC"),
            ("analyze", ["analyze", "MODEL", "--length", "8", "--out", "OUT"], "MODEL '{m}': ", ""),
            ("eval-ppl", ["eval-ppl", "MODEL", "--lengths", "8"], "MODEL '{m}': ", ""))},
    **{f"model.safetensors linking to itself: {command}": (
        lambda m: ((m / "model.safetensors").unlink(), (m / "model.safetensors").symlink_to("model.safetensors")),
        args, "MODEL '{m}': model.safetensors is a link loop") for command, args in (
            ("analyze", ["analyze", "MODEL", "--length", "8", "--out", "OUT"]),
            ("eval-ppl", ["eval-ppl", "MODEL", "--lengths", "8"]))},
    "config.json and tokenizer.json linking to each other": (
        lambda m: ((m / "config.json").unlink(), (m / "config.json").symlink_to("tokenizer.json"),
                   (m / "tokenizer.json").symlink_to("config.json")),
        ["eval-ppl", "MODEL", "--lengths", "8"], "MODEL '{m}': config.json is a link loop"),
    "tokenizer.json a list": (lambda m: (m / "tokenizer.json").write_text("[1, 2]"),
                              ["eval-ppl", "MODEL", "--lengths", "8", "--text", "TEXT"],
                              "--text needs a tokenizer in MODEL '{m}', and none loads ("),
    "tokenizer.json a string": (lambda m: (m / "tokenizer.json").write_text('"x"'),
                                ["analyze", "MODEL", "--length", "8", "--text", "TEXT", "--out", "OUT"],
                                "--text needs a tokenizer in MODEL '{m}', and none loads ("),
    "tokenizer.json the library rejects": (
        lambda m: (m / "tokenizer.json").write_text(WORDLEVEL.replace('"unk_token": "[UNK]"', '"unk_token": 3')),
        ["eval-ppl", "MODEL", "--lengths", "8", "--text", "TEXT"],
        "--text needs a tokenizer in MODEL '{m}', and none loads ("),
    "tokenizer_class a number": (
        lambda m: ((m / "tokenizer.json").write_text(WORDLEVEL),
                   (m / "tokenizer_config.json").write_text('{"tokenizer_class": 3}')),
        ["eval-ppl", "MODEL", "--lengths", "8", "--text", "TEXT"],
        "--text needs a tokenizer in MODEL '{m}', and none loads ("),
    "tokenizer_class unknown": (
        lambda m: (m / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}'),
        ["eval-ppl", "MODEL", "--lengths", "8", "--text", "TEXT"],
        "--text needs a tokenizer in MODEL '{m}', and none loads ("),
    **{f"--device {device!r}: {command}": (
        lambda m: None, [command, "MODEL", *(["--lengths", "8"] if command == "eval-ppl" else ["--out", "OUT"]),
                         "--device", device], message)
       for device, message in (("bogus", "--device 'bogus' is not a device"),
                               ("cuda", "--device 'cuda': no CUDA device is available here"),
                               ("meta", "--device 'meta' holds no data"), ("", "--device '' is not a device"))
       for command in ("analyze", "eval-ppl")},
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_every_bad_input_file_is_one_line_naming_it(model64, tmp_path, capsys, case):
    import torch

    damage, args, message = BAD_FILES[case]
    if "cuda" in case and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    damage(model64)
    (tmp_path / "text.txt").write_text("a a a a " * 50)
    args = [str(model64) if a == "MODEL" else str(tmp_path / "out") if a == "OUT" else
            str(tmp_path / "text.txt") if a == "TEXT" else a.replace("MODEL", str(model64)) for a in args]
    assert_refused(capsys, args, message.format(m=model64), bars=True)
    assert not (tmp_path / "out").exists()


def test_a_config_whose_model_does_not_fit_is_refused_before_it_is_built(model64, tmp_path):
    """vocab_size 2e8 over tiny weights (25.6 GB of float32 embeddings), under a 4 GiB address-space cap: the config's
    own sizes are checked like the size flags, before the model is built."""
    edit_config(model64, vocab_size=200_000_000)
    capped = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30)); "
              "from gated_qwen.cli import main; sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", capped, "analyze", str(model64), "--length", "8", "--out",
                             str(tmp_path / "a")], capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in result.stderr.replace("\r", "\n").splitlines() if line and "%|" not in line]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"gated-qwen: error: the config.json of MODEL {str(model64)!r} describes a model whose "
                               "weights need about "), lines[0]
    assert "model.embed_tokens.weight [200000000, 32]" in lines[0] and "the RLIMIT_AS of this process" in lines[0]
    assert not (tmp_path / "a").exists()


def huge_sparse_weights(folder, vocab_size: int) -> None:
    """Rewrites the model folder `folder` as a consistent checkpoint of `vocab_size` embedding rows: config.json and
    a model.safetensors whose header says so, its tensors' bytes a sparse file's zeros (tens of GB that take no disk
    or memory until read)."""
    import struct

    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    huge = {name for name in tensors if name in ("model.embed_tokens.weight", "lm_head.weight")}
    header, data, end = {}, b"", 0
    for name in sorted(tensors, key=lambda name: (name in huge, name)):  # the huge ones last: all sparse zeros
        tensor = tensors[name]
        shape = [vocab_size, tensor.shape[1]] if name in huge else list(tensor.shape)
        size = tensor.element_size() * (shape[0] * shape[1] if name in huge else tensor.numel())
        header[name] = {"dtype": {"torch.float32": "F32"}[str(tensor.dtype)], "shape": shape,
                        "data_offsets": [end, end + size]}
        data += b"" if name in huge else tensor.numpy().tobytes()
        end += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "model.safetensors", "wb") as weights:
        weights.write(struct.pack("<Q", len(raw)) + raw + data)
        weights.truncate(8 + len(raw) + end)
    edit_config(folder, vocab_size=vocab_size)


CAPPED_4GIB = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30)); "
               "from gated_qwen.cli import main; sys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize("command", [["analyze", "MODEL", "--length", "8", "--out", "OUT"],
                                     ["eval-ppl", "MODEL", "--lengths", "8", "--out", "OUT"],
                                     *(["convert", "MODEL", "OUT", "--to", to] for to in ("mlx", "qwen3_5", "onnx"))],
                         ids=lambda command: " ".join(command[:1] + command[3:5]))
def test_weights_larger_than_memory_are_refused_naming_the_largest_tensor(model64, tmp_path, command):
    """A consistent checkpoint of 25.6 GB (a sparse file), under a 4 GiB address-space cap that no mapping of it fits
    in: its headers are read, not mapped, and the memory check names its largest tensor and the memory available,
    before anything is built (the float32 model of --to onnx included)."""
    huge_sparse_weights(model64, vocab_size=200_000_000)
    argv = [str(model64) if a == "MODEL" else str(tmp_path / "out") if a == "OUT" else a for a in command]
    result = subprocess.run([sys.executable, "-c", CAPPED_4GIB, *argv], capture_output=True, text=True, timeout=300,
                            check=False)
    lines = [line for line in result.stderr.replace("\r", "\n").splitlines() if line and "%|" not in line]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert "unexpected" not in lines[0] and "model.embed_tokens.weight [200000000, 32]" in lines[0], lines[0]
    assert "GiB available (the RLIMIT_AS of this process)" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_a_model_and_outputs_whose_names_are_not_utf8_are_read_and_written(model64, tmp_path):
    """MODEL, `--out` named `...\\xfe` (names the safetensors and tokenizers libraries cannot open, Rust strings):
    analyze and eval-ppl read and write them as they do UTF-8 names, the same numbers."""
    odd = tmp_path / os.fsdecode(b"model\xfe")
    try:
        os.rename(model64, odd)
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system takes only UTF-8 names")
    out = tmp_path / os.fsdecode(b"rows\xfe.json")
    assert main(["eval-ppl", str(odd), "--lengths", "8", "--sequences", "2", "--out", str(out)]) == 0
    assert main(["analyze", str(odd), "--length", "8", "--sequences", "2", "--out",
                 str(tmp_path / os.fsdecode(b"analysis\xfe"))]) == 0
    assert (tmp_path / os.fsdecode(b"analysis\xfe") / "report.json").is_file()
    os.rename(odd, tmp_path / "plain")
    assert main(["eval-ppl", str(tmp_path / "plain"), "--lengths", "8", "--sequences", "2", "--out",
                 str(tmp_path / "plain.json")]) == 0
    rows, plain = json.loads(out.read_text()), json.loads((tmp_path / "plain.json").read_text())
    assert rows.pop("model") == str(odd) and plain.pop("model") == str(tmp_path / "plain") and rows == plain
