"""Ahead-of-time compilation of the fused gated-attention kernels for NVIDIA GPUs, on a machine without one.

Triton's NVIDIA backend and ptxas ship in the wheel, so `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90,
32))` runs on a CPU. To compile exactly what a launch would, the module's own launchers (`forward`, `backward`,
`decode_forward`) run on `meta` tensors with each kernel's `run` replaced by a recorder: that yields every launch
argument (strides, specialisations, heuristics, grids) without a device. Then every configuration the autotuner may
try there (its `early_config_prune` applied for the target architecture) is bound the way the JIT binds it and
compiled, and each compilation is checked:

  * it compiles;
  * shared memory within the architecture's limit per block (232,448 B on sm_90, 166,912 B on sm_80);
  * no register spills (ptxas -v);
  * MMA version: wgmma (v3) on sm_90 for the matrix products of 16-bit inputs (v2 = mma.sync on sm_80);
  * no atomics (the backward is deterministic);
  * grid within the CUDA limits.

The same numbers are given for an anchor: the Triton fused-attention tutorial's algorithm (FlashAttention-2 forward with
the off-band / on-band causal split, its autotune space and pruning rule; its fused dK/dV + dQ backward with its fixed
blocks), written anew here with pointer loads instead of the tutorial's tensor descriptors, compiled the same way.

    python benchmarks/kernel_aot.py --out DIR            # full grid, both architectures (about an hour on 2 cores)
    python benchmarks/kernel_aot.py --grid representative --arch 90 --jobs 2
    python benchmarks/kernel_aot.py --grid representative --no-anchor --json rows.json   # tests/kernel/test_kernel_aot.py

Exit status 0 when every compilation passes every check, 1 otherwise, 2 on bad arguments.
"""

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

try:
    import triton
    import triton.language as tl
except ImportError:  # main() refuses with a message
    triton = tl = None

ARCHS = {
    80: {"name": "sm_80 (A100)", "smem": 166_912},
    86: {"name": "sm_86 (A10, RTX 30xx; the 'small' tiles)", "smem": 101_376},
    90: {"name": "sm_90 (H100/H200)", "smem": 232_448},
}
DEFAULT_ARCHS = [80, 90]
KERNELS = ("forward", "preprocess", "dkdv", "dq", "decode_split", "decode_combine")


@dataclasses.dataclass(frozen=True)
class Case:
    """One launch shape: head dim, dtype, mask, gate kind, layout and which pass."""

    head_dim: int
    dtype: str  # "fp16" | "bf16"
    causal: bool
    gate: str | None  # None | "elementwise" | "headwise"
    mode: str  # "dense" | "varlen" | "decode"
    passes: str = "both"  # "forward" | "backward" | "both"
    archs: tuple[int, ...] | None = None  # compile for these of the requested architectures only (None: all)

    @property
    def label(self) -> str:
        gate = self.gate or "no gate"
        return f"D={self.head_dim} {self.dtype} {'causal' if self.causal else 'full'} {gate} {self.mode}"


def full_grid() -> list[Case]:
    return [Case(d, dt, c, g, m) for d, dt, c, g, m in itertools.product(
        (64, 128, 256), ("fp16", "bf16"), (True, False), (None, "elementwise", "headwise"), ("dense", "varlen", "decode"))
        if not (m == "decode" and not c)]  # one query against a cache: causal and full are the same launch


def production_grid() -> list[Case]:
    """The shape the model runs most: D=128, bf16, causal, elementwise G1 gate, forward and backward."""
    return [Case(128, "bf16", True, "elementwise", "dense")]


def representative_grid() -> list[Case]:
    """Every level of every factor of the full grid at least once (head dims, dtypes, masks, gate kinds, layouts,
    both passes, both architectures), each case with every tuner configuration; about two minutes on two cores
    (tests/kernel/test_kernel_aot.py)."""
    return [
        Case(128, "bf16", True, "elementwise", "dense"),  # the production shape, on both architectures
        Case(64, "fp16", False, "headwise", "varlen", archs=(80,)),
        Case(256, "bf16", True, None, "dense", archs=(90,)),
        Case(128, "fp16", True, "elementwise", "decode", passes="forward"),
        # Where Triton 3.6.0's ptxas spills a tile 3.7.1 does not (128x128 w8 s3, 8 B): its own list leaves it out.
        Case(64, "bf16", False, "headwise", "dense", passes="forward", archs=(80,)),
    ]


GRIDS = {"full": full_grid, "representative": representative_grid, "production": production_grid}


# ----------------------------------------------------------------------------------------------------------------
# Recording the launches
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    kernel: str
    tuner: object  # the triton Autotuner, or None for a fixed configuration
    jit: object  # the JITFunction
    args: tuple
    kwargs: dict
    grid: object


def kernel_objects():
    """{name: module-level kernel object} of the gated-attention kernels (imported lazily: TRITON_INTERPRET must be
    unset and the cache directory chosen first)."""
    from gated_qwen.kernel import decoding, parallel

    return {"forward": parallel.forward_kernel, "preprocess": parallel.preprocess_kernel,
            "dkdv": parallel.dkdv_kernel, "dq": parallel.dq_kernel, "decode_split": decoding.split_kernel,
            "decode_combine": decoding.combine_kernel}


def unwrap(kernel):
    """(Autotuner or None, JITFunction) below a Heuristics / Autotuner chain."""
    tuner = None
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        if isinstance(kernel, triton.runtime.autotuner.Autotuner):
            tuner = kernel
        kernel = kernel.fn
    return tuner, kernel


@contextlib.contextmanager
def recording(kernels: dict, launches: list):
    """Replace the `run` of each autotuner (or of the JIT function where nothing is tuned) by a recorder."""
    patched = []
    for name, kernel in kernels.items():
        tuner, jit = unwrap(kernel)
        target = tuner if tuner is not None else jit

        def record(*args, grid, warmup=False, _name=name, _tuner=tuner, _jit=jit, **kwargs):
            launches.append(Launch(_name, _tuner, _jit, args, kwargs, grid))

        target.run = record
        patched.append(target)
    try:
        yield
    finally:
        for target in patched:
            del target.run  # back to the class's method


def meta_inputs(case: Case, batch=2, seqlen=256, heads=8, kv_heads=2):
    """Tensors on the meta device (no memory; data_ptr 0, i.e. aligned like a fresh CUDA allocation)."""
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[case.dtype]
    d = case.head_dim

    def empty(*shape):
        return torch.empty(*shape, device="meta", dtype=dtype)

    cu_q = cu_k = None
    if case.mode == "varlen":
        lengths = [37, seqlen, 1, 100]
        cu_q = cu_k = torch.empty(len(lengths) + 1, device="meta", dtype=torch.int32)
        lead_q = lead_k = (sum(lengths),)
        max_q = max_k = max(lengths)
    elif case.mode == "decode":
        lead_q, lead_k = (batch, 1), (batch, 4 * seqlen)
        max_q, max_k = 1, 4 * seqlen
    else:
        lead_q = lead_k = (batch, seqlen)
        max_q = max_k = seqlen
    # q, k, v as Transformers hands them: [B, H, S, D] transposed to [B, S, H, D] views.
    q, k, v = (empty(*lead, h, d) for lead, h in ((lead_q, heads), (lead_k, kv_heads), (lead_k, kv_heads)))
    gate = None
    if case.gate is not None:  # a slice of a fused projection
        gate = empty(*lead_q, heads, 2 * d)[..., d:] if case.gate == "elementwise" else empty(*lead_q, heads, 1)
    return q, k, v, gate, cu_q, cu_k, max_q, max_k


def record_case(case: Case) -> list[Launch]:
    """Every kernel launch the module's launchers make for `case` (forward and/or backward)."""
    from gated_qwen.kernel.decoding import decode_forward
    from gated_qwen.kernel.parallel import backward, forward

    q, k, v, gate, cu_q, cu_k, max_q, max_k = meta_inputs(case)
    launches = []
    with recording(kernel_objects(), launches):
        if case.mode == "decode":
            out, lse = decode_forward(q, k, v, gate, 0.125, cu_q, cu_k, max_k)
        else:
            out, lse = forward(q, k, v, gate, case.causal, 0.125, cu_q, cu_k, max_q, max_k)
        if case.passes == "forward":
            launches[:] = [la for la in launches if la.kernel in ("forward", "decode_split", "decode_combine")]
        else:
            if case.passes == "backward":
                launches.clear()
            backward(out, q, k, v, gate, out, lse, case.causal, 0.125, cu_q, cu_k, max_q, max_k)
    return launches


def tuner_configs(launch: Launch, arch: int) -> list:
    """The configurations the autotuner would try on `arch` for this launch ([None] for a fixed launch)."""
    from gated_qwen.kernel import tuning

    if launch.tuner is None:
        return [None]
    original = tuning.device_capability
    tuning.device_capability = lambda tensor: (arch // 10, arch % 10)
    try:
        launch.tuner.nargs = dict(zip(launch.tuner.arg_names, launch.args))
        return list(launch.tuner.prune_configs(dict(launch.kwargs)))
    finally:
        tuning.device_capability = original
        launch.tuner.nargs = None


# ----------------------------------------------------------------------------------------------------------------
# Compiling and measuring
# ----------------------------------------------------------------------------------------------------------------


def bind(jit, args, kwargs, arch):
    """(options, signature, constexprs, attrs) exactly as `JITFunction.run` computes them for a CUDA launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    return target, jit._pack_args(backend, kwargs, bound, specialization, options), bound


def compile_and_measure(jit, args, kwargs, arch) -> dict:
    """Compile for `arch`; shared memory, registers, spills, MMA version, atomics, compile seconds (or the error)."""
    from triton.compiler import ASTSource

    target, (options, signature, constexprs, attrs), _ = bind(jit, args, kwargs, arch)
    log = io.StringIO()
    start = time.perf_counter()
    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True  # ptxas must run (and print its log) every time
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
    except Exception as err:  # a compile failure is a result, reported in the table
        return {"ok_compile": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}",
                "seconds": time.perf_counter() - start}
    ptxas = log.getvalue()
    registers = re.search(r"Used (\d+) registers", ptxas)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    ttgir = compiled.asm["ttgir"]
    mma = max((int(v) for v in re.findall(r"nvidia_mma<\{versionMajor = (\d)", ttgir)), default=0)
    dots = len(re.findall(r"tt\.dot |ttng\.warp_group_dot ", ttgir))
    return {
        "ok_compile": True,
        "shared": compiled.metadata.shared,
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": (int(spills.group(1)) + int(spills.group(2))) if spills else None,
        "mma": mma,
        "dots": dots,
        "atomics": "atomic_rmw" in compiled.asm["ttir"] or "atomic_cas" in compiled.asm["ttir"],
        "seconds": time.perf_counter() - start,
    }


def config_label(config) -> str:
    if config is None:
        return "fixed"
    return (f"{config.kwargs['BLOCK_M']}x{config.kwargs['BLOCK_N']} w{config.num_warps} s{config.num_stages}")


def evaluate_grid(launch: Launch, kwargs: dict, arch: int):
    if not callable(launch.grid):
        return tuple(launch.grid)
    _, _, bound = bind(launch.jit, launch.args, kwargs, arch)
    return tuple(launch.grid(bound))


def judge(row: dict) -> list[str]:
    """The checks a row fails (empty list: it passes)."""
    if not row["ok_compile"]:
        return ["does not compile"]
    problems = []
    if row["shared"] > ARCHS[row["arch"]]["smem"]:
        problems.append(f"shared memory {row['shared']} B > {ARCHS[row['arch']]['smem']} B")
    if row["spill_bytes"] is None or row["spill_bytes"] > 0:
        problems.append(f"register spills ({row['spill_bytes']} B)")
    if row["arch"] >= 90 and row["dots"] and row["mma"] != 3:
        problems.append(f"MMA v{row['mma']} instead of wgmma (v3)")
    if row["arch"] < 90 and row["dots"] and row["mma"] != 2:
        problems.append(f"MMA v{row['mma']} instead of mma.sync (v2)")
    if row["atomics"]:
        problems.append("uses atomics")
    grid = row["grid"]
    if grid[0] > 2**31 - 1 or any(g > 65535 for g in grid[1:]):
        problems.append(f"grid {grid} beyond CUDA limits")
    return problems


@dataclasses.dataclass(frozen=True)
class Job:
    """One compilation: the `index`-th recorded launch of `case` (or an anchor kernel), configuration `config`."""

    case: Case | None
    index: int
    config: tuple | None  # (BLOCK_M, BLOCK_N, num_warps, num_stages) or None
    arch: int
    anchor: str | None = None  # name of an anchor compilation (case is None then)


def run_job(job: Job) -> dict:
    from gated_qwen.kernel.tuning import config_entry

    if job.anchor is not None:
        return run_anchor_job(job)
    launch = record_case(job.case)[job.index]
    config = next((c for c in tuner_configs(launch, job.arch) if c is not None and config_entry(c) == job.config),
                  None)
    kwargs = dict(launch.kwargs)
    if config is not None:
        kwargs |= config.all_kwargs()
    row = {"kernel": launch.kernel, "case": job.case.label, "config": config_label(config), "arch": job.arch,
           "grid": evaluate_grid(launch, kwargs, job.arch)}
    row |= compile_and_measure(launch.jit, launch.args, kwargs, job.arch)
    row["problems"] = judge(row)
    return row


def plan_jobs(cases: list[Case], archs: list[int]) -> list[Job]:
    """One job per distinct compilation (launches that bind identically are compiled once)."""
    from gated_qwen.kernel.tuning import config_entry

    jobs, seen = [], set()
    for case in cases:
        for index, launch in enumerate(record_case(case)):
            for arch in [a for a in archs if case.archs is None or a in case.archs]:
                for config in tuner_configs(launch, arch):
                    kwargs = dict(launch.kwargs) | (config.all_kwargs() if config is not None else {})
                    _, (options, signature, constexprs, attrs), _ = bind(launch.jit, launch.args, kwargs, arch)
                    key = (launch.kernel, arch, repr(sorted(signature.items())), repr(sorted(constexprs.items())),
                           repr(sorted(attrs.items())), repr(sorted(options.__dict__.items())))
                    if key in seen:
                        continue
                    seen.add(key)
                    jobs.append(Job(case, index, config_entry(config) if config is not None else None, arch))
    return jobs


# ----------------------------------------------------------------------------------------------------------------
# Anchor: the Triton fused-attention tutorial's algorithm, written anew (pointer loads), compiled the same way
# ----------------------------------------------------------------------------------------------------------------


if triton is not None:  # the anchor's kernels (the tutorial's algorithm, written anew)


    @triton.jit
    def anchor_fwd_band(acc, l_i, m_i, q, k_base, v_base, stride_n, lo, hi, rows, offs_n, offs_d, qk_scale,
                        ON_BAND: tl.constexpr, BLOCK_N: tl.constexpr):
        for start in range(lo, hi, BLOCK_N):
            start = tl.multiple_of(start, BLOCK_N)
            k = tl.load(k_base + (start + offs_n)[None, :] * stride_n + offs_d[:, None])  # [D, BLOCK_N]
            s = tl.dot(q, k)
            if ON_BAND:  # the diagonal block: mask keys after the query
                s = s * qk_scale + tl.where(rows[:, None] >= (start + offs_n)[None, :], 0, -1.0e6)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                s -= m_new[:, None]
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
                s = s * qk_scale - m_new[:, None]
            p = tl.math.exp2(s)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + (start + offs_n)[:, None] * stride_n + offs_d[None, :])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def anchor_fwd(Q, K, V, Out, M, sm_scale, H, N_CTX, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Contiguous [B, H, N_CTX, HEAD_DIM] inputs; one program per (query block, batch·head)."""
        start_m = tl.program_id(0)
        bh = tl.program_id(1)
        base = bh.to(tl.int64) * N_CTX * HEAD_DIM
        rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + base + rows[:, None] * HEAD_DIM + offs_d[None, :])
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        qk_scale = sm_scale * 1.44269504
        if CAUSAL:
            acc, l_i, m_i = anchor_fwd_band(acc, l_i, m_i, q, K + base, V + base, HEAD_DIM, 0, start_m * BLOCK_M,
                                            rows, offs_n, offs_d, qk_scale, False, BLOCK_N)
            acc, l_i, m_i = anchor_fwd_band(acc, l_i, m_i, q, K + base, V + base, HEAD_DIM, start_m * BLOCK_M,
                                            (start_m + 1) * BLOCK_M, rows, offs_n, offs_d, qk_scale, True, BLOCK_N)
        else:
            acc, l_i, m_i = anchor_fwd_band(acc, l_i, m_i, q, K + base, V + base, HEAD_DIM, 0, N_CTX, rows, offs_n,
                                            offs_d, qk_scale, False, BLOCK_N)
        tl.store(M + bh * N_CTX + rows, m_i + tl.math.log2(l_i))
        tl.store(Out + base + rows[:, None] * HEAD_DIM + offs_d[None, :], (acc / l_i[:, None]).to(Out.dtype.element_ty))

    @triton.jit
    def anchor_bwd(Q, K, V, DO, DQ, DK, DV, M, D, sm_scale, N_CTX, HEAD_DIM: tl.constexpr, BLOCK_M1: tl.constexpr,
                   BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr):
        """Causal; one program computes dK/dV of key block pid (loop over query blocks) and then dQ of query block
        pid (loop over key blocks), as the tutorial's single backward kernel does."""
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        base = bh.to(tl.int64) * N_CTX * HEAD_DIM
        Q += base
        K += base
        V += base
        DO += base
        M += bh * N_CTX
        D += bh * N_CTX
        offs_d = tl.arange(0, HEAD_DIM)
        # dK, dV for keys [n0, n0 + BLOCK_N1)
        n0 = pid * BLOCK_N1
        cols = n0 + tl.arange(0, BLOCK_N1)
        k = tl.load(K + cols[:, None] * HEAD_DIM + offs_d[None, :])
        v = tl.load(V + cols[:, None] * HEAD_DIM + offs_d[None, :])
        dk = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
        for m0 in range(n0, N_CTX, BLOCK_M1):
            rows = m0 + tl.arange(0, BLOCK_M1)
            q_t = tl.load(Q + rows[None, :] * HEAD_DIM + offs_d[:, None])  # [D, BLOCK_M1]
            p_t = tl.math.exp2(tl.dot(k, q_t) - tl.load(M + rows)[None, :])
            p_t = tl.where(rows[None, :] >= cols[:, None], p_t, 0.0)
            do = tl.load(DO + rows[:, None] * HEAD_DIM + offs_d[None, :])
            dv += tl.dot(p_t.to(do.dtype), do)
            ds_t = p_t * (tl.dot(v, tl.trans(do)) - tl.load(D + rows)[None, :])
            dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t))
        tl.store(DV + base + cols[:, None] * HEAD_DIM + offs_d[None, :], dv.to(DV.dtype.element_ty))
        tl.store(DK + base + cols[:, None] * HEAD_DIM + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty))
        # dQ for queries [m0, m0 + BLOCK_M2)
        m0 = pid * BLOCK_M2
        rows = m0 + tl.arange(0, BLOCK_M2)
        q = tl.load(Q + rows[:, None] * HEAD_DIM + offs_d[None, :])
        do = tl.load(DO + rows[:, None] * HEAD_DIM + offs_d[None, :])
        lse = tl.load(M + rows)
        delta = tl.load(D + rows)
        dq = tl.zeros([BLOCK_M2, HEAD_DIM], dtype=tl.float32)
        for n0 in range(0, m0 + BLOCK_M2, BLOCK_N2):
            keys = n0 + tl.arange(0, BLOCK_N2)
            k_t = tl.load(K + keys[None, :] * HEAD_DIM + offs_d[:, None])
            v_t = tl.load(V + keys[None, :] * HEAD_DIM + offs_d[:, None])
            p = tl.math.exp2(tl.dot(q, k_t) - lse[:, None])
            p = tl.where(rows[:, None] >= keys[None, :], p, 0.0)
            ds = p * (tl.dot(do, v_t) - delta[:, None])
            dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t))
        tl.store(DQ + base + rows[:, None] * HEAD_DIM + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty))


# The tutorial's forward autotune space on Hopper and its pruning rule (8 warps only for tiles of >= 128 x 128).
ANCHOR_FWD_SPACE = [(bm, bn, w, s) for bm in (64, 128) for bn in (32, 64, 128) for s in (2, 3, 4, 6) for w in (4, 8)
                    if not (bm * bn < 128 * 128 and w == 8)]
ANCHOR_BWD_CONFIG = {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "num_warps": 4,
                     "num_stages": 5}


def anchor_jobs(archs: list[int], head_dim=128) -> list[Job]:
    jobs = []
    for arch in archs:
        for causal in (True, False):
            jobs += [Job(None, int(causal), entry, arch, anchor="tutorial forward") for entry in ANCHOR_FWD_SPACE]
        jobs.append(Job(None, 1, None, arch, anchor="tutorial backward"))
    return jobs


def run_anchor_job(job: Job, batch=2, heads=8, seqlen=2048, head_dim=128) -> dict:
    import torch

    def empty(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, device="meta", dtype=dtype)

    x = [empty(batch, heads, seqlen, head_dim) for _ in range(7)]
    lse = empty(batch * heads * seqlen, dtype=torch.float32)
    if job.anchor == "tutorial forward":
        bm, bn, warps, stages = job.config
        jit, causal = anchor_fwd, bool(job.index)
        args = (x[0], x[1], x[2], x[3], lse, 0.125, heads, seqlen)
        kwargs = {"HEAD_DIM": head_dim, "CAUSAL": causal, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps,
                  "num_stages": stages}
        grid = (seqlen // bm, batch * heads)
        label, case = f"{bm}x{bn} w{warps} s{stages}", f"D={head_dim} bf16 {'causal' if causal else 'full'}"
    else:
        jit = anchor_bwd
        args = (*x, lse, lse, 0.125, seqlen)
        kwargs = {"HEAD_DIM": head_dim} | ANCHOR_BWD_CONFIG
        grid = (seqlen // ANCHOR_BWD_CONFIG["BLOCK_N1"], batch * heads)
        label, case = "32/128, 128/32 w4 s5", f"D={head_dim} bf16 causal"
    row = {"kernel": job.anchor, "case": case, "config": label, "arch": job.arch, "grid": grid}
    row |= compile_and_measure(jit, args, kwargs, job.arch)
    row["problems"] = judge(row)
    return row


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def summary_table(rows: list[dict]) -> str:
    """Per kernel and architecture: compilations, failures, max shared memory, max registers, spills, MMA versions."""
    lines = ["| kernel | arch | compilations | pass | max shared (B) | limit (B) | max registers | with spills | "
             "MMA | max compile s |", "|---|---|---|---|---|---|---|---|---|---|"]
    order = list(KERNELS) + ["tutorial forward", "tutorial backward"]
    for kernel, arch in itertools.product(order, sorted(ARCHS)):
        group = [r for r in rows if r["kernel"] == kernel and r["arch"] == arch]
        if not group:
            continue
        ok = [r for r in group if r["ok_compile"]]
        mmas = sorted({f"v{r['mma']}" if r["mma"] else "none" for r in ok})
        lines.append(
            f"| {kernel} | sm_{arch} | {len(group)} | {sum(not r['problems'] for r in group)} | "
            f"{max((r['shared'] for r in ok), default=0):,} | {ARCHS[arch]['smem']:,} | "
            f"{max((r['registers'] or 0 for r in ok), default=0)} | "
            f"{sum(1 for r in ok if (r['spill_bytes'] or 0) > 0)} | {', '.join(mmas)} | "
            f"{max(r['seconds'] for r in group):.1f} |")
    return "\n".join(lines)


def config_table(rows: list[dict]) -> str:
    """Per kernel, architecture and configuration: the worst case over the grid."""
    lines = ["| kernel | arch | config | cases | max shared (B) | max registers | max spill (B) | MMA | problems |",
             "|---|---|---|---|---|---|---|---|---|"]
    keyed: dict = {}
    for r in rows:
        keyed.setdefault((r["kernel"], r["arch"], r["config"]), []).append(r)
    order = {k: i for i, k in enumerate(list(KERNELS) + ["tutorial forward", "tutorial backward"])}
    for (kernel, arch, config), group in sorted(keyed.items(), key=lambda kv: (order[kv[0][0]], kv[0][1], kv[0][2])):
        ok = [r for r in group if r["ok_compile"]]
        problems = sorted({p for r in group for p in r["problems"]})
        mmas = sorted({f"v{r['mma']}" if r["mma"] else "none" for r in ok})
        lines.append(
            f"| {kernel} | sm_{arch} | {config} | {len(group)} | {max((r['shared'] for r in ok), default=0):,} | "
            f"{max((r['registers'] or 0 for r in ok), default=0)} | "
            f"{max((r['spill_bytes'] or 0 for r in ok), default=0):,} | {', '.join(mmas)} | "
            f"{'; '.join(problems) or '-'} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", choices=sorted(GRIDS), default="full")
    p.add_argument("--arch", type=int, nargs="+", choices=sorted(ARCHS), default=DEFAULT_ARCHS)
    p.add_argument("--head-dims", type=int, nargs="+", choices=(64, 128, 256), default=None,
                   help="restrict the grid to these head dims")
    p.add_argument("--no-anchor", action="store_true", help="skip the tutorial anchor")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="compiler processes")
    p.add_argument("--json", type=Path, default=None, help="write every row as JSON to this file")
    p.add_argument("--out", type=Path, default=None, help="write rows.json and results.md into this new folder")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out is not None and args.out.exists():
        print(f"kernel_aot.py: error: {args.out} exists; choose a new folder", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("kernel_aot.py: error: TRITON_INTERPRET=1 is set; ahead-of-time compilation needs the compiled kernels "
              "(unset it)", file=sys.stderr)
        return 2
    if triton is None:
        print("kernel_aot.py: error: Triton is not installed (pip install -e '.[triton]')", file=sys.stderr)
        return 2
    cases = GRIDS[args.grid]()
    if args.head_dims:
        cases = [c for c in cases if c.head_dim in args.head_dims]
    started = time.perf_counter()
    jobs = plan_jobs(cases, args.arch) + ([] if args.no_anchor else anchor_jobs(args.arch))
    print(f"{len(jobs)} compilations ({len(cases)} cases, archs {args.arch}, {args.jobs} processes)", flush=True)
    rows = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for row in pool.map(run_job, jobs):
            rows.append(row)
            if row["problems"]:
                print(f"  FAIL {row['kernel']} sm_{row['arch']} {row['config']} [{row['case']}]: "
                      f"{'; '.join(row['problems'])} {row.get('error', '')}", flush=True)
    elapsed = time.perf_counter() - started
    failed = [r for r in rows if r["problems"]]
    report = (f"### Ahead-of-time compilation ({args.grid} grid, Triton {triton.__version__}, ptxas from the wheel)\n\n"
              f"{len(rows)} compilations in {elapsed:.0f} s, {len(failed)} failing a check.\n\n"
              f"{summary_table(rows)}\n\n#### Worst case per configuration\n\n{config_table(rows)}\n\n"
              f"command: python benchmarks/kernel_aot.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(report)
    for path, text in ((args.json, json.dumps(rows, indent=1)),):
        if path is not None:
            path.write_text(text)
    if args.out is not None:
        tmp = Path(tempfile.mkdtemp(prefix=args.out.name + ".", dir=args.out.parent))
        (tmp / "rows.json").write_text(json.dumps(rows, indent=1))
        (tmp / "results.md").write_text(report + "\n")
        tmp.rename(args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    # A private compiler cache: ptxas must run for its register report, and nothing is left behind.
    with tempfile.TemporaryDirectory(prefix="kernel_aot_cache.") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        sys.exit(main())
