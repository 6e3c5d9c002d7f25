"""`gated_qwen.analysis.analyze` on long inputs (CPU): time and peak memory against a plain forward pass.

For each length, two child processes build the same tiny model (the `reproduce` default size, random weights: the
cost does not depend on them) and run either a plain SDPA forward of the decoder (the anchor) or the full analysis
(F-Attn per layer and head without the S x S map, M-Act, |SDPA output|, gate statistics, 32 x 32 attention maps).
Each child reports its wall time and its peak resident memory above what it held before the call (`VmHWM` minus
`VmRSS`). The memory the eager attention maps of one layer would take (`heads x S x S` float32) is printed beside.

    .venv/bin/python benchmarks/analysis_long.py                 # lengths 1024 4096 16384
    .venv/bin/python benchmarks/analysis_long.py --lengths 2048
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(length: int, mode: str, threads: int) -> dict:
    import torch

    from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
    from gated_qwen.analysis import analyze
    from gated_qwen.analysis.miniature.presets import PLANS, model_config

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config: GatedQwenConfig = model_config(PLANS["default"].main, "g1-elementwise")
    model = GatedQwenForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(1, config.vocab_size, (1, length))
    ids[:, 0] = 0
    with torch.no_grad():
        model.model(ids[:, :64])  # warm-up
    before = _status_kb("VmRSS")
    start = time.perf_counter()
    if mode == "forward":
        with torch.no_grad():
            model.model(ids)
    else:
        analyze(model, ids)
    seconds = time.perf_counter() - start
    return {"length": length, "mode": mode, "seconds": seconds, "peak_mb": (_status_kb("VmHWM") - before) / 1024,
            "heads": config.num_attention_heads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", nargs=2, metavar=("LENGTH", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1], args.threads)))
        return
    import torch

    from gated_qwen.analysis.miniature.runs import cpu_name

    print(f"machine: {cpu_name()}, {os.cpu_count()} logical cores; torch "
          f"{torch.__version__}, {args.threads} thread(s); model: reproduce default size (G1 elementwise)")
    print("| tokens | forward (anchor) | analyze | time ratio | forward peak | analyze peak | one layer's eager maps |")
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        rows = {}
        for mode in ("forward", "analyze"):
            out = subprocess.run([sys.executable, __file__, "--child", str(length), mode, "--threads",
                                  str(args.threads)], check=True, capture_output=True, text=True).stdout
            rows[mode] = json.loads(out.strip().splitlines()[-1])
        f, a = rows["forward"], rows["analyze"]
        maps_mb = f["heads"] * length * length * 4 / 2**20
        print(f"| {length} | {f['seconds']:.2f} s | {a['seconds']:.2f} s | {a['seconds'] / f['seconds']:.1f} | "
              f"{f['peak_mb']:.0f} MB | {a['peak_mb']:.0f} MB | {maps_mb:,.0f} MB |", flush=True)


if __name__ == "__main__":
    main()
