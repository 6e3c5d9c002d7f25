"""The kernels compiled ahead of time for A100 (sm_80) and H100/H200 (sm_90) on this CPU-only machine, through
`benchmarks/kernel_aot.py` (Triton's NVIDIA backend and the ptxas in the wheel; launch arguments recorded from the
module's own launchers on meta tensors). For every configuration the autotuner may pick: it compiles, its shared
memory fits the architecture, ptxas reports no register spill, sm_90 uses wgmma (MMA v3), nothing uses atomics.

Runs in a subprocess: the test process runs the kernels under the Triton interpreter, which cannot compile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="needs the triton extra: pip install 'gated-qwen[triton]'")

from gated_qwen.kernel.tuning import allowed_entries

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_aot.py"
SHARED_LIMIT = {80: 166_912, 90: 232_448}
TUNED = {"forward": "forward", "dkdv": "backward_dkdv", "dq": "backward_dq"}


def compile_grid(tmp_path, grid: str, archs: list[int]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    rows_file = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--grid", grid, "--arch", *map(str, archs), "--no-anchor", "--jobs", "2",
         "--json", str(rows_file)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200, check=False)
    assert rows_file.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(rows_file.read_text())
    assert result.returncode == (1 if any(r["problems"] for r in rows) else 0), result.stderr[-2000:]
    return rows


def assert_gpu_ready(rows: list[dict], archs: list[int]):
    assert {(r["kernel"], r["arch"]) for r in rows} >= {(k, a) for k in ("forward", "dkdv", "dq") for a in archs}
    for r in rows:
        where = f"{r['kernel']} sm_{r['arch']} {r['config']} [{r['case']}]"
        assert r["ok_compile"], f"{where}: {r.get('error')}"
        assert r["shared"] <= SHARED_LIMIT[r["arch"]], where
        assert r["spill_bytes"] == 0, f"{where}: {r['spill_bytes']} bytes of register spills"
        assert not r["atomics"], where
        if r["dots"]:
            assert r["mma"] == (3 if r["arch"] == 90 else 2), f"{where}: MMA v{r['mma']}"
        assert r["grid"][0] <= 2**31 - 1 and all(g <= 65535 for g in r["grid"][1:]), where
        assert not r["problems"], where


def assert_every_tuner_config_compiled(rows: list[dict], case: str, archs: list[int], block_d: int,
                                       kernels=tuple(TUNED)):
    """The rows of `case` hold exactly the configurations `TUNING_SPACE` lets the tuner try on each architecture."""
    for arch in archs:
        for kernel, space in ((k, TUNED[k]) for k in kernels):
            compiled = {r["config"] for r in rows if r["kernel"] == kernel and r["arch"] == arch and r["case"] == case}
            entries = allowed_entries(space, (arch // 10, arch % 10), block_d)
            assert compiled == {f"{bm}x{bn} w{w} s{s}" for bm, bn, w, s in entries}, (kernel, arch)


@pytest.mark.slow  # a fresh interpreter and two compiler processes: about two minutes on two cores
def test_representative_grid_compiles_for_sm80_and_sm90_in_every_tuner_config(tmp_path):
    """Head dims 64/128/256, fp16/bf16, causal/full, no/elementwise/headwise gate, dense/varlen/decode, forward and
    backward, spread over sm_90 and sm_80 (the production shape D=128 bf16 causal elementwise on both), each with
    every configuration the tuner may pick there; benchmarks/kernel_aot.py runs the full grid."""
    rows = compile_grid(tmp_path, "representative", [80, 90])
    assert_gpu_ready(rows, [80, 90])
    assert {r["kernel"] for r in rows} == {"forward", "preprocess", "dkdv", "dq", "decode_split", "decode_combine"}
    assert_every_tuner_config_compiled(rows, "D=128 bf16 causal elementwise dense", [80, 90], 128)
    assert_every_tuner_config_compiled(rows, "D=64 fp16 full headwise varlen", [80], 64)
    assert_every_tuner_config_compiled(rows, "D=256 bf16 causal no gate dense", [90], 256)
    assert_every_tuner_config_compiled(rows, "D=64 bf16 full headwise dense", [80], 64, kernels=("forward",))


FORWARD_80 = ("forward", "sm80")
DKDV_90 = ("backward_dkdv", "sm90")


@pytest.mark.parametrize("installed, replaced", [
    # 3.5.1: its own dK/dV list on sm_90, 3.6.0's and 3.7.1's forward lists on sm_80
    ((3, 5), {(*FORWARD_80, 64): (3, 7), (*FORWARD_80, 128): (3, 9), (*DKDV_90, 128): (3, 6)}),
    ((3, 6), {(*FORWARD_80, 64): (3, 7), (*FORWARD_80, 128): (3, 9)}),  # 3.6.0 (torch 2.11, the GPU machine)
    ((3, 7), {(*FORWARD_80, 128): (3, 9)}),  # 3.7.1 (torch 2.13's CUDA pin)
    ((3, 8), {(*FORWARD_80, 128): (3, 9)}),
    ((3, 9), {}),
    ((3, 10), {}),
])
def test_each_triton_tries_the_entries_its_compiler_does_not_spill(monkeypatch, installed, replaced):
    """Triton 3.7.1 spills in sm_80 forward tiles of head dim 128 that 3.9 compiles cleanly, 3.6.0 also in one of
    head dim 64, 3.5.1 also in a sm_90 dK/dV tile: below 3.9, 3.7 and 3.6 the tuner tries the replacement lists for
    those, an older Triton inherits the newer ones', and everything else tries the main space (the AOT grids check
    the lists under 3.7.1 in `make test-slow` and under 3.6.0 in `make test-compat`)."""
    from gated_qwen.kernel import tuning

    monkeypatch.setattr(tuning, "TRITON_VERSION", installed)
    capabilities = {"sm90": (9, 0), "sm80": (8, 0), "small": (8, 6)}
    for kernel, families in tuning.TUNING_SPACE.items():
        for family, classes in families.items():
            for head_dims, entries in classes.items():
                key = (kernel, family, head_dims)
                expected = tuning.TUNING_SPACE_BEFORE_TRITON[replaced[key]][key] if key in replaced else entries
                assert tuning.allowed_entries(kernel, capabilities[family], head_dims) == expected, key
    assert (128, 128, 8, 3) in tuning.TUNING_SPACE["forward"]["sm80"][64]
    assert (128, 128, 8, 3) not in tuning.TUNING_SPACE_BEFORE_TRITON[3, 7]["forward", "sm80", 64]
    assert (64, 64, 8, 2) not in tuning.TUNING_SPACE_BEFORE_TRITON[3, 6]["backward_dkdv", "sm90", 128]
