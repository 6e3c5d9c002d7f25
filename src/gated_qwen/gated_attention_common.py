"""What the fused gated-attention kernel modules share on the host side: the optional Triton import, the interpreter
switch, the block configurations the autotuner may try on each GPU architecture, and launch helpers.

Triton is optional: without it this module still imports (`triton` is None) and the kernel modules, which define
their `@triton.jit` functions at module level, are simply not imported (see `gated_attention.py`).
Relative imports only: the kernel files are copied to the Hugging Face Hub beside the modeling file.
"""

import inspect
import os
import re

import torch

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: BaseException | None = None
except ImportError as _err:  # the package must import on machines without Triton
    triton = None
    tl = None
    TRITON_IMPORT_ERROR = _err

# Read once at import: `@triton.jit` captures the interpreter switch when the kernels are defined.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
# `tl.math.fdiv(..., approx=True)` (div.approx.f32) exists from Triton 3.9; Triton 3.7 (torch 2.13's CUDA pin) has no
# `approx`, and its plain `fdiv` lowers to div.full.f32 (also within 2 ulp, no slow-path subroutine).
HAS_APPROX_FDIV = triton is not None and "approx" in inspect.signature(tl.math.fdiv).parameters
TRITON_VERSION = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:2]) if triton is not None else (0, 0)


def _interpreter_scalar_index_fix() -> None:
    """Let loops with run-time bounds (`for start_n in range(lo, hi, BLOCK_N)`) run under the interpreter of
    Triton < 3.7 with NumPy >= 2.4.

    That interpreter holds a scalar as a one-element array and turns it into a Python int with `int(array)`, which
    NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"); Triton 3.7 squeezes the
    array first. This wraps the interpreter's patching of `tl.tensor` (redone at every kernel call; 3.6 undoes it
    after the call) to squeeze the same way. It touches the interpreter only: compiled kernels are unaffected."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "squeezes_scalars", False):  # a second copy of this module (Hub remote code)
        return

    def patch_tensor_with_squeeze(tensor, *scope):  # 3.6 passes the scope that undoes the patch; 3.5 none
        patch_tensor(tensor, *scope)
        index = lambda self: int(self.handle.data.squeeze())
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patch_tensor_with_squeeze.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_tensor_with_squeeze


if triton is not None and INTERPRET and TRITON_VERSION < (3, 7):
    _interpreter_scalar_index_fix()
# CUDA grid limits: axis 0 up to 2**31 - 1 programs, axes 1 and 2 up to 65535. Every launch puts
# (blocks per sequence × sequences) on axis 0 and heads on axis 1.
MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535


def triton_available() -> bool:
    """True when Triton is importable and the kernels can run somewhere: on a CUDA GPU, or under the interpreter."""
    return triton is not None and (INTERPRET or torch.cuda.is_available())


# --------------------------------------------------------------------------------------------------------------------
# Block configurations per GPU architecture
# --------------------------------------------------------------------------------------------------------------------
#
# (BLOCK_M, BLOCK_N, num_warps, num_stages) that the autotuner may try, per kernel, architecture family and head-dim
# class (BLOCK_D: 64 for D <= 64, 128, 256). Every entry compiles ahead of time (tests/test_kernel_aot.py,
# tests/kernel_aot.py) within the architecture's shared memory, without register spills, and with wgmma (MMA v3)
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
# Triton (tests/kernel_aot.py, benchmarks/RESULTS.md).
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
    """Compute capability of the GPU holding `tensor`. Ahead-of-time compilation (tests/kernel_aot.py) swaps
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


# --------------------------------------------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------------------------------------------


def flag_heuristics(*, gate: str | None = "G", headwise: bool = True, upcast_from: str | None = "Q") -> dict:
    """`triton.heuristics` values derived from the launch arguments: BLOCK_D (the head dim padded to a power of two,
    at least 16 for tl.dot), IS_VARLEN (cu_seqlens given), HAS_GATE / GATE_HEADWISE (a gate given; one logit per
    head, for kernels that treat it apart), UPCAST (bf16 tiles are computed in fp32 under the interpreter, whose bf16
    arithmetic is wrong)."""
    values = {
        "BLOCK_D": lambda args: max(16, triton.next_power_of_2(args["HEAD_DIM"])),
        "IS_VARLEN": lambda args: args["cu_seqlens_q"] is not None,
    }
    if upcast_from is not None:
        values["UPCAST"] = lambda args: INTERPRET and args[upcast_from].dtype == torch.bfloat16
    if gate is not None:
        values["HAS_GATE"] = lambda args: args[gate] is not None
    if gate is not None and headwise:
        values["GATE_HEADWISE"] = lambda args: (
            args[gate] is not None and args[gate].shape[-1] == 1 and args["HEAD_DIM"] != 1)
    return values


def strides4(t: torch.Tensor | None, packed: bool) -> tuple[int, int, int, int]:
    """(batch, row, head, dim) strides of `[B, S, H, D]`, or of a packed `[T, H, D]` tensor with batch stride 0 (its
    rows come from cu_seqlens). A headwise gate `[..., 1]` gets dim stride 0; None gets zeros."""
    if t is None:
        return (0, 0, 0, 0)
    strides = ((0,) if packed else ()) + tuple(t.stride())
    return strides[:3] + ((0,) if t.shape[-1] == 1 else (strides[3],))


def lse_strides(lse: torch.Tensor, packed: bool, seqlen_q: int) -> tuple[int, int]:
    """(head, batch) strides of the logsumexp `[Hq, rows]`: row of (b, i) is `b · seqlen_q + i` (dense) or the
    packed row (varlen, batch stride 0)."""
    return (lse.stride(0), 0 if packed else seqlen_q)


def seq_bucket(n: int) -> int:
    """Autotune key for a sequence length: the next power of two, so the tuner runs once per size class (not once per
    length) and a short self-check problem does not decide the tiles of a long one."""
    return 1 << max(int(n) - 1, 0).bit_length()


def grid_2d(blocks_per_sequence: int, n_batch: int, heads: int) -> tuple[int, int]:
    """The grid `(blocks × sequences, heads)`; raises if a CUDA limit would be exceeded instead of launching wrong."""
    grid = (blocks_per_sequence * n_batch, heads)
    if grid[0] > MAX_GRID_X or grid[1] > MAX_GRID_YZ:
        raise ValueError(f"launch grid {grid} exceeds the CUDA limits ({MAX_GRID_X}, {MAX_GRID_YZ}): "
                         f"{n_batch} sequences × {blocks_per_sequence} blocks, {heads} heads")
    return grid
