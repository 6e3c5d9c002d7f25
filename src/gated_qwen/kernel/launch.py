"""The host side of every kernel launch: the optional Triton import, the interpreter switch, and the launch
arguments the forward, backward and decode kernels share (heuristics, strides, grid limits, autotune keys).

Triton is optional: without it this module still imports (`triton` is None, `triton_available()` is False) and the
kernel modules, which define their `@triton.jit` functions at module level, are not imported (see `__init__.py`).
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
# Floating-point fusion (a multiply and an add into one FMA), given to every launch as `enable_fp_fusion`: on, as the
# kernels were checked. Triton before 3.10 fuses by default, 3.9 warns at each compile that the default changes in 3.10
# unless a launch names it (or TRITON_DEFAULT_FP_FUSION is set); the interpreter ignores it.
FP_FUSION = True


def _interpreter_scalar_index_fix() -> None:
    """Let loops with run-time bounds (`for start_n in range(lo, hi, BLOCK_N)`) run under the interpreter of
    Triton < 3.7 with NumPy >= 2.4.

    That interpreter holds a scalar as a one-element array and turns it into a Python int with `int(array)`, which
    NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"); Triton 3.7 squeezes the
    array first. This wraps the interpreter's patching of `tl.tensor` (redone at every kernel call; 3.6 undoes it
    after the call) to squeeze the same way. It touches the interpreter only: compiled kernels are unaffected."""
    from triton.runtime import interpreter  # only under TRITON_INTERPRET

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "squeezes_scalars", False):  # a second copy (the kernel of a folder saved by gated_qwen 0.1)
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
# Launch helpers
# --------------------------------------------------------------------------------------------------------------------


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
