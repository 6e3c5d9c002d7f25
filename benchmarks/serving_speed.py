"""Generation speed of one gated model served three ways, measured in the same run (`make bench-serving`):

- `native`: the gated_qwen folder through vLLM's Transformers backend (`model_impl="transformers"`);
- `plugin`: the same folder through this package's vLLM model (`model_impl="vllm"`: vLLM's own layers and the
  gate, registered by the `gated_qwen` vLLM plugin; measured where the plugin is installed, as in .venv-serving);
- `qwen3_5`: its export (`gated-qwen convert --to qwen3_5`, the same function) through vLLM's own Qwen3.5 model;
- `generate`: Transformers' `generate` on the native folder, in a process of the project's environment (the
  lock's Transformers: vLLM's Transformers backend changes the model class in the process that serves it).

Every engine gets the same batch (PROMPTS prompts of PROMPT_LEN random tokens, NEW_TOKENS greedy tokens each, no
early stop) and is timed `--repeats` times, the engines interleaved (native, qwen3_5, plugin, generate, native, ...) so that
the load of a shared machine falls on all of them alike. Reported: the median generated tokens per second of each
and the ratios of medians, in float32 on the CPU.

usage (two environments: the model is built with the project's, served with the serving one):
    .venv/bin/python benchmarks/serving_speed.py build DIR
    .venv-serving/bin/python benchmarks/serving_speed.py run DIR [--repeats N] [--generate-python .venv/bin/python]
"""

import argparse
import json
import os
import statistics
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

# A small model where the matrix products, not the per-step overhead, take most of the time on 2 cores: 4 layers,
# hidden 512, 8 query / 4 key-value heads of 64, a 4096-token vocabulary.
SIZE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False)
PROMPTS, PROMPT_LEN, NEW_TOKENS = 16, 32, 128


def build(folder: Path) -> None:
    import torch

    from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
    from gated_qwen.conversion import convert

    torch.manual_seed(0)
    model = GatedQwenForCausalLM(GatedQwenConfig(**SIZE, gate_position="sdpa"))
    model.save_pretrained(folder / "native")
    convert(folder / "native", folder / "qwen3_5", to_format="qwen3_5", verify=False)


def _vllm(folder: Path, impl: str):
    from vllm import LLM

    return LLM(model=str(folder), model_impl=impl, trust_remote_code=True, dtype="float32", enforce_eager=True,
               max_model_len=PROMPT_LEN + NEW_TOKENS, max_num_seqs=PROMPTS, skip_tokenizer_init=True, seed=0)


def _batch():
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, SIZE["vocab_size"], (PROMPTS, PROMPT_LEN), generator=generator)


def generate_worker(folder: Path) -> None:
    """Answers each line on stdin with the tokens/s of one batched `generate` (greedy, NEW_TOKENS tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    prompts = _batch()
    model = AutoModelForCausalLM.from_pretrained(folder / "native", trust_remote_code=True, dtype=torch.float32)
    model.eval()
    print("ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        print((out.shape[1] - PROMPT_LEN) * out.shape[0] / (time.perf_counter() - start), flush=True)


def run(folder: Path, repeats: int, generate_python: str) -> dict:
    import subprocess

    import torch
    from vllm import SamplingParams

    prompts = _batch()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p.tolist()} for p in prompts]

    engines = {"native": _vllm(folder / "native", "transformers"), "qwen3_5": _vllm(folder / "qwen3_5", "auto")}
    if any(ep.name == "gated_qwen" for ep in entry_points(group="vllm.general_plugins")):
        engines["plugin"] = _vllm(folder / "native", "vllm")
    worker = subprocess.Popen([generate_python, __file__, "generate-worker", str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "ready"

    def vllm_step(llm):
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)

    def generate_step():
        worker.stdin.write("go\n")
        worker.stdin.flush()
        return float(worker.stdout.readline())

    steps = {name: (lambda llm=llm: vllm_step(llm)) for name, llm in engines.items()} | {"generate": generate_step}
    for step in steps.values():  # warm-up
        step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(step())
    worker.stdin.close()
    worker.wait()
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"tokens_per_s": medians, "all_tokens_per_s": times,
            "ratios": {f"{a}/{b}": medians[a] / medians[b] for a in medians for b in medians if a != b},
            "batch": f"{PROMPTS} prompts x {PROMPT_LEN} tokens, {NEW_TOKENS} new tokens", "size": SIZE,
            "repeats": repeats, "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["build", "run", "generate-worker"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--generate-python", default=sys.executable,
                        help="the Python whose Transformers runs `generate` (default: this one)")
    args = parser.parse_args()
    if args.what == "build":
        build(args.folder)
    elif args.what == "generate-worker":
        generate_worker(args.folder)
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # trust_remote_code copies the folder's modeling files into the modules cache: the run's own, not the
        # user's (~/.cache/huggingface), for the engines and the generate worker (which inherits it)
        os.environ["HF_MODULES_CACHE"] = str((args.folder / "modules-cache").resolve())
        result = run(args.folder, args.repeats, args.generate_python)
        print(json.dumps(result, indent=1))
        (args.folder / "results.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
