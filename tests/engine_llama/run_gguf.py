"""Runs a GGUF in llama.cpp through llama-cpp-python, in a process of its own (an abort inside llama.cpp ends this
process, not the test session), and prints what it computed as JSON.

    python run_gguf.py logits MODEL.gguf '[[ids...], ...]' NEW_TOKENS [--no-repack]
        -> {"logits": [[[...vocab] per position] per prompt], "greedy": [[NEW_TOKENS ids] per prompt]}
    python run_gguf.py tokenize MODEL.gguf '["text", ...]'
        -> {"ids": [[...] per text], "text": [detokenized text per text]}
    python run_gguf.py quantize IN.gguf OUT.gguf q8_0

Every position's logits come from one evaluation of the prompt (`logits_all`); the greedy tokens from evaluating one
token at a time after it (llama.cpp's KV cache and recurrent state). The KV cache is float32 (`type_k`, `type_v`),
so that a float32 GGUF computes in float32 throughout. `--no-repack` turns off llama.cpp's extra CPU buffer types
(weight repacking, and the AMX kernels that segfault on Q8_0 on this machine's CPU: see docs/local.md).
"""

import json
import sys

import llama_cpp
import numpy as np
from llama_cpp import Llama

GGML_TYPE_F32 = 0


def load(path: str, no_repack: bool) -> Llama:
    if no_repack:  # llama-cpp-python has no argument for llama.cpp's use_extra_bufts (llama-cli's --no-repack)
        default = llama_cpp.llama_cpp.llama_model_default_params

        def params():
            chosen = default()
            chosen.use_extra_bufts = False
            return chosen

        llama_cpp.llama_cpp.llama_model_default_params = params
    return Llama(model_path=path, n_ctx=256, n_batch=256, logits_all=True, n_threads=1, verbose=False,
                 type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)


def logits(path: str, prompts: list[list[int]], new_tokens: int, no_repack: bool) -> dict:
    llm = load(path, no_repack)
    every, greedy = [], []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        every.append(np.array(llm.scores[: len(prompt)]).tolist())
        tokens = []
        for _ in range(new_tokens):
            tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([tokens[-1]])
        greedy.append(tokens)
    return {"logits": every, "greedy": greedy}


def tokenize(path: str, texts: list[str]) -> dict:
    llm = Llama(model_path=path, vocab_only=True, verbose=False)
    ids = [llm.tokenize(text.encode(), add_bos=False, special=False) for text in texts]
    return {"ids": ids, "text": [llm.detokenize(i).decode() for i in ids]}


def quantize(source: str, target: str, kind: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[kind]
    if llama_cpp.llama_model_quantize(source.encode(), target.encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize failed for {source}")


if __name__ == "__main__":
    mode, path, *rest = sys.argv[1:]
    if mode == "logits":
        print(json.dumps(logits(path, json.loads(rest[0]), int(rest[1]), "--no-repack" in rest)))
    elif mode == "tokenize":
        print(json.dumps(tokenize(path, json.loads(rest[0]))))
    else:
        quantize(path, rest[0], rest[1])
