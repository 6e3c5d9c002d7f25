"""Every command at the paper's sizes: peak memory and wall time on a synthetic checkpoint of the 1B release shapes
(hidden 2048, 16 / 8 heads of 128, FFN 5632, vocab 32000, 20 layers, elementwise gate rows in q_proj, untied) or of
the 1.7B dense shapes (appendix table 7: 28 layers, hidden 2048, 16 / 8 heads of 128, FFN 6144, tied; Qwen3's
vocabulary of 151936).

Writes the checkpoint in the release layout (bfloat16, 4 shards, weights N(0, 0.02), norms 1) under --root, then
runs each command in a child under `/usr/bin/time` (its maximum resident set, `%M`) with an address-space cap of
twice the memory available at the start (a runaway step fails; ONNX Runtime reserves more address space than it
uses):
`convert --from release` (into a GatedQwen folder), `from_pretrained` of that folder (then every weight read once), `convert --to
qwen3_5|qwen3_next|release|gguf|mlx|onnx` of it (each with `--no-verify`, then `--verify`; ONNX with `--verify`
only), `analyze` and `eval-ppl` on 32-token windows of random ids (`--tokens`). Reports for each its exit status (and
last line when not 0), peak resident memory over the largest input shard and wall time over copying the source's
shards (`shutil.copyfile`, measured in the same run). Everything under --root is deleted.

    nice -n 19 .venv-onnx/bin/python benchmarks/real_size.py 1b 1.7b [--root /tmp] [--only onnx]   (make bench-real-size: all)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {"1b": dict(hidden=2048, heads=16, kv_heads=8, head_dim=128, ffn=5632, vocab=32000, layers=20, tied=False),
         "1.7b": dict(hidden=2048, heads=16, kv_heads=8, head_dim=128, ffn=6144, vocab=151936, layers=28, tied=True)}
EXPORTS = ["qwen3_5", "qwen3_next", "release", "gguf", "mlx", "onnx"]
FROM_PRETRAINED = ("import sys; from gated_qwen import GatedQwenForCausalLM; "  # then reads every weight once
                   "m = GatedQwenForCausalLM.from_pretrained(sys.argv[1]); print(sum(float(p.float().sum()) "
                   "for p in m.parameters()))")


def write_release(folder: Path, s: dict, shards: int = 4) -> list[int]:
    """The release layout (elementwise gate rows after each kv group's queries in q_proj); returns the shard sizes."""
    import torch
    from safetensors.torch import save_file

    h, d = s["hidden"], s["head_dim"]
    shapes = {"model.embed_tokens.weight": (s["vocab"], h), "model.norm.weight": (h,)}
    if not s["tied"]:
        shapes["lm_head.weight"] = (s["vocab"], h)
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (2 * s["heads"] * d, h),
                       p + "self_attn.k_proj.weight": (s["kv_heads"] * d, h),
                       p + "self_attn.v_proj.weight": (s["kv_heads"] * d, h),
                       p + "self_attn.o_proj.weight": (h, s["heads"] * d),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (s["ffn"], h), p + "mlp.up_proj.weight": (s["ffn"], h),
                       p + "mlp.down_proj.weight": (h, s["ffn"])})
    total = sum(torch.Size(v).numel() * 2 for v in shapes.values())
    groups, current, size = [], [], 0
    for name, shape in shapes.items():
        current.append(name)
        size += torch.Size(shape).numel() * 2
        if size >= total / shards and len(groups) < shards - 1:
            groups.append(current)
            current, size = [], 0
    groups.append(current)
    weight_map, sizes, generator = {}, [], torch.Generator().manual_seed(0)
    for n, names in enumerate(groups):
        file = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: torch.ones(shapes[k], dtype=torch.bfloat16) if len(shapes[k]) == 1 else
                   torch.empty(shapes[k], dtype=torch.bfloat16).normal_(0, 0.02, generator=generator)
                   for k in names}, folder / file)
        weight_map.update({k: file for k in names})
        sizes.append((folder / file).stat().st_size)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=s["vocab"], hidden_size=h,
        intermediate_size=s["ffn"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], head_dim=d, tie_word_embeddings=s["tied"], qkv_bias=False,
        use_qk_norm=True, elementwise_attn_output_gate=True, headwise_attn_output_gate=False, rope_theta=10000.0,
        max_position_embeddings=4096, torch_dtype="bfloat16")))
    save_file({"input_ids": torch.randint(0, s["vocab"], (4, 64), generator=generator)},
              folder.parent / "tokens.safetensors")
    return sizes


def measure(argv: list[str], cap: int) -> dict:
    """Runs `argv` under /usr/bin/time with RLIMIT_AS = `cap`: exit status, last stderr line, peak RSS, wall."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    stats = tempfile.NamedTemporaryFile(suffix=".time", delete=False).name
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-o", stats, "-f", "%M", *argv], capture_output=True, text=True,
                          preexec_fn=limit)
    wall = time.perf_counter() - start
    text = Path(stats).read_text().split()
    os.unlink(stats)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "%|" not in line]
    return {"rc": done.returncode, "peak_rss": int(text[-1]) * 1024 if text and text[-1].isdigit() else 0,
            "wall_s": wall, "line": "" if done.returncode == 0 else (lines[-1] if lines else "")[:300]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="+", choices=SIZES, help="each measured in turn")
    parser.add_argument("--root", default="/tmp", help="parent folder of the temporary checkpoints")
    parser.add_argument("--only", default="", help="the steps whose name contains this (and the first, which makes "
                        "the folder the others read), e.g. onnx")
    parser.add_argument("--write-to", help=argparse.SUPPRESS)  # internal: the writer child
    args = parser.parse_args()
    if args.write_to:
        print(json.dumps(write_release(Path(args.write_to), SIZES[args.sizes[0]])))
        return
    for size in args.sizes:
        run(size, args.root, args.only)


def run(size: str, parent: str, only: str = "") -> None:
    """Writes the checkpoint of `size` under `parent`, runs every step (the first and those named `only`) and prints
    its table; deletes it all."""
    bin_dir = Path(sys.executable).parent
    cli = [str(bin_dir / "gated-qwen")]
    root = Path(tempfile.mkdtemp(prefix=f"real-size-{size}-", dir=parent))
    try:
        src, gated = root / "source", root / "gated"
        src.mkdir()
        sizes = json.loads(subprocess.run([sys.executable, __file__, size, "--write-to", str(src)], check=True,
                                          capture_output=True, text=True).stdout)
        largest = max(sizes)
        os.sync()
        start = time.perf_counter()
        (root / "copy").mkdir()
        for file in sorted(src.glob("*.safetensors")):
            shutil.copyfile(file, root / "copy" / file.name)
        os.sync()
        copy_s = time.perf_counter() - start
        shutil.rmtree(root / "copy")
        available = int(next(line for line in Path("/proc/meminfo").read_text().splitlines()
                             if line.startswith("MemAvailable")).split()[1]) * 1024
        cap = 2 * available  # address space, not memory: ONNX Runtime reserves more than it touches
        print(f"# {size}: {sum(sizes) / 2**30:.2f} GiB in {len(sizes)} shards, largest {largest / 2**30:.2f} GiB;"
              f" copy {copy_s:.1f}s; address-space cap {cap / 2**30:.1f} GiB; {os.cpu_count()} CPUs", flush=True)
        steps = [("convert --from release --no-verify", [*cli, "convert", str(src), str(gated), "--from", "release",
                                                         "--no-verify"]),
                 ("convert --from release --verify", [*cli, "convert", str(src), str(gated), "--from", "release",
                                                      "--verify", "--overwrite"]),
                 ("from_pretrained", [sys.executable, "-c", FROM_PRETRAINED, str(gated)])]
        for fmt in EXPORTS:
            steps += [(f"convert --to {fmt} {check}", [*cli, "convert", str(gated), str(root / fmt), "--to", fmt,
                                                       check]) for check in ("--no-verify", "--verify")[fmt == "onnx":]]
        tokens = ["--device", "cpu", "--tokens", str(root / "tokens.safetensors")]
        steps += [("analyze --length 32", [*cli, "analyze", str(gated), "--length", "32", *tokens, "--out",
                                           str(root / "analysis")]),
                  ("eval-ppl --lengths 32", [*cli, "eval-ppl", str(gated), "--lengths", "32", "--sequences", "2",
                                             *tokens])]
        steps = steps[:1] + [step for step in steps[1:] if only in step[0]]
        print("| step | exit | peak RSS GiB | RSS / largest shard | wall s | wall / copy |\n|---|---|---|---|---|---|")
        for name, argv in steps:
            r = measure(argv, cap)
            for fmt in EXPORTS:
                shutil.rmtree(root / fmt, ignore_errors=True)
                (root / f"{fmt}").unlink(missing_ok=True)
            print(f"| {name} | {r['rc']} | {r['peak_rss'] / 2**30:.2f} | {r['peak_rss'] / largest:.2f} | "
                  f"{r['wall_s']:.0f} | {r['wall_s'] / copy_s:.1f} |" + (f" {r['line']}" if r["line"] else ""),
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
