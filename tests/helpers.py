"""The tests' fixtures (`from tests.helpers import ...`, in the suite and in a page's examples): the tiny model
sizes, every gate variant (generated from the gate's registry) and those an export writes, the weight randomiser,
the spy on the fused kernel's launches, private namespaces, the checks of what a command writes (`tree`,
`assert_nothing_written`) and of how it refuses (`assert_refused`, `refusal_line`), and the tiny folders (with a
tokenizer) that the pages' hidden blocks and the engine tests build. Test files take a size from here and override
only what their check is about."""

import contextlib
import dataclasses
import functools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# The smallest shape that still has GQA (2 query heads per kv head) and more than one layer.
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
# Wider heads (16) and an untied output layer, for the numerical comparisons with stock Transformers models.
SMALL = dict(TINY, hidden_size=64, intermediate_size=96, head_dim=16, max_position_embeddings=256,
             tie_word_embeddings=False)
# What a tiny mixture-of-experts config adds.
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# TINY with the vocabulary of the tiny tokenizer (`tiny_tokenizer`) and room for the pages' longer texts.
TINY_TOKENIZED = dict(TINY, vocab_size=320, max_position_embeddings=512)


def sizes(base: dict = TINY, **overrides) -> dict:
    """`base` with `overrides` applied: the keyword arguments of a tiny config."""
    return {**base, **overrides}


def gate_variants() -> dict[str, dict]:
    """Every gate the registry (`gated_qwen.model.gating`) defines, as the GatedQwenConfig fields of each, by name:
    each position (G1...G5) at each granularity it has (G5 has no heads), shared across heads where it has heads,
    and added (SiLU, the paper's additive form); at G1 each activation both multiplied and added, shared and
    headwise, input-independent, with a bias; each non-gate control (`sdpa_output_transform`); no gate. A new entry
    of the registry is a new variant here."""
    from gated_qwen.model.gating import (
        ACTIVATIONS,
        COMBINES,
        DEFAULTS,
        GRANULARITIES,
        POSITIONS,
        SDPA_OUTPUT_TRANSFORMS,
    )

    variants = {}
    for name, position in POSITIONS.items():
        if position.heads:
            for granularity in GRANULARITIES:
                variants[f"{position.paper}-{granularity}"] = dict(gate_position=name, gate_granularity=granularity)
            variants[f"{position.paper}-shared"] = dict(gate_position=name, gate_shared_across_heads=True)
        else:
            variants[position.paper] = dict(gate_position=name)
        variants[f"{position.paper}-add-silu"] = dict(gate_position=name, gate_combine="add", gate_activation="silu")
    for combine in COMBINES:
        for activation in ACTIVATIONS:
            if (combine, activation) != (DEFAULTS["gate_combine"], DEFAULTS["gate_activation"]):  # G1-elementwise
                variants.setdefault(f"G1-{combine}-{activation}", dict(gate_combine=combine, gate_activation=activation))
    variants |= {"G1-shared-headwise": dict(gate_shared_across_heads=True, gate_granularity="headwise"),
                 "G1-input-independent": dict(gate_input_dependent=False), "G1-bias": dict(gate_bias=True)}
    variants |= {f"control-{t}": dict(gate_position=None, sdpa_output_transform=t) for t in SDPA_OUTPUT_TRANSFORMS}
    return variants | {"baseline": dict(gate_position=None)}


def written_gates(refusal) -> dict[str, dict]:
    """The gate variants (`gate_variants`, by their names there) that an export writes: those whose TINY config
    `refusal` (the export's own check of the gate, which raises `ConversionError`) lets through. A new gate of the
    registry is run in each engine whose export writes it, and refused by the others' exports."""
    from gated_qwen import GatedQwenConfig
    from gated_qwen.conversion.errors import ConversionError

    written = {}
    for name, fields in gate_variants().items():
        try:
            refusal(GatedQwenConfig(**TINY, **fields))
        except ConversionError:
            continue
        written[name] = fields
    return written


def randomize_(model: torch.nn.Module, seed: int = 0, scale: float = 0.08, norm_center: float = 1.0,
               norm_scale: float = 0.3) -> torch.nn.Module:
    """Random values in every parameter, norms included (a norm weight of ones would hide a missing norm): norm
    weights `norm_center + norm_scale * N(0, 1)` (centre 0 for zero-centred norms), the rest `scale * N(0, 1)`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = name.endswith("norm.weight") or "layernorm" in name
            center, spread = (norm_center, norm_scale) if is_norm else (0.0, scale)
            param.copy_(center + spread * torch.randn(param.shape, generator=generator))
    return model


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """One call of the fused Triton kernel by the `gated_triton` backend: the gate fused into it (None,
    "elementwise" or "headwise"), whether the batch went in packed (varlen: padding or packed sequences) and the
    longest query sequence (1: the decode kernel)."""

    gate: str | None
    packed: bool
    max_queries: int


@contextlib.contextmanager
def kernel_launches() -> Iterator[list[KernelLaunch]]:
    """Records every call that the `gated_triton` backend (`kernel/attention.py`'s attention function) makes to the
    fused kernel while the block runs.

    The backend falls back to SDPA + a separate gate when the kernel fails its first-use self-check, and the
    fallback gives the same logits: a test of the kernel path must also assert that the kernel ran, e.g.
    `assert len(launches) == config.num_hidden_layers` for one forward. The self-check calls the kernel directly,
    not through the backend, so its calls are not recorded. On a CUDA GPU, where the backend runs the kernel only
    where it was measured faster than SDPA + gate (`kernel/choice.py`), nothing is measured yet inside the block and
    the timer says the kernel is faster, so the kernel path is the one under test."""
    from gated_qwen.kernel import attention, choice
    from gated_qwen.kernel.inputs import gate_kind

    launches: list[KernelLaunch] = []
    kernel = attention.gated_attention

    def spy(q, k, v, gate=None, **kwargs):
        packed = kwargs.get("cu_seqlens_q") is not None
        launches.append(KernelLaunch(gate_kind(gate, q.shape[-1]), packed, kwargs["max_seqlen_q"] if packed else q.shape[1]))
        return kernel(q, k, v, gate, **kwargs)

    def kernel_faster(run, device, path):
        run()
        return 1.0 if path == "kernel" else 2.0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "gated_attention", spy)
        patch.setattr(choice, "TIMER", kernel_faster)
        patch.setattr(choice, "CHOICES", {})  # nothing measured by an earlier test
        patch.setattr(choice, "_READ", set())
        yield launches


# ------------------------------------------------------------------------------------------- mounts, in private
def _namespace_prefixes(pid: bool) -> list[list[str]]:
    extra = ["--pid", "--fork", "--kill-child"] if pid else []
    return [["unshare", "--mount", "--propagation", "private", *extra],  # as root
            ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private", *extra]]  # unprivileged


@functools.cache
def private_namespace(pid: bool = False) -> tuple[str, ...] | None:
    """The command prefix that runs a command in a mount namespace of its own (and a PID namespace of its own with
    `pid`), where it may mount (bind mounts, a small tmpfs) without touching the machine's mounts, which all vanish
    when it exits; None where this machine allows neither (not root, no unprivileged user namespaces)."""
    with tempfile.TemporaryDirectory() as folder:
        for prefix in _namespace_prefixes(pid):
            try:
                probe = subprocess.run([*prefix, "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {folder}"],
                                       capture_output=True, timeout=60, check=False)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if probe.returncode == 0:
                return tuple(prefix)
    return None


def run_in_namespace(setup: str, argv: list[str], pid: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """Runs the shell commands `setup` (mounts) and then `argv` (exec'd) in a private namespace (see
    `private_namespace`; the caller skips the test when there is none)."""
    prefix = private_namespace(pid)
    script = f"set -e; {setup}; exec " + " ".join(shlex.quote(str(a)) for a in argv)
    return subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, check=False,
                          timeout=kwargs.pop("timeout", 600), **kwargs)


def gated_qwen_command(*args) -> list[str]:
    """The `gated-qwen` command line as this interpreter runs it."""
    return [sys.executable, "-m", "gated_qwen.cli", *map(str, args)]


# ------------------------------------------------------------------------------ what a command writes, and refuses
def bare_environment(hf_home: str | os.PathLike) -> dict[str, str]:
    """The environment of a fresh interpreter that must not find this package: system PATH, offline, one thread,
    `hf_home` as its Hugging Face cache, and the session's HOME, caches and cache guard (tests/conftest.py)."""
    kept = {name: os.environ[name] for name in ("HOME", "XDG_CACHE_HOME", "GATED_QWEN_TESTS_GUARD")}
    return {**kept, "PYTHONPATH": str(ROOT / "tests" / "hermetic"), "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1",
            "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # one thread, as the test process: same reductions


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under `root`: file contents, link targets, folders."""
    out = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        out[key] = (f"-> {os.readlink(path)}" if path.is_symlink() else path.read_bytes() if path.is_file()
                    else "folder")
    return out


def assert_nothing_written(dst: Path) -> None:
    """Nothing at `dst`, and no staging folder (`.NAME.*`) of it beside it."""
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")], "temporary folder left behind"


# A line that tqdm draws (`Loading weights: 100%|####| 24/24 [00:00<00:00, ...]`).
PROGRESS_BAR = re.compile(r"^[^:]*: *\d+%\|.*\| *[\d.?]+[kMG]?/[\d.?]+[kMG]? \[.*\]$")


def refusal_line(code: int, err: str, message: str, status: int = 2, bars: bool = False) -> str:
    """Asserts that a command that ended with exit status `code` and wrote `err` to stderr refused as every bad input
    is refused: status `status` (2), and stderr one line `gated-qwen: error: ...` that contains `message` (with
    `bars`, after progress bars drawn while loading), never "unexpected", never a traceback. Returns the line."""
    assert code == status and err.endswith("\n"), (code, err)
    *before, line = [part for part in err.replace("\r", "\n").split("\n") if part.strip()]
    assert line.startswith("gated-qwen: error: ") and message in line, err
    assert all(PROGRESS_BAR.match(bar) and "error" not in bar.lower() for bar in before) if bars else not before, err
    assert "unexpected" not in err and "Traceback" not in err, err
    return line


def assert_refused(capsys, args: list[str], message: str, nothing_at: Path | None = None, status: int = 2,
                   bars: bool = False) -> str:
    """`gated-qwen ARGS` (in this process) refuses with `message` in one line (`refusal_line`, `bars` there), and,
    given `nothing_at`, leaves nothing there (`assert_nothing_written`). Returns the line."""
    from gated_qwen.cli import main

    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as done:  # argparse's refusals
        code = done.code
    line = refusal_line(code, capsys.readouterr().err, message, status, bars)
    if nothing_at is not None:
        assert_nothing_written(nothing_at)
    return line


CLI_RUNS = """
import contextlib, io, json, sys
from gated_qwen.cli import main

answers = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as done:
            code = done.code
    answers.append({"code": code, "err": err.getvalue()})
print(json.dumps(answers))
"""


def cli_runs_in_namespace(setup: str, runs: list[list[str]]) -> list[dict]:
    """Each command line of `runs` (gated-qwen arguments), in one process in a private mount namespace after
    `setup`: its exit status and stderr."""
    result = run_in_namespace(setup, [sys.executable, "-c", CLI_RUNS, json.dumps(runs)])
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


# ------------------------------------------------------------------------ tiny folders, as the pages name them
# Built offline with public APIs (so they follow the library's formats); a page's hidden `setup` block imports them.
TEXTS = ["Gated attention removes the attention sink because the gate can close",
         "a sigmoid gate on the attention output makes it sparse and input dependent",
         "massive activations shrink when the gate is on, and training is more stable"]


def tiny_tokenizer(folder: str | os.PathLike, texts: list[str] = TEXTS, vocab_size: int = TINY_TOKENIZED["vocab_size"]):
    """A byte-level BPE tokenizer (Qwen's kind) trained on `texts` with the `tokenizers` library, saved in
    `folder`; its ids are below `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    assert len(tokenizer) <= vocab_size
    tokenizer.save_pretrained(folder)
    return tokenizer


def _save(model, folder: str | os.PathLike, tokenizer: bool = True) -> Path:
    torch.manual_seed(0)
    model.save_pretrained(folder)
    if tokenizer:
        tiny_tokenizer(folder, vocab_size=model.config.vocab_size)
    return Path(folder)


def tiny_gated_folder(folder: str | os.PathLike, **config) -> Path:
    """A saved random GatedQwenForCausalLM (TINY_TOKENIZED sizes, G1 elementwise unless `config` says otherwise) with a
    tokenizer."""
    from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM

    return _save(GatedQwenForCausalLM(GatedQwenConfig(**{**TINY_TOKENIZED, **config})), folder)


def tiny_release_folder(folder: str | os.PathLike, granularity: str | None = "elementwise") -> Path:
    """A folder in the layout of the paper's release (`QwQZh/gated_attention`: model_type qwen3, the gate packed in
    q_proj), as `gated-qwen convert --to release` writes it from a random tiny model; `granularity` None: the
    baseline."""
    from gated_qwen.conversion import convert

    with tempfile.TemporaryDirectory() as scratch:
        gate = {"gate_position": None} if granularity is None else {"gate_granularity": granularity}
        source = tiny_gated_folder(Path(scratch) / "gated", **gate)
        Path(folder).parent.mkdir(parents=True, exist_ok=True)
        convert(source, folder, to_format="release", verify=False)
    return Path(folder)


def tiny_qwen3_folder(folder: str | os.PathLike) -> Path:
    """A saved random stock Qwen3ForCausalLM (TINY_TOKENIZED sizes) with a tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _save(Qwen3ForCausalLM(Qwen3Config(**TINY_TOKENIZED)), folder)


# The pages' mixture of experts: TINY_MOE with 4 experts.
PAGE_MOE = dict(TINY_MOE, num_experts=4)


def tiny_qwen3_moe_folder(folder: str | os.PathLike) -> Path:
    """A saved random stock Qwen3MoeForCausalLM with a tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _save(Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_TOKENIZED, **PAGE_MOE)), folder)


def tiny_gated_moe_folder(folder: str | os.PathLike, **config) -> Path:
    """A saved random GatedQwenMoeForCausalLM with G1 elementwise and a shared expert (exportable to Qwen3-Next)."""
    from gated_qwen import GatedQwenMoeConfig, GatedQwenMoeForCausalLM

    config = {**TINY_TOKENIZED, **PAGE_MOE, "shared_expert_intermediate_size": 32, **config}
    return _save(GatedQwenMoeForCausalLM(GatedQwenMoeConfig(**config)), folder)


def tiny_qwen3_next_folder(folder: str | os.PathLike) -> Path:
    """A saved random stock Qwen3NextForCausalLM with every layer full attention and full RoPE (what GatedQwen
    imports), with a tokenizer."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(**TINY_TOKENIZED, **PAGE_MOE, shared_expert_intermediate_size=32, partial_rotary_factor=1.0,
                             layer_types=["full_attention"] * TINY_TOKENIZED["num_hidden_layers"])
    return _save(Qwen3NextForCausalLM(config), folder)


def text_file(path: str | os.PathLike, words: int = 2000, seed: int = 0) -> Path:
    """`words` words of TEXTS' vocabulary in random order, one line of 20 words after another."""
    import random

    vocabulary = sorted({word for text in TEXTS for word in text.split()})
    rng = random.Random(seed)
    chosen = [rng.choice(vocabulary) for _ in range(words)]
    Path(path).write_text("\n".join(" ".join(chosen[i:i + 20]) for i in range(0, words, 20)) + "\n")
    return Path(path)


def folder_tensors(folder: str | os.PathLike) -> dict:
    """Every tensor of the folder's safetensors files, by name."""
    from safetensors.torch import load_file

    return {name: t for file in sorted(Path(folder).glob("*.safetensors")) for name, t in load_file(file).items()}


def link_from_repository(*names: str) -> None:
    """Makes the repository's `names` (e.g. "benchmarks", "examples") visible in the working folder, for examples
    that are run from a clone."""
    for name in names:
        Path(name).symlink_to(ROOT / name)
