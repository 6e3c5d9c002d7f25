"""Peak memory and time of `GatedQwenForCausalLM.from_pretrained` on a sharded release folder (the converters of
conversion/loading.py split q_proj while loading) against the same model's gated_qwen folder (the anchor).

Writes the synthetic release checkpoint of `convert_memory.py` (the paper's 1B attention shapes, elementwise gate
rows packed in q_proj, bfloat16, 4 shards), converts it once with `gated-qwen convert --from release` (the anchor
folder), then loads each folder `--reps` times, each in a fresh child process that reports its peak resident memory
(`VmHWM`) right after `from_pretrained` and once every weight has been read (the anchor's weights are memory-mapped
and become resident only when read; any use of the model reads them), and the wall times. Goal: peak
memory of the release folder <= anchor + 10 %.

    .venv/bin/python benchmarks/load_memory.py [--layers 20] [--reps 3]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from convert_memory import write_release_checkpoint  # noqa: E402  (the same synthetic checkpoint)

CHILD = """
import json, sys, time, torch
from gated_qwen import GatedQwenForCausalLM
start = time.perf_counter()
model = GatedQwenForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
loaded = time.perf_counter()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
loaded_rss = int(status["VmHWM"].split()[0]) * 1024
with torch.no_grad():  # read every weight once, as any use of the model does (memory-mapped pages become resident)
    total = sum(float(p.sum()) for p in model.parameters())
touched = time.perf_counter()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"seconds": loaded - start, "touched_seconds": touched - start, "loaded_rss_bytes": loaded_rss,
                  "peak_rss_bytes": int(status["VmHWM"].split()[0]) * 1024, "parameters": model.num_parameters()}))
"""


def measure(folder: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        release, gated = Path(tmp) / "release", Path(tmp) / "gated"
        release.mkdir()
        shards = write_release_checkpoint(release, args.layers)
        subprocess.run([sys.executable, "-m", "gated_qwen.cli", "convert", str(release), str(gated), "--from",
                        "release", "--no-verify"], check=True, capture_output=True)
        runs = {"gated_qwen folder (anchor)": [], "release folder": []}
        for _ in range(args.reps):  # interleaved, so drift on a shared machine hits both
            runs["gated_qwen folder (anchor)"].append(measure(gated))
            runs["release folder"].append(measure(release))
    print(f"release checkpoint: {len(shards)} shards, {sum(shards) / 1e9:.2f} GB, largest {max(shards) / 1e9:.2f} GB")
    print("| folder | peak RSS after from_pretrained | peak RSS once every weight was read | from_pretrained | "
          "+ reading every weight |")
    print("|---|---|---|---|---|")
    medians = {}
    for name, results in runs.items():
        keys = ("loaded_rss_bytes", "peak_rss_bytes", "seconds", "touched_seconds")
        medians[name] = [statistics.median(r[key] for r in results) for key in keys]
        loaded, peak, seconds, touched = medians[name]
        print(f"| {name} | {loaded / 1e9:.2f} GB | {peak / 1e9:.2f} GB | {seconds:.2f} s | {touched:.2f} s |")
    anchor, release = medians.values()
    print(f"\nrelease / anchor (medians of {args.reps}): peak RSS once read {release[1] / anchor[1]:.3f}, right after "
          f"loading {release[0] / anchor[0]:.2f}; time to a read model {release[3] / anchor[3]:.2f}")


if __name__ == "__main__":
    main()
