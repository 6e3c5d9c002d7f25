"""The block configurations the autotuner may try, per kernel, GPU architecture family, head-dim class and Triton
version, and the autotuner's hooks that apply them (`autotune_configs`, `prune_configs`).

Adding a tile is one tuple here (CONTRIBUTING.md, "Adding a kernel tile"); tests/kernel/test_kernel_aot.py compiles every
entry for sm_80 and sm_90. The tables import without Triton (benchmarks/kernel_aot.py and benchmarks/gpu_check.py read
them); `triton.Config`s are built only when the kernels are defined.
"""

import torch

from .launch import INTERPRET, TRITON_VERSION, triton

# --------------------------------------------------------------------------------------------------------------------
# Block configurations per GPU architecture
# --------------------------------------------------------------------------------------------------------------------
#
# (BLOCK_M, BLOCK_N, num_warps, num_stages) that the autotuner may try, per kernel, architecture family and head-dim
# class (BLOCK_D: 64 for D <= 64, 128, 256). Every entry compiles ahead of time (tests/kernel/test_kernel_aot.py,
# benchmarks/kernel_aot.py) within the architecture's shared memory, without register spills, and with wgmma (MMA v3)
# on sm_90 for 16-bit inputs; configurations that spill or overflow shared memory are left out here, so the tuner
# never tries them.
#   sm90:  H100 / H200 (227 KB shared memory per block), also used for sm_100 (Blackwell, 227 KB)
#   sm80:  A100 (163 KB)
#   small: every other architecture (sm_86 / sm_89 / sm_120: 99 KB), small tiles
# The entries were chosen by compiling a wider candidate set for sm_90 and sm_80 in several variants (fp16/bf16,
# causal/full, gate kinds, dense/varlen, the decode backward) and keeping tiles that never spilled, preferring a margin
# below 255 registers (register use moves by tens between variants); the full grid re-checks them
# (benchmarks/RESULTS.md).
TUNING_SPACE: dict[str, dict[str, dict[int, list[tuple[int, int, int, int]]]]] = {
    "forward": {
        "sm90": {
            64: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
            128: [(128, 64, 8, 3), (64, 128, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2)],
            256: [(64, 32, 8, 3), (64, 32, 8, 2)],
        },
        "sm80": {
            64: [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 8, 2), (64, 32, 4, 3)],
            128: [(128, 64, 8, 2), (64, 128, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2)],
            256: [(64, 32, 8, 2), (64, 32, 8, 3)],
        },
        "small": {
            64: [(128, 64, 8, 2), (64, 64, 8, 2)],
            128: [(128, 64, 8, 2), (64, 32, 4, 2)],
            256: [(64, 32, 8, 2)],
        },
    },
    # Head dim 256 runs the dK/dV kernel twice (dK, then dV): its entries pass for both.
    "backward_dkdv": {
        "sm90": {
            64: [(64, 128, 8, 2), (64, 64, 8, 2), (32, 128, 8, 2), (32, 64, 4, 2)],
            128: [(64, 64, 8, 2), (32, 128, 8, 2), (32, 64, 8, 2), (16, 128, 8, 2)],
            256: [(16, 64, 8, 2), (32, 128, 8, 2), (16, 128, 8, 2)],
        },
        "sm80": {
            64: [(32, 128, 8, 2), (32, 64, 4, 2), (32, 64, 8, 2)],
            128: [(64, 64, 8, 3), (32, 64, 8, 2), (16, 64, 8, 2)],
            256: [(32, 64, 8, 2)],
        },
        "small": {
            64: [(32, 64, 4, 2), (32, 64, 8, 2)],
            128: [(32, 64, 8, 2), (16, 64, 8, 2)],
            256: [(16, 64, 8, 1), (32, 32, 8, 2)],
        },
    },
    "backward_dq": {
        "sm90": {
            64: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2)],
            128: [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 8, 2)],
            256: [(128, 32, 8, 2), (64, 32, 8, 2)],
        },
        "sm80": {
            64: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2)],
            128: [(128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 8, 2)],
            256: [(64, 32, 8, 2)],
        },
        "small": {
            64: [(64, 64, 4, 2), (128, 64, 8, 2)],
            128: [(64, 64, 8, 2), (64, 32, 4, 2)],
            256: [(64, 32, 8, 1)],
        },
    },
}
# Other Triton versions allocate registers differently: for Triton below each version, these lists replace the ones
# above, (kernel, family, head-dim class) -> entries; the lowest version that lists a key wins, so an older Triton
# inherits the replacements of the newer ones. Each leaves out what spills in the full grid compiled under that
# Triton (benchmarks/kernel_aot.py, benchmarks/RESULTS.md).
TUNING_SPACE_BEFORE_TRITON: dict[tuple[int, int], dict[tuple[str, str, int], list[tuple[int, int, int, int]]]] = {
    # 3.7.1, what torch 2.13's CUDA wheels pin (requirements/cuda.lock): 128x64 w8 s2 spills 260-300 B under a
    # causal mask, 64x64 w8 s2 56 B with an elementwise gate and a full one; 128x32 w8 s2 takes the 128-row place (at
    # most 209 registers over the 24 head-dim-128 variants).
    (3, 9): {
        ("forward", "sm80", 128): [(128, 32, 8, 2), (64, 128, 8, 2), (64, 32, 4, 2)],
    },
    # 3.6.0, what torch 2.11's CUDA wheels pin (the project's GPU machine; 3.5 inherits it): 128x128 w8 s3 spills 8 B
    # at head dim 64 with a headwise gate and a full mask (the other 1010 of its full grid compile cleanly).
    (3, 7): {
        ("forward", "sm80", 64): [(128, 64, 8, 3), (64, 64, 8, 2), (64, 32, 4, 3)],
    },
    # 3.5.1: the dK/dV tile 64x64 w8 s2 spills 40 B on sm_90 at head dim 128 (the decode layout's backward, no gate).
    (3, 6): {
        ("backward_dkdv", "sm90", 128): [(32, 128, 8, 2), (32, 64, 8, 2), (16, 128, 8, 2)],
    },
}
# The one configuration every kernel uses under the interpreter (more than one fails there).
INTERPRET_CONFIG = (64, 64, 4, 1)


def arch_family(capability: tuple[int, int]) -> str:
    """`(major, minor)` compute capability -> the key of `TUNING_SPACE` whose tiles fit that GPU."""
    if capability[0] in (9, 10):
        return "sm90"
    if capability == (8, 0):
        return "sm80"
    return "small"


def head_dim_class(block_d: int) -> int:
    return min(max(block_d, 64), 256)


def _config(entry: tuple[int, int, int, int]):
    block_m, block_n, warps, stages = entry
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


def config_entry(config) -> tuple[int, int, int, int]:
    """A `triton.Config` as its `TUNING_SPACE` entry `(BLOCK_M, BLOCK_N, num_warps, num_stages)`."""
    return (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)


def autotune_configs(kernel: str) -> list:
    """Every configuration of `kernel` over all families and classes (the autotuner's list; `prune_configs` picks
    the ones for the device at hand); exactly one under the interpreter."""
    if INTERPRET:
        return [_config(INTERPRET_CONFIG)]
    entries = []
    for family, by_class in TUNING_SPACE[kernel].items():
        for head_dims in by_class:
            class_entries = space_entries(kernel, family, head_dims)
            entries += [e for e in class_entries if e not in entries]
    return [_config(e) for e in entries]


def device_capability(tensor: torch.Tensor) -> tuple[int, int]:
    """Compute capability of the GPU holding `tensor`. Ahead-of-time compilation (benchmarks/kernel_aot.py) swaps
    this for the target it compiles for."""
    return torch.cuda.get_device_capability(tensor.device)


def prune_configs(kernel: str):
    """`early_config_prune` for `triton.autotune`: keep the configurations of `TUNING_SPACE[kernel]` listed for this
    device's architecture family and the launch's head-dim class."""
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}  # positional and keyword launch arguments
        allowed = allowed_entries(kernel, device_capability(args["Q"]), args["BLOCK_D"])
        kept = [c for c in configs if config_entry(c) in allowed]
        return kept or configs[:1]

    return prune


def allowed_entries(kernel: str, capability: tuple[int, int], block_d: int) -> list[tuple[int, int, int, int]]:
    return space_entries(kernel, arch_family(capability), head_dim_class(block_d))


def space_entries(kernel: str, family: str, head_dims: int) -> list[tuple[int, int, int, int]]:
    """`TUNING_SPACE[kernel][family][head_dims]`, or its replacement for the installed Triton."""
    for below, replacements in sorted(TUNING_SPACE_BEFORE_TRITON.items()):
        if TRITON_VERSION < below and (kernel, family, head_dims) in replacements:
            return replacements[kernel, family, head_dims]
    return TUNING_SPACE[kernel][family][head_dims]
