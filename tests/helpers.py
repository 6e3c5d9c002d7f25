"""Helpers shared by the test modules (importable because pytest puts tests/ on sys.path): the tiny model sizes,
the weight randomiser, the spy on the fused kernel's launches, private namespaces, and the checks of what a command
writes (`tree`, `refused`, `cli_runs_in_namespace`, `one_line`). Test files take a size from here and override only
what their check is about."""

import contextlib
import dataclasses
import functools
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# The smallest shape that still has GQA (2 query heads per kv head) and more than one layer.
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
# Wider heads (16) and an untied output layer, for the numerical comparisons with stock Transformers models.
SMALL = dict(TINY, hidden_size=64, intermediate_size=96, head_dim=16, max_position_embeddings=256,
             tie_word_embeddings=False)
# What a tiny mixture-of-experts config adds.
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def sizes(base: dict = TINY, **overrides) -> dict:
    """`base` with `overrides` applied: the keyword arguments of a tiny config."""
    return {**base, **overrides}


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
def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under `root`: file contents, link targets, folders."""
    out = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        out[key] = (f"-> {os.readlink(path)}" if path.is_symlink() else path.read_bytes() if path.is_file()
                    else "folder")
    return out


def refused(capsys, args: list[str], message: str) -> None:
    from gated_qwen.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gated-qwen: error: ") and message in err, err


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


def one_line(answer: dict, message: str) -> None:
    assert answer["code"] == 2, answer
    assert answer["err"].endswith("\n") and answer["err"].splitlines()[-1].startswith("gated-qwen: error: ")
    assert message in answer["err"].splitlines()[-1] and "Traceback" not in answer["err"], answer["err"]
