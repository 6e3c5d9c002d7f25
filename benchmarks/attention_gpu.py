"""GPU benchmark of the fused Triton gated attention against PyTorch SDPA followed by `* sigmoid(gate)`.

First checks correctness on the GPU against the plain PyTorch reference (forward and all gradients, MHA and GQA,
elementwise and headwise gates), then times forward, backward and forward+backward for causal attention at
B·S = 16k tokens, S = 1k..16k, and prints a markdown table (with the GPU's name) of TFLOP/s and ratios.

FLOP convention (benchmarks/RESULTS.md, shared/reference/kernel.md): forward 4·B·H·S²·D, halved when causal;
backward 2.5 × forward; forward+backward 3.5 × forward.

Baselines: PyTorch SDPA with its fastest backend for each size (flash, memory-efficient, cuDNN; each is tried and the
best forward+backward is kept) followed by a separate `* sigmoid(gate)` as Transformers applies it, and
FlashAttention (`flash_attn_func`) followed by the same product, when `flash_attn` is importable.

    python benchmarks/attention_gpu.py                # on a CUDA GPU: check, then benchmark
    python benchmarks/attention_gpu.py --interpret    # no GPU: the same code paths on tiny sizes under the
                                                      # Triton interpreter (timings meaningless)
"""

import argparse
import os
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interpret", action="store_true",
                   help="run on CPU under the Triton interpreter with tiny sizes (checks the script, not speed)")
    p.add_argument("--tokens", type=int, default=None, help="B·S per measurement (default 16384; 256 interpreted)")
    p.add_argument("--seqlens", type=int, nargs="+", default=None,
                   help="sequence lengths (default 1024 2048 4096 8192 16384; 64 128 interpreted)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 16; 2 interpreted)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default = --heads)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (default 128; 64 interpreted)")
    p.add_argument("--gate", choices=["elementwise", "headwise"], default="elementwise")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--no-causal", action="store_true", help="non-causal attention (default causal)")
    return p.parse_args()


ARGS = parse_args()
if ARGS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel import

import torch
import torch.nn.functional as F

if not ARGS.interpret and not torch.cuda.is_available():
    sys.exit("attention_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False). "
             "To exercise the script on CPU with tiny sizes under the Triton interpreter: "
             "python benchmarks/attention_gpu.py --interpret")

from gated_qwen.naive_gated_attention import naive_gated_attention
from gated_qwen.triton_gated_attention import gated_attention, triton_available

if not triton_available():
    sys.exit("Triton is not installed: pip install -e '.[triton]'")

DEVICE = "cpu" if ARGS.interpret else "cuda"
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}[ARGS.dtype]
CAUSAL = not ARGS.no_causal
TOKENS = ARGS.tokens or (256 if ARGS.interpret else 16384)
SEQLENS = ARGS.seqlens or ([64, 128] if ARGS.interpret else [1024, 2048, 4096, 8192, 16384])
HEADS = ARGS.heads or (2 if ARGS.interpret else 16)
KV_HEADS = ARGS.kv_heads or HEADS
HEAD_DIM = ARGS.head_dim or (64 if ARGS.interpret else 128)

try:
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None


# ------------------------------------------------------------------------------------------------------------------
# Correctness on this device
# ------------------------------------------------------------------------------------------------------------------


def check_correctness():
    """Kernel vs fp32 reference on the same low-precision inputs; returns the worst normalised error per case."""
    seq = 100 if ARGS.interpret else 1000
    d = HEAD_DIM
    cases = [(2, seq, 4, 4, "elementwise", True), (2, seq, 4, 1, "headwise", True), (1, seq, 6, 2, "elementwise", False),
             (2, 1, 8, 2, "elementwise", True)]  # the last is decode: one query against a cache of `seq` keys
    bound = 4e-2 if DTYPE == torch.bfloat16 else 5e-3
    worst_overall = 0.0
    print(f"correctness vs the fp32 reference ({ARGS.dtype}, head dim {d}, bound {bound:g} on max|err|/max|ref|):")
    for b, s_q, h_q, h_kv, gate_kind, causal in cases:
        s_k = seq
        gen = torch.Generator(device="cpu").manual_seed(0)

        def rnd(*shape, gen=gen):
            return torch.randn(*shape, generator=gen).to(DEVICE, DTYPE)

        q, k, v = rnd(b, s_q, h_q, d), rnd(b, s_k, h_kv, d), rnd(b, s_k, h_kv, d)
        g = rnd(b, s_q, h_q, d if gate_kind == "elementwise" else 1)
        dy = rnd(b, s_q, h_q, d)
        errs = {}
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
        out = gated_attention(*leaves, causal=causal)
        out.backward(dy)
        ref_leaves = [t.float().requires_grad_() for t in (q, k, v, g)]
        ref = naive_gated_attention(*ref_leaves, causal=causal)
        ref.backward(dy.float())
        for name, a, r in [("out", out, ref)] + [(n, x.grad, y.grad) for n, x, y in
                                                  zip(("dq", "dk", "dv", "dgate"), leaves, ref_leaves)]:
            errs[name] = ((a.float() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
        worst = max(errs.values())
        worst_overall = max(worst_overall, worst)
        status = "ok" if worst <= bound else "FAIL"
        print(f"  B={b} S_q={s_q} S_k={s_k} Hq={h_q} Hkv={h_kv} {gate_kind:11s} causal={causal}: "
              + " ".join(f"{n}={e:.1e}" for n, e in errs.items()) + f"  {status}")
    if worst_overall > bound:
        sys.exit("correctness check failed; not benchmarking")
    print()


# ------------------------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------------------------


def bench_ms(fn, grad_to_none=None):
    """Median milliseconds of fn(): triton's do_bench on a GPU, a few wall-clock runs under the interpreter."""
    if DEVICE == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none)
    fn()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def time_fwd_bwd(forward, inputs, dy):
    """(forward ms, backward ms, forward+backward ms) of `forward(*inputs)`."""
    fwd = bench_ms(lambda: forward(*inputs))
    out = forward(*inputs)
    bwd = bench_ms(lambda: out.backward(dy, retain_graph=True), grad_to_none=list(inputs))

    def step():
        forward(*inputs).backward(dy)

    both = bench_ms(step, grad_to_none=list(inputs))
    return fwd, bwd, both


def ours(q, k, v, g):
    return gated_attention(q, k, v, g, causal=CAUSAL)


def sdpa_then_gate(q, k, v, g):
    """What Transformers' sdpa backend + the module's gate do: [B,S,H,D] views, SDPA, then `* sigmoid(gate)`."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=CAUSAL,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2) * torch.sigmoid(g)


def flash_then_gate(q, k, v, g):
    return flash_attn_func(q, k, v, causal=CAUSAL) * torch.sigmoid(g)


def sdpa_backends():
    """(name, context factory) for each SDPA backend to try; on CPU only the default."""
    if DEVICE != "cuda":
        import contextlib

        return [("default", contextlib.nullcontext)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return [(name, lambda be=be: sdpa_kernel(be)) for name, be in
            (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
             ("mem-efficient", SDPBackend.EFFICIENT_ATTENTION))]


def fmt(x):
    """TFLOP/s with three significant digits below 10 (the interpreter's tiny numbers stay readable)."""
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def main():
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU, Triton interpreter (timings meaningless)"
    print(f"device: {name}; torch {torch.__version__}")
    print(f"setup: {ARGS.dtype}, causal={CAUSAL}, head dim {HEAD_DIM}, Hq={HEADS}, Hkv={KV_HEADS}, {ARGS.gate} gate, "
          f"B·S={TOKENS}\n")
    check_correctness()

    rows = []
    for s in SEQLENS:
        b = max(1, TOKENS // s)
        gen = torch.Generator(device="cpu").manual_seed(s)

        def rnd(*shape, gen=gen):
            return torch.randn(*shape, generator=gen).to(DEVICE, DTYPE).requires_grad_()

        q, k, v = rnd(b, s, HEADS, HEAD_DIM), rnd(b, s, KV_HEADS, HEAD_DIM), rnd(b, s, KV_HEADS, HEAD_DIM)
        g = rnd(b, s, HEADS, HEAD_DIM if ARGS.gate == "elementwise" else 1)
        dy = torch.randn(b, s, HEADS, HEAD_DIM, generator=gen).to(DEVICE, DTYPE)
        flops_fwd = 4 * b * HEADS * s * s * HEAD_DIM / (2 if CAUSAL else 1)
        flops = (flops_fwd, 2.5 * flops_fwd, 3.5 * flops_fwd)

        def tflops(ms_triple, flops=flops):
            return [f / (ms * 1e-3) / 1e12 for f, ms in zip(flops, ms_triple)]

        row = {"S": s, "B": b, "ours": tflops(time_fwd_bwd(ours, (q, k, v, g), dy))}
        best = None
        for be_name, ctx in sdpa_backends():
            try:
                with ctx():
                    t = tflops(time_fwd_bwd(sdpa_then_gate, (q, k, v, g), dy))
            except RuntimeError as err:  # backend not available for this shape / dtype / GPU
                print(f"  SDPA {be_name} unavailable at S={s}: {str(err).splitlines()[0][:100]}")
                continue
            if best is None or t[2] > best[1][2]:
                best = (be_name, t)
        row["sdpa"] = best
        if flash_attn_func is not None and DEVICE == "cuda":
            row["flash"] = tflops(time_fwd_bwd(flash_then_gate, (q, k, v, g), dy))
        rows.append(row)
        print(f"  S={s:6d} B={b:3d}: TFLOP/s fwd/bwd/fwd+bwd: ours {'/'.join(fmt(x) for x in row['ours'])}; "
              f"SDPA+gate ({best[0]}) {'/'.join(fmt(x) for x in best[1])}")

    print(f"\n### Gated attention, {name}: TFLOP/s ({ARGS.dtype}, {'causal' if CAUSAL else 'non-causal'}, "
          f"D={HEAD_DIM}, Hq={HEADS}, Hkv={KV_HEADS}, {ARGS.gate} gate, B·S={TOKENS})\n")
    header = ["S", "B", "ours fwd", "SDPA+gate fwd", "ratio", "ours bwd", "SDPA+gate bwd", "ratio",
              "ours fwd+bwd", "SDPA+gate fwd+bwd", "ratio", "SDPA backend"]
    if any("flash" in r for r in rows):
        header += ["FA2+gate fwd", "FA2+gate bwd", "FA2+gate fwd+bwd", "ours/FA2 fwd+bwd"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        o, (be, sd) = r["ours"], r["sdpa"]
        cells = [r["S"], r["B"]]
        for i in range(3):
            cells += [fmt(o[i]), fmt(sd[i]), f"{o[i] / sd[i]:.2f}×"]
        cells.append(be)
        if "flash" in r:
            fa = r["flash"]
            cells += [fmt(fa[0]), fmt(fa[1]), fmt(fa[2]), f"{o[2] / fa[2]:.2f}×"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print(f"\nFLOPs: forward 4·B·H·S²·D{'/2 (causal)' if CAUSAL else ''}, backward 2.5×, forward+backward 3.5×; "
          f"command: python benchmarks/attention_gpu.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
