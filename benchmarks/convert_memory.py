"""Peak memory and wall time of `gated-qwen convert` on a synthetic checkpoint of the paper's 1B release size.

Writes a release-layout checkpoint (elementwise gate rows packed in q_proj, bfloat16, >= 2 GB in 4 shards) to a temp
folder, converts it with `gated-qwen convert SRC DST --from release --no-verify` in a child process, and reports
- peak resident memory of the child (`VmHWM` of /proc/self/status: its own address space; `ru_maxrss` is not used
  because Linux carries the parent's high-water mark across fork + exec) as a ratio to the largest input shard
  (goal: <= 1.5), and what a child holds right after its imports (a child that only imports), for the default
  output shard size (half the largest input file) and for `--max-shard-size` = the largest input file;
- the conversion's wall time against `shutil.copyfile` of the same shards into a fresh folder (goal: <= 2x), both
  measured in this run after `os.sync()`; the child's own timing of `convert()` without Python start-up and imports
  is reported too.
Temp files are deleted afterwards.

    .venv/bin/python benchmarks/convert_memory.py [--layers 20] [--keep-dir DIR]
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

CHILD = """
import json, sys, time
start = time.perf_counter()
from gated_qwen.conversion import convert
imported = time.perf_counter()
if sys.argv[1] != "import-only":
    convert(sys.argv[1], sys.argv[2], from_format="release", verify=False, max_shard_size=int(sys.argv[3]) or None)
done = time.perf_counter()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"import_s": imported - start, "convert_s": done - imported,
                  "peak_rss_bytes": int(status["VmHWM"].split()[0]) * 1024}))
"""


def write_release_checkpoint(folder: Path, layers: int, shards: int = 4) -> list[int]:
    """A release-format checkpoint with the 1B models' attention shapes; returns the shard sizes in bytes."""
    import torch
    from safetensors.torch import save_file

    hidden, heads, kv_heads, head_dim, ffn, vocab = 2048, 16, 8, 128, 5632, 32000
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (2 * heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        })
    total = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    groups, current, size = [], [], 0
    for name, shape in shapes.items():
        current.append(name)
        size += torch.Size(shape).numel() * 2
        if size >= total / shards and len(groups) < shards - 1:
            groups.append(current)
            current, size = [], 0
    groups.append(current)
    weight_map, sizes = {}, []
    for n, names in enumerate(groups):
        file = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: torch.empty(shapes[k], dtype=torch.bfloat16).normal_() for k in names}, folder / file)
        weight_map.update({k: file for k in names})
        sizes.append((folder / file).stat().st_size)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, tie_word_embeddings=False, qkv_bias=False, use_qk_norm=True,
        elementwise_attn_output_gate=True, headwise_attn_output_gate=False, rope_theta=10000.0,
        torch_dtype="bfloat16")))
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=20, help="decoder layers (20: about 2.2 GB in bfloat16)")
    parser.add_argument("--keep-dir", default=None, help="parent folder for the temp files (default: system temp)")
    parser.add_argument("--write-to", default=None, help=argparse.SUPPRESS)  # internal: the writer child
    args = parser.parse_args()
    if args.write_to:
        print(json.dumps(write_release_checkpoint(Path(args.write_to), args.layers)))
        return

    root = Path(tempfile.mkdtemp(prefix="convert-memory-", dir=args.keep_dir))
    try:
        src = root / "src"
        src.mkdir()
        t0 = time.perf_counter()
        # Children are measured by their own peak (VmHWM: a fresh address space after exec). This process stays
        # small (no torch) and writes the checkpoint in a child of its own.
        sizes = json.loads(subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--write-to",
                                           str(src)], check=True, capture_output=True, text=True).stdout)
        print(f"synthetic checkpoint: {sum(sizes) / 1e9:.2f} GB in {len(sizes)} shards "
              f"(largest {max(sizes) / 1e6:.0f} MB), written in {time.perf_counter() - t0:.0f}s", flush=True)

        largest = max(sizes)
        runs = []
        for shard_size in (0, largest):  # 0: the default (half the largest input file), then the largest input file
            shutil.rmtree(root / "dst", ignore_errors=True)
            os.sync()
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(root / "dst"), str(shard_size)],
                                 check=True, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            child = json.loads(out.stdout.strip().splitlines()[-1])
            files = list((root / "dst").glob("*.safetensors"))
            runs.append(dict(child, wall_s=wall, out_bytes=sum(f.stat().st_size for f in files),
                             out_shards=len(files), max_out_shard=max(f.stat().st_size for f in files),
                             max_shard_size="default (half the largest input file)" if not shard_size else shard_size))

        baseline = json.loads(subprocess.run([sys.executable, "-c", CHILD, "import-only"], check=True,
                                             capture_output=True, text=True).stdout.strip().splitlines()[-1])

        os.sync()
        (root / "copy").mkdir()
        t0 = time.perf_counter()
        for file in sorted(src.glob("*.safetensors")):
            shutil.copyfile(file, root / "copy" / file.name)
        copy_wall = time.perf_counter() - t0

        base = baseline["peak_rss_bytes"]
        result = {
            "input_gb": round(sum(sizes) / 1e9, 3), "input_shards": len(sizes),
            "largest_input_shard_mb": round(largest / 1e6), "rss_after_imports_mb": round(base / 1e6),
            "copy_wall_s": round(copy_wall, 2), "runs": [{
                "max_shard_size": r["max_shard_size"], "output_gb": round(r["out_bytes"] / 1e9, 3),
                "output_shards": r["out_shards"], "largest_output_shard_mb": round(r["max_out_shard"] / 1e6),
                "peak_rss_mb": round(r["peak_rss_bytes"] / 1e6),
                "peak_rss_over_largest_input_shard": round(r["peak_rss_bytes"] / largest, 3),
                "peak_minus_imports_over_largest_input_shard": round((r["peak_rss_bytes"] - base) / largest, 3),
                "wall_s": round(r["wall_s"], 2), "of_which_imports_s": round(r["import_s"], 2),
                "convert_call_s": round(r["convert_s"], 2),
                "wall_over_copy": round(r["wall_s"] / copy_wall, 3),
                "convert_call_over_copy": round(r["convert_s"] / copy_wall, 3),
            } for r in runs],
        }
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
