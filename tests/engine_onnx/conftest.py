"""Setup of the ONNX Runtime checks (`make test-onnx`, in `.venv-onnx`: the project's lock, onnx and onnxruntime from
requirements/onnx.lock), and the greedy decoding loop that feeds a decoder graph its own KV cache, as Optimum's
`ORTModelForCausalLM` and Transformers.js do (the same inputs and outputs, step by step).

`make test` never collects this folder (`norecursedirs` in pyproject.toml); every test here carries the `onnx`
marker (tests/conftest.py).
"""

import json
from pathlib import Path

import numpy as np


def ort_greedy(folder: Path, prompt: list[int], new_tokens: int, file: str = "model.onnx") -> dict:
    """Greedy decoding in ONNX Runtime: the prompt in one call with an empty past, then one token per call with the
    `present.*` outputs fed back as `past_key_values.*`. Returns the prompt's logits `[positions, vocab]`, each
    step's last logits and the tokens."""
    from gated_qwen.conversion.formats.onnx import session

    config = json.loads((folder / "config.json").read_text())
    graph = session(folder, file)
    layers, kv, d = config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]
    past = {f"past_key_values.{i}.{kind}": np.zeros((1, kv, 0, d), np.float32)
            for i in range(layers) for kind in ("key", "value")}
    ids, tokens, steps = list(prompt), [], []
    feed = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "position_ids": np.arange(len(ids))[None], **past}
    prompt_logits = None
    for _ in range(new_tokens):
        logits, *present = graph.run(None, feed)
        prompt_logits = logits[0] if prompt_logits is None else prompt_logits
        steps.append(logits[0, -1])
        tokens.append(int(logits[0, -1].argmax()))
        ids.append(tokens[-1])
        feed = {"input_ids": np.array([[tokens[-1]]]), "attention_mask": np.ones((1, len(ids)), np.int64),
                "position_ids": np.array([[len(ids) - 1]]), **dict(zip(past, present))}
    return {"logits": prompt_logits, "steps": steps, "greedy": tokens}
