"""One command on a lent GPU: is the fused gated-attention kernel correct there, and how fast is it?

1. Correctness over the grid (exit status 1 on any failure): head dims 64/128/256, fp16/bf16, causal/non-causal,
   gate none/elementwise/headwise, dense, packed varlen with unequal query/key lengths, decode against a cache,
   GQA 1/4/8; output and every gradient against the PyTorch reference in fp64.
   Then the Hub kernel (exit status 1 on any failure): the repository `make kernel-repo` builds from the same source
   (`gated_qwen.integrations.kernel_hub`, written to a temporary folder), loaded with `kernels.get_local_kernel` as
   a saved folder's own code loads it from the Hub; its `gated_attention` on a few of the grid's cases against the
   fp64 reference, and its output against the package's `gated_attention` on the same inputs.
2. Kernel throughput, TFLOP/s forward, backward and forward+backward (bf16, causal, D=128, 16 heads, B·S = 16k
   tokens, S = 1k…16k): the kernel; PyTorch SDPA (fastest of its flash / cuDNN / memory-efficient backends) followed by
   a separate `* sigmoid(gate)`, as Transformers applies the gate; FlashAttention + gate when `flash_attn` is installed.
   FLOPs: forward 4·B·H·S²·D, halved when causal; backward 2.5×; forward+backward 3.5×. Per length also what the
   default attention (`gated_triton`) chose for these inputs with gradients, by its own measurement (the fused kernel
   or SDPA + gate, kernel/choice.py), and the two times it measured (in a cache folder of this run's).
3. End to end: a GatedQwen with the paper's 1.7B widths (hidden 2048, 16 query / 8 key-value heads of 128, MLP 6144,
   G1 elementwise gate) and a few layers, bf16: training step (forward, backward, AdamW) and greedy decode, tokens/s,
   `attn_implementation="gated_triton"` vs `"sdpa"`, and the gated_triton backend's self-check verdicts and choices.

Writes DIR/results.json and DIR/results.md (GPU, driver, versions, every figure, the seconds of each phase) and
prints the markdown. Before step 1 every kernel configuration the grid, step 2 and step 3's model launch is compiled
in parallel (one process per CPU core) into Triton's cache, so the run fits in 8 minutes on an H200.

`--budget SECONDS` bounds the run: the steps go in order of importance (correctness, then throughput, then end to
end), and a piece of work (a correctness case, a sequence length, the end-to-end run) starts only while the budget
left covers what it is expected to take (`EXPECTED_SECONDS`, for an H200); the rest is listed as skipped. SIGTERM
(a watchdog's) stops the run and writes what it has, the rest listed as skipped.

    python benchmarks/gpu_check.py --out DIR                # on a CUDA GPU (also: make gpu-check)
    python benchmarks/gpu_check.py --interpret --out DIR    # CPU, Triton interpreter, tiny sizes: checks this script
                                                            # and the kernel's CPU behaviour, measures nothing
    bash benchmarks/gpu_check_device.sh --out DIR           # on the project's GPU machine, as it is (no venv)

Exit status: 0 all checks pass, 1 a correctness check failed (the figures are still written), 2 bad arguments or no
GPU (one line on stderr), 3 every check run passed but some were skipped (budget or SIGTERM).
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Goals the figures are reported against (benchmarks/RESULTS.md; H100/H200, bf16, causal, D=128).
GOALS = {"forward_tflops": 450.0, "backward_tflops": 300.0, "fwd_bwd_vs_sdpa_gate": 1.1, "goal_min_seqlen": 2048}
# Bounds on max |kernel − reference| / max |reference| per tensor against the fp64 reference.
BOUND = {"fp16": 5e-3, "bf16": 4e-2, "fp32": 1e-5}
# What a piece of work is expected to take on an H200 after the parallel compilation (first-use autotuning
# included): one starts only while the budget left covers it. Estimates from the counts (65 cases, 290 tuner
# configurations benchmarked at about 0.15 s each, 12 timed functions per sequence length), not yet measured.
EXPECTED_SECONDS = {"correctness case": 3, "hub kernel case": 10, "throughput size": 15, "end to end": 90}


class Budget:
    """The seconds left of the run (`None`: no limit), and what was skipped for want of them."""

    def __init__(self, seconds: float | None):
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.skipped: list[str] = []

    def left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def allows(self, what: str, kind: str) -> bool:
        """True if `what` (a piece of work of `kind`, a key of EXPECTED_SECONDS) fits; else records it as skipped."""
        if self.left() >= EXPECTED_SECONDS[kind]:
            return True
        self.skipped.append(f"{what} ({self.left():.0f} s of the budget left, about {EXPECTED_SECONDS[kind]} s needed)")
        return False


class Stopped(BaseException):
    """SIGTERM arrived (the device script's watchdog): write what was measured. A BaseException, so that the checks'
    `except Exception` (a failing case is a result) does not swallow it."""


def _stop(signum, frame):
    raise Stopped(f"signal {signum}")


def run_items(items: list, kind: str, budget: Budget, done: list, labels: set) -> None:
    """Run `(label, work)` pairs in order while the budget allows each, appending results to `done` and the labels
    of what ran to `labels`."""
    for label, work in items:
        if budget.allows(label, kind):
            done.append(work())
            labels.add(label)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="new folder for results.json and results.md")
    p.add_argument("--interpret", action="store_true",
                   help="CPU under the Triton interpreter with tiny sizes (checks the script; timings meaningless)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the end-to-end model (default 4; 2)")
    p.add_argument("--jobs", type=int, default=None, help="compiler processes (default: one per CPU core)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds the whole run may take; work that would not fit is skipped and listed (default: none)")
    args = p.parse_args(argv)
    if args.budget is not None and not args.budget > 0:
        p.error(f"--budget must be a number of seconds > 0, got {args.budget:g}")
    return args


# ----------------------------------------------------------------------------------------------------------------
# Problems: one constructor for the correctness grid and the throughput sizes, on any device (meta for warm-up)
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
    head_dim: int
    dtype: str  # fp16 | bf16 | fp32 (fp32 only under the interpreter)
    causal: bool
    gate: str | None  # None | elementwise | headwise
    layout: str  # dense | varlen | decode | varlen-decode
    h_q: int = 8
    h_kv: int = 2
    batch: int = 2
    seq: int = 257
    backward: bool = True

    @property
    def label(self) -> str:
        return (f"D={self.head_dim} {self.dtype} {'causal' if self.causal else 'full'} {self.gate or 'no gate'} "
                f"{self.layout} Hq={self.h_q} Hkv={self.h_kv}")


def correctness_grid(interpret: bool) -> list[Problem]:
    if interpret:  # a few cases on tiny sizes: the interpreter is slow
        return [
            Problem(64, "fp16", True, "elementwise", "dense", seq=70),
            Problem(64, "bf16", False, "headwise", "dense", h_q=4, h_kv=4, seq=70),
            Problem(64, "fp16", True, "elementwise", "varlen", seq=70),
            Problem(64, "fp32", True, "headwise", "decode", seq=150),
            Problem(64, "fp16", True, None, "varlen-decode", seq=100, backward=False),
        ]
    grid = [Problem(d, dt, c, g, "dense") for d in (64, 128, 256) for dt in ("fp16", "bf16") for c in (True, False)
            for g in (None, "elementwise", "headwise")]
    grid += [Problem(d, "bf16", True, g, "varlen") for d in (64, 128, 256) for g in ("elementwise", "headwise")]
    grid.append(Problem(128, "fp16", False, None, "varlen"))
    grid += [Problem(d, dt, True, g, "decode", batch=3, seq=1000, backward=False) for d in (64, 128, 256)
             for dt in ("fp16", "bf16") for g in (None, "elementwise", "headwise")]
    grid.append(Problem(128, "bf16", True, "elementwise", "decode", batch=3, seq=1000))  # decode backward
    grid.append(Problem(128, "bf16", True, "elementwise", "varlen-decode", seq=1000, backward=False))
    grid += [Problem(128, "bf16", True, "elementwise", "dense", h_q=hq, h_kv=hkv) for hq, hkv in ((8, 8), (16, 2))]
    return grid


def build(problem: Problem, device, seed: int | None = 0):
    """(q, k, v, gate, dy, kwargs of gated_attention) for `problem` on `device`; `seed=None` leaves them empty (for
    compiling: only shapes, strides and dtypes matter). The gate is a slice of a fused projection, as in the model."""
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[problem.dtype]
    gen = None if seed is None else torch.Generator().manual_seed(seed)

    def make(*shape):
        if gen is None:
            return torch.empty(*shape, dtype=dtype, device=device)
        return torch.randn(*shape, generator=gen).to(device, dtype)

    s, d = problem.seq, problem.head_dim
    kwargs = {"causal": problem.causal}
    if problem.layout.startswith("varlen"):
        lens_q = [1, 1, 1, 1] if problem.layout == "varlen-decode" else [s // 2, 1, s, 64]
        lens_k = [s // 2 + 20, 9, s, 64] if problem.layout == "varlen" else [s, 37, 1, s // 3]
        cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32, device=device)
                      for n in (lens_q, lens_k))
        lead_q, lead_k = (sum(lens_q),), (sum(lens_k),)
        kwargs |= {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max(lens_q), "max_seqlen_k": max(lens_k)}
    elif problem.layout == "decode":
        lead_q, lead_k = (problem.batch, 1), (problem.batch, s)
    else:
        lead_q = lead_k = (problem.batch, s)
    # q, k, v as Transformers hands them: [B, H, S, D] projections viewed as [B, S, H, D].
    q, k, v = (make(*lead[:-1], h, lead[-1], d).transpose(-3, -2) if len(lead) == 2 else make(*lead, h, d)
               for lead, h in ((lead_q, problem.h_q), (lead_k, problem.h_kv), (lead_k, problem.h_kv)))
    gate = None
    if problem.gate == "elementwise":
        gate = make(*lead_q, problem.h_q, 2 * d)[..., d:]
    elif problem.gate == "headwise":
        gate = make(*lead_q, problem.h_q, 1)
    return q, k, v, gate, make(*lead_q, problem.h_q, d), kwargs


def max_lengths(q, k, kwargs):
    if "cu_seqlens_q" in kwargs:
        return kwargs["max_seqlen_q"], kwargs["max_seqlen_k"]
    return q.shape[1], k.shape[1]


# ----------------------------------------------------------------------------------------------------------------
# Parallel compilation into Triton's cache (GPU only)
# ----------------------------------------------------------------------------------------------------------------


def record(problem: Problem, device) -> list:
    """The kernel launches (benchmarks/kernel_aot.py's recorder) that forward and backward make for `problem`."""
    import kernel_aot

    from gated_qwen.kernel.decoding import decode_forward
    from gated_qwen.kernel.parallel import backward, forward

    q, k, v, gate, dy, kwargs = build(problem, device, seed=None)
    max_q, max_k = max_lengths(q, k, kwargs)
    cu_q, cu_k = kwargs.get("cu_seqlens_q"), kwargs.get("cu_seqlens_k")
    scale = 1 / math.sqrt(problem.head_dim)
    launches = []
    with kernel_aot.recording(kernel_aot.kernel_objects(), launches):
        if max_q == 1:
            out, lse = decode_forward(q, k, v, gate, scale, cu_q, cu_k, max_k)
        else:
            out, lse = forward(q, k, v, gate, problem.causal, scale, cu_q, cu_k, max_q, max_k)
        if problem.backward:
            backward(dy, q, k, v, gate, out, lse, problem.causal, scale, cu_q, cu_k, max_q, max_k)
    return launches


def _warm_up(job) -> str | None:
    """Worker: compile one configuration of one launch through the JIT itself (`warmup`), on CUDA tensors of the
    real shapes, so the cache entry is exactly the one the real launch looks up. None, or the error (a failure to
    compile is reported by the correctness step, which launches the same kernel)."""
    problem, index, entry, arch = job
    import kernel_aot

    from gated_qwen.kernel.tuning import config_entry

    try:
        launch = record(problem, "cuda")[index]
        config = next((c for c in kernel_aot.tuner_configs(launch, arch)
                       if c is not None and config_entry(c) == entry), None)
        kwargs = dict(launch.kwargs) | (config.all_kwargs() if config is not None else {})
        launch.jit.warmup(*launch.args, grid=(1,), **kwargs)
    except Exception as err:  # reported, not fatal: the kernel compiles again (and fails visibly) on first use
        return f"{launch.kernel if 'launch' in locals() else '?'} {entry} [{problem.label}]: {type(err).__name__}: " \
               f"{str(err).splitlines()[0][:200] if str(err) else ''}"
    return None


def compile_ahead(problems: list[Problem], jobs: int, seconds: float) -> dict:
    """Compile every distinct (kernel, specialisation, configuration) the problems launch, in parallel processes,
    into Triton's cache; launches that bind identically (decided on meta tensors here) are compiled once. Stops
    handing out work after `seconds` (what is left compiles on first use, one at a time)."""
    import multiprocessing
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

    import kernel_aot
    import torch

    from gated_qwen.kernel.tuning import config_entry

    started = time.perf_counter()
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    work, seen = [], set()
    for problem in problems:
        for index, launch in enumerate(record(problem, "meta")):
            for config in kernel_aot.tuner_configs(launch, arch):
                kwargs = dict(launch.kwargs) | (config.all_kwargs() if config is not None else {})
                _, (options, signature, constexprs, attrs), _ = kernel_aot.bind(launch.jit, launch.args, kwargs, arch)
                key = (launch.kernel, repr(signature), repr(constexprs), repr(attrs), repr(options))
                if key not in seen:
                    seen.add(key)
                    work.append((problem, index, config_entry(config) if config is not None else None, arch))
    planned = time.perf_counter() - started
    context = multiprocessing.get_context("spawn")  # CUDA does not survive fork
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=context)
    futures = [pool.submit(_warm_up, job) for job in work]
    try:
        done, pending = wait(futures, timeout=max(seconds - planned, 0), return_when=FIRST_EXCEPTION)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    errors = [f.result() if f.exception() is None else f"{type(f.exception()).__name__}: {f.exception()}"
              for f in done]
    return {"compilations": len(work), "compiled": sum(e is None for e in errors), "failed": [e for e in errors if e],
            "unfinished": len(pending), "seconds": round(time.perf_counter() - started, 1),
            "planning_seconds": round(planned, 1), "processes": jobs}


# ----------------------------------------------------------------------------------------------------------------
# 1. Correctness
# ----------------------------------------------------------------------------------------------------------------


def check(problem: Problem, device: str, gated_attention=None) -> dict:
    """One case: `gated_attention` (default: the package's kernel) against the fp64 reference, output and every
    gradient."""
    from gated_qwen.kernel import naive_gated_attention

    if gated_attention is None:
        from gated_qwen.kernel import gated_attention
    q, k, v, gate, dy, kwargs = build(problem, device)
    inputs = [t for t in (q, k, v, gate) if t is not None]
    names = ["dq", "dk", "dv"] + (["dgate"] if gate is not None else [])
    row = {"case": problem.label}
    try:
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = gated_attention(*leaves[:3], leaves[3] if gate is not None else None, **kwargs)
        ref_leaves = [t.detach().double().requires_grad_() for t in inputs]
        ref = naive_gated_attention(*ref_leaves[:3], ref_leaves[3] if gate is not None else None, **kwargs)
        if problem.backward:
            out.backward(dy)
            ref.backward(dy.double())
        errors = {"out": _rel_err(out, ref)}
        if problem.backward:
            errors |= {n: _rel_err(a.grad, b.grad) for n, a, b in zip(names, leaves, ref_leaves)}
        row["errors"] = errors
        row["ok"] = all(math.isfinite(e) and e <= BOUND[problem.dtype] for e in errors.values())
    except Exception as err:  # reported as a failing row
        row["errors"], row["ok"], row["error"] = {}, False, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return row


def _rel_err(actual, expected) -> float:
    actual, expected = actual.double(), expected.double()
    if not bool(actual.isfinite().all()):
        return float("inf")
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


# ----------------------------------------------------------------------------------------------------------------
# 1b. The Hub kernel: built from the same source, loaded by `kernels`, held to the reference and to the package's
# ----------------------------------------------------------------------------------------------------------------


def hub_kernel_problems(interpret: bool) -> list[Problem]:
    if interpret:
        return [Problem(64, "fp16", True, "elementwise", "dense", seq=70),
                Problem(64, "fp32", True, "headwise", "varlen", seq=70)]
    return [Problem(128, "bf16", True, "elementwise", "dense"), Problem(128, "bf16", True, "headwise", "varlen"),
            Problem(128, "bf16", True, "elementwise", "decode", batch=3, seq=1000, backward=False)]


@functools.cache
def hub_kernel():
    """The Hub kernel's module: `kernel_hub.write_kernel_repo` into a temporary folder (removed at exit), loaded with
    `kernels.get_local_kernel`."""
    import atexit
    import shutil

    import kernels

    from gated_qwen.integrations import kernel_hub

    folder = Path(tempfile.mkdtemp(prefix="gated-qwen-kernel-repo."))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return kernels.get_local_kernel(kernel_hub.write_kernel_repo(folder / "kernel-repo"))


def check_hub_kernel(problem: Problem, device: str) -> dict:
    """`check` of the Hub module's `gated_attention`, and its output against the package's on the same inputs
    (`vs_package`: max |hub − package| / max |package|; the two copies tune separately, so not always bit-equal)."""
    from gated_qwen.kernel import gated_attention as package_attention

    try:
        hub = hub_kernel()
        if hub.gated_attention is package_attention:
            raise RuntimeError("the Hub module's gated_attention is the package's")
    except Exception as err:  # reported as a failing row
        return {"case": problem.label, "errors": {}, "ok": False, "error": f"{type(err).__name__}: {err}"[:300]}
    row = check(problem, device, hub.gated_attention) | {"module": hub.__name__}
    if row["ok"]:
        q, k, v, gate, _, kwargs = build(problem, device)
        row["vs_package"] = _rel_err(hub.gated_attention(q, k, v, gate, **kwargs),
                                     package_attention(q, k, v, gate, **kwargs))
        row["ok"] = row["vs_package"] <= BOUND[problem.dtype]
    return row


# ----------------------------------------------------------------------------------------------------------------
# 2. Kernel throughput
# ----------------------------------------------------------------------------------------------------------------


def bench_ms(fn, device, grad_to_none=None) -> float:
    """Median milliseconds: triton.testing.do_bench on a GPU, a few wall-clock runs under the interpreter."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none)
    fn()
    times = []
    for _ in range(2):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def time_fwd_bwd(forward, inputs, dy, device):
    """(forward ms, backward ms, forward+backward ms) of `forward(*inputs)`."""
    fwd = bench_ms(lambda: forward(*inputs), device)
    out = forward(*inputs)
    bwd = bench_ms(lambda: out.backward(dy, retain_graph=True), device, grad_to_none=list(inputs))

    def step():
        forward(*inputs).backward(dy)

    return fwd, bwd, bench_ms(step, device, grad_to_none=list(inputs))


def sdpa_backends(device):
    if device != "cuda":
        return [("default", contextlib.nullcontext)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return [(name, lambda be=be: sdpa_kernel(be)) for name, be in
            (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
             ("mem-efficient", SDPBackend.EFFICIENT_ATTENTION))]


def throughput_problems(interpret: bool) -> list[Problem]:
    tokens, seqlens = (256, (64, 128)) if interpret else (16384, (1024, 2048, 4096, 8192, 16384))
    heads, d = (2, 64) if interpret else (16, 128)
    return [Problem(d, "bf16", True, "elementwise", "dense", h_q=heads, h_kv=heads, batch=max(1, tokens // s), seq=s)
            for s in seqlens]


def measure_throughput(problem: Problem, device: str) -> dict:
    """TFLOP/s forward, backward, forward+backward of the kernel and of SDPA + a separate gate on `problem`."""
    import torch
    import torch.nn.functional as F

    from gated_qwen.kernel import gated_attention

    try:
        from flash_attn import flash_attn_func
    except ImportError:
        flash_attn_func = None

    def ours(q, k, v, g):
        return gated_attention(q, k, v, g, causal=True)

    def sdpa_then_gate(q, k, v, g):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2) * torch.sigmoid(g)

    def flash_then_gate(q, k, v, g):
        return flash_attn_func(q, k, v, causal=True) * torch.sigmoid(g)

    q, k, v, gate, dy, _ = build(problem, device, seed=problem.seq)
    inputs = [t.detach().requires_grad_() for t in (q, k, v, gate)]
    flops_fwd = 4 * problem.batch * problem.h_q * problem.seq**2 * problem.head_dim / 2
    flops = (flops_fwd, 2.5 * flops_fwd, 3.5 * flops_fwd)

    def tflops(ms, flops=flops):
        return [f / (t * 1e-3) / 1e12 for f, t in zip(flops, ms)]

    row = {"S": problem.seq, "B": problem.batch, "kernel": tflops(time_fwd_bwd(ours, inputs, dy, device))}
    best = None
    for name, ctx in sdpa_backends(device):
        try:
            with ctx():
                figures = tflops(time_fwd_bwd(sdpa_then_gate, inputs, dy, device))
        except RuntimeError as err:  # a backend not available for this shape / dtype / GPU
            row.setdefault("sdpa_unavailable", {})[name] = str(err).splitlines()[0][:120]
            continue
        if best is None or figures[2] > best[1][2]:
            best = (name, figures)
    row["sdpa_backend"], row["sdpa_gate"] = best or ("none", [math.nan] * 3)
    if flash_attn_func is not None and device == "cuda":
        row["flash_gate"] = tflops(time_fwd_bwd(flash_then_gate, inputs, dy, device))
    row["dispatch"] = dispatcher_choice(inputs)
    print(f"  S={problem.seq:6d} B={problem.batch:3d}: TFLOP/s fwd/bwd/fwd+bwd kernel "
          f"{'/'.join(f'{x:.3g}' for x in row['kernel'])}, SDPA+gate ({row['sdpa_backend']}) "
          f"{'/'.join(f'{x:.3g}' for x in row['sdpa_gate'])}; the default ran {row['dispatch']['ran']}", flush=True)
    return row


def dispatcher_choice(inputs) -> dict:
    """What the gated_triton backend (the default attention) runs for a causal call with gradients on `inputs`
    (q, k, v: [B, S, H, D], gate), by its own rule: the self-check, then its timing of the fused kernel against SDPA +
    gate on these inputs, forward + backward (kernel/choice.py); `ran` and the two milliseconds it measured."""
    from gated_qwen.kernel import attention, choice
    from gated_qwen.kernel.selfcheck import combination_of

    q, k, v, gate = inputs
    attention.gated_attention_forward(None, *(t.transpose(1, 2) for t in (q, k, v)), None, output_gate=gate)
    combo = combination_of(q, gate, True, False, q.shape[1])
    made = choice.CHOICES.get(choice.ChoiceKey(combo, choice.length_bucket(k.shape[1]), True))
    failure = attention.SELF_CHECK_VERDICTS.get(combo)
    if attention.kernel_mode() != "check" or not choice.measured_on(combo.device):
        return {"ran": f"not measured (GATED_QWEN_KERNEL={attention.kernel_mode()}, {combo.device})", "kernel_ms": None,
                "sdpa_ms": None}
    ran = "kernel" if made is not None and made.kernel and failure is None else "SDPA + gate"
    return {"ran": ran, "kernel_ms": made and made.kernel_ms, "sdpa_ms": made and made.sdpa_ms,
            "why": failure or (made and made.failure)}


def wall_clock_ms(run, device: str, path: str) -> float:
    """The backend's timer under --interpret (CUDA events need a GPU): one wall-clock run, in milliseconds."""
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1e3


# ----------------------------------------------------------------------------------------------------------------
# 3. End to end
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSetup:
    fields: dict
    batch: int
    seq: int
    prompt: int
    new_tokens: int
    dtype: str


def model_setup(interpret: bool) -> ModelSetup:
    if interpret:
        fields = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
        return ModelSetup(fields, batch=2, seq=32, prompt=16, new_tokens=4, dtype="fp32")
    # the paper's 1.7B widths (appendix table 7), fewer layers
    fields = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, use_qk_norm=True)
    return ModelSetup(fields, batch=4, seq=2048, prompt=512, new_tokens=64, dtype="bf16")


def end_to_end_problems(interpret: bool) -> list[Problem]:
    """The kernel launches of `end_to_end`'s model (training step, prefill, decode steps against a growing cache,
    whose key count alternates between multiples of 16 and not): compiled ahead with the rest, so its first steps
    find them in Triton's cache instead of compiling one by one."""
    m = model_setup(interpret)
    heads = dict(h_q=m.fields["num_attention_heads"], h_kv=m.fields["num_key_value_heads"], batch=m.batch)
    d = m.fields["head_dim"]
    return [Problem(d, m.dtype, True, "elementwise", "dense", seq=m.seq, **heads),
            Problem(d, m.dtype, True, "elementwise", "dense", seq=m.prompt, backward=False, **heads),
            Problem(d, m.dtype, True, "elementwise", "decode", seq=m.prompt + 1, backward=False, **heads),
            Problem(d, m.dtype, True, "elementwise", "decode", seq=m.prompt + 16, backward=False, **heads)]


def end_to_end(device: str, interpret: bool, layers: int) -> dict:
    import torch

    from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
    from gated_qwen.kernel import attention, choice

    m = model_setup(interpret)
    fields, batch, seq, prompt, new_tokens = m.fields, m.batch, m.seq, m.prompt, m.new_tokens
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[m.dtype]
    config = GatedQwenConfig(num_hidden_layers=layers, max_position_embeddings=max(4096, seq + new_tokens),
                             tie_word_embeddings=True, **fields)
    result = {"config": {"layers": layers, **fields, "dtype": str(dtype).removeprefix("torch.")},
              "train": {"batch": batch, "seq": seq}, "decode": {"batch": batch, "prompt": prompt,
                                                                "new_tokens": new_tokens}}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def tokens_per_second(attn: str) -> dict:
        torch.manual_seed(0)
        with torch.device(device):
            model = GatedQwenForCausalLM(config).to(dtype)
        model.set_attn_implementation(attn)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def train_step():
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def decode():
            with torch.no_grad():
                model.generate(input_ids=ids[:, :prompt], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, pad_token_id=0)

        timings = {}
        for name, fn, count in (("train", train_step, batch * seq), ("decode", decode, batch * new_tokens)):
            started = time.perf_counter()
            fn()  # warm-up: compilation, autotuning, the backend's self-check
            sync()
            timings[name + "_warmup_s"] = round(time.perf_counter() - started, 2)
            runs = []
            for _ in range(1 if interpret else 3):
                started = time.perf_counter()
                fn()
                sync()
                runs.append(time.perf_counter() - started)
            timings[name] = count / sorted(runs)[len(runs) // 2]
        return timings

    tokens = {attn: tokens_per_second(attn) for attn in ("sdpa", "gated_triton")}
    if device == "cuda":
        torch.cuda.empty_cache()
    for name in ("train", "decode"):
        result[name] |= {"sdpa_tokens_per_s": tokens["sdpa"][name],
                         "gated_triton_tokens_per_s": tokens["gated_triton"][name],
                         "ratio": tokens["gated_triton"][name] / tokens["sdpa"][name],
                         "warmup_s": {attn: tokens[attn][name + "_warmup_s"] for attn in tokens}}
    result["self_check"] = {combo.describe(): ("passed" if failure is None else failure)
                            for combo, failure in attention.SELF_CHECK_VERDICTS.items()}
    result["choices"] = {key.describe(): {"ran": "kernel" if made.kernel else "SDPA + gate", "kernel_ms": made.kernel_ms,
                                          "sdpa_ms": made.sdpa_ms, "why": made.failure}
                         for key, made in choice.CHOICES.items()}
    return result


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def environment(device: str) -> dict:
    import torch
    import transformers
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda, "host": platform.node(),
           "cpu_cores": os.cpu_count()}
    try:
        import flash_attn

        env["flash_attn"] = flash_attn.__version__
    except ImportError:
        env["flash_attn"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
                "memory_gib": round(props.total_memory / 2**30, 1)}
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    else:
        env["gpu"] = "none: CPU, Triton interpreter (timings meaningless)"
    return env


def fmt(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def markdown(results: dict) -> str:
    env, lines = results["environment"], []
    lines.append(f"### GPU check: {env['gpu']}\n")
    lines.append(", ".join(f"{k} {v}" for k, v in env.items() if k != "gpu" and v is not None) + "\n")
    if "compile" in results:
        c = results["compile"]
        lines.append(f"Compiled ahead: {c['compiled']} of {c['compilations']} kernel configurations in {c['seconds']} s "
                     f"({c['processes']} processes){'; failed: ' + '; '.join(c['failed'][:5]) if c['failed'] else ''}"
                     f".\n")
    if results["skipped"]:
        lines.append(f"**Skipped** (time budget {results['budget_seconds']} s): " + "; ".join(results["skipped"]) + "\n")
    rows = results["correctness"]
    failed = [r for r in rows if not r["ok"]]
    lines.append(f"#### Correctness: {len(rows) - len(failed)} of {len(rows)} cases within bounds "
                 f"({', '.join(f'{k} {v:g}' for k, v in BOUND.items())} on max|err|/max|ref| vs fp64)\n")
    lines.append("| case | out | dq | dk | dv | dgate | ok |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in rows:
        e = r["errors"]
        cells = [f"{e[n]:.1e}" if n in e else "-" for n in ("out", "dq", "dk", "dv", "dgate")]
        lines.append(f"| {r['case']} | {' | '.join(cells)} | {'ok' if r['ok'] else 'FAIL ' + r.get('error', '')} |")
    lines += hub_kernel_markdown(results["hub_kernel"])
    tp = results["throughput"]
    lines.append(f"\n#### Kernel TFLOP/s (bf16, causal, D={results['throughput_setup']['head_dim']}, "
                 f"{results['throughput_setup']['heads']} heads, elementwise gate)\n")
    header = ["S", "B", "kernel fwd", "SDPA+gate fwd", "kernel bwd", "SDPA+gate bwd", "kernel fwd+bwd",
              "SDPA+gate fwd+bwd", "ratio fwd+bwd", "SDPA backend", "default ran", "its kernel ms",
              "its SDPA+gate ms"]
    has_flash = any("flash_gate" in r for r in tp)
    if has_flash:
        header += ["FA+gate fwd", "FA+gate bwd", "FA+gate fwd+bwd"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in tp:
        o, s = r["kernel"], r["sdpa_gate"]
        chosen = r["dispatch"]
        cells = [r["S"], r["B"], fmt(o[0]), fmt(s[0]), fmt(o[1]), fmt(s[1]), fmt(o[2]), fmt(s[2]),
                 f"{o[2] / s[2]:.2f}×" if s[2] > 0 else "-", r["sdpa_backend"],
                 chosen["ran"] + (f" ({chosen['why']})" if chosen.get("why") else "")]
        cells += [fmt(chosen[name]) if chosen[name] is not None else "-" for name in ("kernel_ms", "sdpa_ms")]
        if has_flash:
            cells += [fmt(x) for x in r.get("flash_gate", [float("nan")] * 3)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    goals = results["goals"]
    lines.append(f"\nGoals (S ≥ {GOALS['goal_min_seqlen']}): forward ≥ {GOALS['forward_tflops']:g} TFLOP/s: "
                 f"{goals['forward']}; backward ≥ {GOALS['backward_tflops']:g}: {goals['backward']}; fwd+bwd ≥ "
                 f"{GOALS['fwd_bwd_vs_sdpa_gate']:g}× SDPA + gate: {goals['fwd_bwd']}.")
    lines.append("\nSeconds per phase: " + ", ".join(f"{k} {v}" for k, v in results["phase_seconds"].items()) + ".")
    if "end_to_end" not in results:
        lines.append(f"\nWall time {results['seconds']} s (end to end not run). Command: {results['command']}")
        return "\n".join(lines)
    e2e = results["end_to_end"]
    lines.append(f"\n#### End to end: GatedQwen {e2e['config']['layers']} layers, hidden {e2e['config']['hidden_size']}, "
                 f"{e2e['config']['num_attention_heads']}/{e2e['config']['num_key_value_heads']} heads of "
                 f"{e2e['config']['head_dim']}, {e2e['config']['dtype']}\n")
    lines.append("| | sdpa tokens/s | gated_triton tokens/s | gated_triton / sdpa |")
    lines.append("|---|---|---|---|")
    for name, what in (("train", f"training step (B={e2e['train']['batch']}, S={e2e['train']['seq']}, AdamW)"),
                       ("decode", f"greedy decode (B={e2e['decode']['batch']}, prompt {e2e['decode']['prompt']}, "
                                  f"{e2e['decode']['new_tokens']} new)")):
        row = e2e[name]
        lines.append(f"| {what} | {fmt(row['sdpa_tokens_per_s'])} | {fmt(row['gated_triton_tokens_per_s'])} | "
                     f"{row['ratio']:.2f}× |")
    lines.append("\nFirst (warm-up) call, s: " + "; ".join(
        f"{name} " + ", ".join(f"{attn} {sec}" for attn, sec in e2e[name]["warmup_s"].items())
        for name in ("train", "decode")) + ".")
    lines.append("\nSelf-check of the gated_triton backend on first use: " + "; ".join(
        f"{k}: {v}" for k, v in e2e["self_check"].items()) + ".")
    lines.append("\nChoices of the gated_triton backend in this run (fused kernel vs SDPA + gate, ms): " + "; ".join(
        f"{k}: {v['ran']}, " + " vs ".join(fmt(ms) if ms is not None else "-" for ms in (v["kernel_ms"], v["sdpa_ms"]))
        + (f" ({v['why']})" if v["why"] else "")
        for k, v in e2e["choices"].items()) + ".")
    lines.append(f"\nWall time {results['seconds']} s. Command: {results['command']}")
    return "\n".join(lines)


def hub_kernel_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    module = next((r["module"] for r in rows if "module" in r), "not loaded")
    lines = [f"\n#### Hub kernel: `{module}` (make kernel-repo, kernels.get_local_kernel): "
             f"{sum(r['ok'] for r in rows)} of {len(rows)} cases within bounds, against the fp64 reference and the "
             "package's kernel\n", "| case | out | dq | dk | dv | dgate | vs package | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r["errors"]
        cells = [f"{e[n]:.1e}" if n in e else "-" for n in ("out", "dq", "dk", "dv", "dgate")]
        cells.append(f"{r['vs_package']:.1e}" if "vs_package" in r else "-")
        lines.append(f"| {r['case']} | {' | '.join(cells)} | {'ok' if r['ok'] else 'FAIL ' + r.get('error', '')} |")
    return lines


def goal_status(rows: list[dict], device: str) -> dict:
    if device != "cuda":
        return {"forward": "not measured", "backward": "not measured", "fwd_bwd": "not measured"}
    long = [r for r in rows if r["S"] >= GOALS["goal_min_seqlen"]]
    if not long:
        return {"forward": "not measured", "backward": "not measured", "fwd_bwd": "not measured"}

    def verdict(ok):
        return "met" if ok else "not met"

    return {"forward": verdict(all(r["kernel"][0] >= GOALS["forward_tflops"] for r in long)),
            "backward": verdict(all(r["kernel"][1] >= GOALS["backward_tflops"] for r in long)),
            "fwd_bwd": verdict(all(r["kernel"][2] >= GOALS["fwd_bwd_vs_sdpa_gate"] * r["sdpa_gate"][2] for r in long))}


# Each phase: what its pieces of work are, their kind (EXPECTED_SECONDS) and the key of results.json they go to.
PHASES = {"correctness": ("cases", "correctness case", "correctness"),
          "hub kernel": ("cases", "hub kernel case", "hub_kernel"),
          "throughput": ("sequence lengths", "throughput size", "throughput"),
          "end to end": ("model", "end to end", "end_to_end")}


def run_phase(phase: str, items: list, budget: Budget, ran: set, results: dict) -> None:
    """Runs a phase's `(label, work)` items while the budget allows, into `results` as they finish (a SIGTERM keeps
    what is done), and prints each failing correctness row."""
    started = time.perf_counter()
    what, kind, key = PHASES[phase]
    print(f"{phase}: {len(items)} {what}", flush=True)
    done = [] if key == "end_to_end" else results[key]
    run_items(items, kind, budget, done, ran)
    if key == "end_to_end" and done:
        results[key] = done[0]
    for row in done if key in ("correctness", "hub_kernel") else []:
        if not row["ok"]:
            print(f"  FAIL {phase} {row['case']}: {row['errors']} {row.get('error', '')}", flush=True)
    results["phase_seconds"][phase] = round(time.perf_counter() - started, 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    budget = Budget(args.budget)  # from the start: the imports below take seconds too
    if args.out.exists():
        print(f"gpu_check.py: error: {args.out} exists; choose a new folder", file=sys.stderr)
        return 2
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("gpu_check.py: error: no CUDA GPU (torch.cuda.is_available() is False); on a CPU run "
              "`python benchmarks/gpu_check.py --interpret --out DIR`", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("gpu_check.py: error: Triton is not installed (pip install -e '.[triton]')", file=sys.stderr)
        return 2
    from gated_qwen.kernel import triton_available

    if not triton_available():
        print("gpu_check.py: error: the Triton kernel cannot run here (TRITON_INTERPRET was set too late?)",
              file=sys.stderr)
        return 2
    device = "cpu" if args.interpret else "cuda"
    from gated_qwen.kernel import choice

    # The default attention measures its choices afresh in a folder of this run's (never the user's cache file);
    # under --interpret the CPU's calls are measured as a GPU's, by wall clock (meaningless times; the path runs).
    choices_folder = tempfile.TemporaryDirectory(prefix="gated-qwen-kernel-choices-")
    os.environ[choice.CACHE_VARIABLE] = choices_folder.name
    if args.interpret:
        choice.MEASURED_DEVICE_TYPES, choice.TIMER = ("cuda", "cpu"), wall_clock_ms
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, _stop)
    results = {"command": "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "budget_seconds": args.budget, "environment": environment(device), "phase_seconds": {},
               "correctness": [], "hub_kernel": [], "throughput": [], "skipped": budget.skipped}
    print(f"device: {results['environment']['gpu']}", flush=True)
    grid, sizes = correctness_grid(args.interpret), throughput_problems(args.interpret)
    results["throughput_setup"] = {"head_dim": sizes[0].head_dim, "heads": sizes[0].h_q}
    layers = args.layers or (2 if args.interpret else 4)
    phases = {
        "correctness": [(p.label, lambda p=p: check(p, device)) for p in grid],
        "hub kernel": [(f"hub kernel {p.label}", lambda p=p: check_hub_kernel(p, device))
                       for p in hub_kernel_problems(args.interpret)],
        "throughput": [(f"throughput S={p.seq}", lambda p=p: measure_throughput(p, device)) for p in sizes],
        "end to end": [("end to end", lambda: end_to_end(device, args.interpret, layers))],
    }
    ran: set[str] = set()
    phase = "setup"
    try:
        if device == "cuda":
            phase = "compile"
            jobs = args.jobs or os.cpu_count() or 1
            print(f"compiling every kernel configuration ahead ({jobs} processes) ...", flush=True)
            # At most half the budget: what is left compiles on first use (slower, but nothing is lost).
            results["compile"] = compile_ahead(grid + sizes + end_to_end_problems(False), jobs, budget.left() / 2)
            if results["compile"]["unfinished"]:
                budget.skipped.append(f"compiling {results['compile']['unfinished']} of "
                                      f"{results['compile']['compilations']} configurations ahead (half the budget "
                                      f"spent; they compile on first use)")
            results["phase_seconds"]["compile"] = results["compile"]["seconds"]
        for phase, items in phases.items():
            run_phase(phase, items, budget, ran, results)
    except Stopped as stop:
        unrun = [label for items in phases.values() for label, _ in items
                 if label not in ran and not any(s.startswith(label + " (") for s in budget.skipped)]
        budget.skipped.append(f"stopped by {stop} during {phase} after {time.perf_counter() - started:.0f} s: "
                              f"{len(unrun)} pieces of work not run ({', '.join(unrun[:6])}"
                              f"{', ...' if len(unrun) > 6 else ''})")
    results["goals"] = goal_status(results["throughput"], device)
    results["seconds"] = round(time.perf_counter() - started, 1)
    results["passed"] = all(r["ok"] for r in results["correctness"] + results["hub_kernel"])
    report = markdown(results)
    choices_folder.cleanup()
    staging = Path(tempfile.mkdtemp(prefix=args.out.name + ".", dir=args.out.parent))
    (staging / "results.json").write_text(json.dumps(results, indent=1))
    (staging / "results.md").write_text(report + "\n")
    staging.rename(args.out)
    print(report)
    if not results["passed"]:
        return 1
    return 3 if budget.skipped else 0


if __name__ == "__main__":
    sys.exit(main())
