"""Generation speed of one gated model on this machine's CPU in the local-inference engines, measured in one run
(`make bench-local`), each as a ratio to Transformers' `generate`:

- `generate`: Transformers (the lock's 5.24) on the gated_qwen folder, in the project's environment (.venv);
- `llama.cpp`: the `--to gguf` file through llama-cpp-python 0.3.36 (.venv-llama), and its Q8_0 from llama.cpp's
  quantizer (repacked CPU buffers off: docs/local.md);
- `mlx`: the `--to mlx` folder through mlx-lm 0.32.2's own decoding loop (`generate_step`) on mlx's CPU backend
  (.venv-mlx), and the 4-bit model `mlx_lm.convert -q` makes of it;
- `onnx`: the `--to onnx` folder in ONNX Runtime 1.31.1 (.venv-onnx), one token per call with the graph's KV cache fed
  back, and its dynamic int8 quantization.

Every engine decodes the same prompt (PROMPT_LEN random tokens) greedily for NEW_TOKENS tokens (no early stop), batch
1, with `--threads` threads (default 1), and is timed `--repeats` times, the engines interleaved (generate, llama.cpp, ..., generate, ...) so
that the load of a shared machine falls on all of them alike; each engine is a worker process of its own environment
that answers "go" with the tokens per second of one decoding (prompt included in the time, model loading not).
Before timing, every float32 engine's greedy tokens are checked equal to `generate`'s. Reported: the median tokens/s
of each engine and the median over rounds of its ratio to `generate` in the same round.

usage (the model is built and converted in .venv-onnx, which has the package, gguf and ONNX Runtime):
    .venv-onnx/bin/python benchmarks/local_speed.py build DIR
    .venv/bin/python benchmarks/local_speed.py run DIR [--repeats N] [--threads N]   (finds .venv-llama, .venv-mlx,
                                                                                   .venv-onnx)
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The serving benchmark's model (benchmarks/serving_speed.py): 4 layers, hidden 512, 8 query / 4 key-value heads of
# 64, a 4096-token vocabulary, G1 elementwise; weights large enough (initializer_range 0.1) that greedy decoding does
# not repeat one token.
SIZE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
            initializer_range=0.1)
PROMPT_LEN, NEW_TOKENS = 32, 128
# Threads per engine (`--threads`, handed to the workers): 1 by default, which a machine shared with other jobs
# disturbs least (with 2 on these 2 busy cores, llama.cpp's and ONNX Runtime's thread pools wait on each other).
THREADS = int(os.environ.get("LOCAL_SPEED_THREADS", "1"))
ROOT = Path(__file__).resolve().parents[1]
# engine -> (its environment, the float32 ones' tokens are checked against generate's)
ENGINES = {"generate": (".venv", True), "llama.cpp": (".venv-llama", True), "llama.cpp Q8_0": (".venv-llama", False),
           "mlx": (".venv-mlx", True), "mlx 4-bit": (".venv-mlx", False), "onnx": (".venv-onnx", True),
           "onnx int8": (".venv-onnx", False)}


def prompt() -> list[int]:
    import random

    return [random.Random(1).randrange(3, SIZE["vocab_size"]) for _ in range(PROMPT_LEN)]


# ------------------------------------------------------------------------------------------------------ build
def build(folder: Path) -> None:
    """The model and every engine's file of it (in .venv-onnx: the package, gguf and ONNX Runtime)."""
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
    from gated_qwen.conversion import convert

    torch.manual_seed(0)
    GatedQwenForCausalLM(GatedQwenConfig(**SIZE)).save_pretrained(folder / "gated")
    convert(folder / "gated", folder / "model.gguf", to_format="gguf")
    convert(folder / "gated", folder / "mlx", to_format="mlx")
    convert(folder / "gated", folder / "onnx", to_format="onnx")
    quantize_dynamic(folder / "onnx" / "model.onnx", folder / "onnx" / "model_int8.onnx", weight_type=QuantType.QInt8)


def build_quantized(folder: Path, engine: str) -> None:
    """Q8_0 (in .venv-llama, llama.cpp's quantizer) or 4-bit MLX (in .venv-mlx, `mlx_lm.convert -q`)."""
    if engine == "llama.cpp":
        run = [sys.executable, str(ROOT / "tests" / "llama" / "run_gguf.py"), "quantize", str(folder / "model.gguf"),
               str(folder / "model-q8_0.gguf"), "q8_0"]
    else:
        run = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(folder / "mlx"), "--mlx-path",
               str(folder / "mlx-4bit"), "-q", "--q-bits", "4", "--trust-remote-code"]
    subprocess.run(run, check=True, capture_output=True)


# ------------------------------------------------------------------------------------------------------ engines
def transformers_engine(folder: Path, _quantized: bool):
    import torch
    from transformers import AutoModelForCausalLM

    import gated_qwen  # noqa: F401  (registers the Auto classes: the package's model, not the folder's copy)

    torch.set_num_threads(THREADS)
    model = AutoModelForCausalLM.from_pretrained(folder / "gated", dtype=torch.float32).eval()
    ids = torch.tensor([prompt()])

    def decode() -> list[int]:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        return out[0, PROMPT_LEN:].tolist()

    return decode


def llama_engine(folder: Path, quantized: bool):
    import llama_cpp

    if quantized:  # the AMX kernels of llama.cpp's repacked buffers segfault on Q8_0 on this CPU (docs/local.md)
        default = llama_cpp.llama_cpp.llama_model_default_params

        def params():
            chosen = default()
            chosen.use_extra_bufts = False
            return chosen

        llama_cpp.llama_cpp.llama_model_default_params = params
    path = folder / ("model-q8_0.gguf" if quantized else "model.gguf")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=PROMPT_LEN + NEW_TOKENS + 8, n_batch=PROMPT_LEN,
                          n_threads=THREADS, n_threads_batch=THREADS, verbose=False)

    def decode() -> list[int]:  # llama-cpp-python's own loop: temperature 0 is llama.cpp's greedy sampler
        tokens = []
        for token in llm.generate(prompt(), temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(token))
            if len(tokens) == NEW_TOKENS:
                return tokens
        return tokens

    return decode


def mlx_engine(folder: Path, quantized: bool):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(folder / ("mlx-4bit" if quantized else "mlx"), trust_remote_code=True)

    def decode() -> list[int]:
        steps = generate_step(mx.array(prompt()), model, max_tokens=NEW_TOKENS)
        return [int(token) for token, _ in steps]

    return decode


def onnx_engine(folder: Path, quantized: bool):
    import numpy as np
    import onnxruntime

    config = json.loads((folder / "onnx" / "config.json").read_text())
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = THREADS, 1
    file = folder / "onnx" / ("model_int8.onnx" if quantized else "model.onnx")
    session = onnxruntime.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])
    layers, kv, d = config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]
    names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]

    def decode() -> list[int]:
        ids, tokens = prompt(), []
        feed = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
                "position_ids": np.arange(len(ids))[None],
                **{name: np.zeros((1, kv, 0, d), np.float32) for name in names}}
        while True:
            logits, *present = session.run(None, feed)
            tokens.append(int(logits[0, -1].argmax()))
            if len(tokens) == NEW_TOKENS:
                return tokens
            length = len(ids) + len(tokens)
            feed = {"input_ids": np.array([[tokens[-1]]]), "attention_mask": np.ones((1, length), np.int64),
                    "position_ids": np.array([[length - 1]]), **dict(zip(names, present))}

    return decode


def worker(folder: Path, engine: str) -> None:
    """Prints the greedy tokens once ("tokens [...]"), then answers each line on stdin with the tokens/s of one
    decoding."""
    base = engine.split()[0]
    makers = {"generate": transformers_engine, "llama.cpp": llama_engine, "mlx": mlx_engine, "onnx": onnx_engine}
    decode = makers[base](folder, engine != base)
    print("tokens", json.dumps(decode()), flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        tokens = decode()
        print(len(tokens) / (time.perf_counter() - start), flush=True)


# ------------------------------------------------------------------------------------------------------ run
def run(folder: Path, repeats: int) -> dict:
    for engine in ("llama.cpp", "mlx"):  # the quantized files, each made by its engine's own tool
        subprocess.run([str(ROOT / ENGINES[engine][0] / "bin" / "python"), __file__, "quantize", str(folder),
                        "--engine", engine], check=True)
    workers, tokens = {}, {}
    env = dict(os.environ, LOCAL_SPEED_THREADS=str(THREADS), OMP_NUM_THREADS=str(THREADS),
               OPENBLAS_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS))
    for engine, (venv, _) in ENGINES.items():
        workers[engine] = subprocess.Popen([str(ROOT / venv / "bin" / "python"), __file__, "worker", str(folder),
                                            "--engine", engine], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           text=True, env=env)
        line = workers[engine].stdout.readline().split(" ", 1)
        assert line[0] == "tokens", f"{engine} did not start: {line}"
        tokens[engine] = json.loads(line[1])
    for engine, (_, exact) in ENGINES.items():
        if exact:
            assert tokens[engine] == tokens["generate"], f"{engine}'s greedy tokens differ from generate's"

    def step(engine: str) -> float:
        workers[engine].stdin.write("go\n")
        workers[engine].stdin.flush()
        return float(workers[engine].stdout.readline())

    for engine in ENGINES:  # warm-up
        step(engine)
    rounds = [{engine: step(engine) for engine in ENGINES} for _ in range(repeats)]
    for process in workers.values():
        process.stdin.close()
        process.wait()
    return report(rounds, tokens, repeats)


def report(rounds: list[dict], tokens: dict, repeats: int) -> dict:
    medians = {engine: statistics.median(r[engine] for r in rounds) for engine in ENGINES}
    ratios = {engine: statistics.median(r[engine] / r["generate"] for r in rounds) for engine in ENGINES}
    return {"tokens_per_s": medians, "ratio_to_generate": ratios, "rounds": rounds,
            "same_greedy_tokens_as_generate": [e for e, (_, exact) in ENGINES.items() if exact],
            "quantized_tokens_before_the_first_difference": {  # with generate's (random weights: small margins)
                e: next((i for i, (a, b) in enumerate(zip(tokens[e], tokens["generate"])) if a != b), NEW_TOKENS)
                for e, (_, exact) in ENGINES.items() if not exact},
            "workload": f"batch 1, {PROMPT_LEN}-token prompt, {NEW_TOKENS} greedy tokens, {THREADS} threads",
            "size": SIZE, "repeats": repeats, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "load_average_at_end": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["build", "run", "worker", "quantize"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine", choices=list(ENGINES))
    parser.add_argument("--threads", type=int, default=None, help="threads per engine (default: 1)")
    args = parser.parse_args()
    if args.threads is not None:  # the workers take it from the environment run() hands them
        global THREADS
        THREADS = args.threads
    if args.what == "build":
        build(args.folder)
    elif args.what == "quantize":
        build_quantized(args.folder, args.engine)
    elif args.what == "worker":
        worker(args.folder, args.engine)
    else:
        print(f"load average at the start: {os.getloadavg()}", file=sys.stderr)
        result = run(args.folder, args.repeats)
        print(json.dumps(result, indent=1))
        (args.folder / "results.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
