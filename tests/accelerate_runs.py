"""What tests/integrations/test_accelerate.py (DDP and FSDP2, in `make test-slow`) and tests/distributed/test_deepspeed.py (DeepSpeed
ZeRO-2/3, `make test-distributed`) share: the tiny gated models, the data, the one-process reference, the
`accelerate launch` command a user runs, and the comparisons.

Every run is `Trainer` in tests/dist_scripts/accelerate_train.py: 3 AdamW steps (lr 1e-2, weight decay, clipping
at 1.0), float32, rows taken in order. The reference is one process with 4 rows a step; each launch is 2 CPU
processes (gloo) with 2 rows each, so both see the same 4 rows a step. Tolerances, with the largest differences
measured on this machine (2 cores, `make test-distributed`; see the report of each test):
- the loss and gradient norm `Trainer` logs at each step: relative 1e-6 (measured: at most 2.1e-7, an ulp or two of
  float32: the ranks' halves are summed in another order);
- the final weights: 2e-5 absolute, i.e. 2e-3 of the learning rate, against weights that moved by about 3e-2
  (asserted); Adam divides by sqrt(v) + 1e-8, so a weight whose gradients are ~1e-8 amplifies the ulp-level
  differences of its gradient (measured: at most 5.6e-6, ZeRO-3 on the MoE model);
- the logits of the saved model reloaded with `from_pretrained`, on the training rows: 2e-5 absolute (measured: at
  most 3.8e-6).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, GatedQwenMoeConfig, GatedQwenMoeForCausalLM
from tests.helpers import TINY, TINY_MOE, sizes

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "examples" / "accelerate"
SCRIPT = Path(__file__).parent / "dist_scripts" / "accelerate_train.py"
ACCELERATE = Path(sys.executable).parent / "accelerate"  # the environment's own `accelerate` command

# name -> (model class, config class, config fields): G1 (the gate on the SDPA output) elementwise and headwise, and
# a mixture of experts; tied and untied output layers.
MODELS = {
    "G1-elementwise": (GatedQwenForCausalLM, GatedQwenConfig, sizes(TINY, tie_word_embeddings=True)),
    "G1-headwise": (GatedQwenForCausalLM, GatedQwenConfig,
                    sizes(TINY, gate_granularity="headwise", tie_word_embeddings=False)),
    "MoE-G1-elementwise": (GatedQwenMoeForCausalLM, GatedQwenMoeConfig, sizes(TINY, **TINY_MOE)),
}
ROWS, LENGTH, STEPS, BATCH = 12, 16, 3, 2  # BATCH rows per process and step; the reference takes 2 * BATCH
LOSS_RTOL, WEIGHT_ATOL, LOGITS_ATOL = 1e-6, 2e-5, 2e-5
# What the CPU run of each shipped config needs beside `--num_processes 2 --mixed_precision no` (docs/training.md).
CPU_ENV = {
    "ddp": {"ACCELERATE_USE_CPU": "1"},
    "fsdp2": {"ACCELERATE_USE_CPU": "1"},
    "deepspeed_zero2": {"DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"},
    "deepspeed_zero3": {"DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"},
}


def build(work: Path) -> None:
    """work/models/<name> (one saved folder per model) and work/data.pt (`[ROWS, LENGTH]` token ids)."""
    for seed, (name, (model_class, config_class, fields)) in enumerate(MODELS.items()):
        torch.manual_seed(seed)
        model_class(config_class(**fields)).save_pretrained(work / "models" / name)
    data = torch.randint(0, TINY["vocab_size"], (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))
    torch.save(data, work / "data.pt")


def run_command(command: list[str], env: dict[str, str], log: Path) -> None:
    # A generous safety net: a run takes 10 to 40 s on 2 idle cores (the first DeepSpeed one also compiles its
    # shared-memory op, about 2 minutes).
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True,
                            text=True, timeout=1200, check=False)
    log.write_text(result.stdout + result.stderr)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout[-3000:]}{result.stderr[-8000:]}"


def reference(work: Path, names=tuple(MODELS)) -> Path:
    """One process, `python accelerate_train.py`, 2 * BATCH rows a step: work/one/<name>."""
    out = work / "one"
    run_command([sys.executable, str(SCRIPT), str(work / "data.pt"), str(out), *(str(work / "models" / n) for n in names),
          "--steps", str(STEPS), "--batch", str(2 * BATCH)], {}, work / "one.log")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(work: Path, config: str, out_name: str, names=tuple(MODELS), *script_args: str) -> Path:
    """`accelerate launch --config_file examples/accelerate/<config>.yaml --num_processes 2 --mixed_precision no
    accelerate_train.py ...` with the config's CPU environment: work/<out_name>/<name>."""
    out = work / out_name
    env = dict(CPU_ENV[config])
    if config.startswith("deepspeed"):  # DeepSpeed compiles its CPU op once: into this session's folder, not ~/.cache
        env["TORCH_EXTENSIONS_DIR"] = str(work.parent / "torch_extensions")
    command = [str(ACCELERATE), "launch", "--config_file", str(CONFIGS / f"{config}.yaml"), "--num_processes", "2",
               "--mixed_precision", "no", "--main_process_port", str(free_port()),
               str(SCRIPT), str(work / "data.pt"), str(out), *(str(work / "models" / n) for n in names),
               "--steps", str(STEPS), "--batch", str(BATCH), *script_args]
    run_command(command, env, work / f"{out_name}.log")
    return out


def run_facts(folder: Path) -> dict:
    return json.loads((folder / "run.json").read_text())


def assert_steps_match(run: dict, reference_run: dict) -> None:
    """Per-step loss and gradient norm within LOSS_RTOL of one process."""
    assert run["steps"] == reference_run["steps"] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(run[key], dtype=torch.float64),
                                   torch.tensor(reference_run[key], dtype=torch.float64),
                                   rtol=LOSS_RTOL, atol=0, msg=lambda m, key=key: f"{key}: {m}")


def largest_step_difference(run: dict, reference_run: dict) -> float:
    return max(abs(a - b) / abs(b) for key in ("loss", "grad_norm") for a, b in zip(run[key], reference_run[key]))


def assert_same_model(folder: Path, reference_folder: Path, initial_folder: Path, data: torch.Tensor) -> dict:
    """`folder` reloads with from_pretrained and has the reference's weights (as loaded: in-memory names) and
    logits; the reference moved away from the initial weights. Returns the largest differences."""
    model = type_of(initial_folder).from_pretrained(folder, dtype=torch.float32)
    reference_model = type_of(initial_folder).from_pretrained(reference_folder, dtype=torch.float32)
    initial = type_of(initial_folder).from_pretrained(initial_folder, dtype=torch.float32).state_dict()
    state, reference_state = model.state_dict(), reference_model.state_dict()
    assert state.keys() == reference_state.keys()
    moved = max((reference_state[k] - initial[k]).abs().max().item() for k in reference_state)
    assert moved > 100 * WEIGHT_ATOL, moved
    for key, value in reference_state.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=WEIGHT_ATOL, msg=lambda m, key=key: f"{key}: {m}")
    with torch.no_grad():
        logits, reference_logits = model(data).logits, reference_model(data).logits
    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=LOGITS_ATOL)
    return {"weights": max((state[k] - v).abs().max().item() for k, v in reference_state.items()),
            "logits": (logits - reference_logits).abs().max().item(), "moved": moved}


def type_of(folder: Path):
    return GatedQwenMoeForCausalLM if "num_experts" in json.loads((folder / "config.json").read_text()) \
        else GatedQwenForCausalLM


def with_config(weights_folder: Path, config_folder: Path) -> Path:
    """A consolidated checkpoint has the weights only: the model's config.json beside them, as a user copies it."""
    shutil.copy(config_folder / "config.json", weights_folder / "config.json")
    return weights_folder
