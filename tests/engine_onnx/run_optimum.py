"""Runs a `gated-qwen convert --to onnx` folder with Optimum's `ORTModelForCausalLM` (optimum-onnx 0.1.0) in
.venv-optimum, whose Transformers (4.57.6, what optimum-onnx requires) does not know gated_qwen, and prints what it
computed as JSON:

    python run_optimum.py FOLDER '[[ids...], ...]' NEW_TOKENS
        -> {"logits": [[[...vocab] per position] per prompt], "greedy": [[NEW_TOKENS ids] per prompt],
            "cached_steps": [steps that fed one token and a past, per prompt]}

`ORTModelForCausalLM` is given its config (`config=`): it reads config.json's model type with its own Transformers,
which has no gated_qwen, and takes the KV cache's shape from a fixed list of model types. A `Qwen3Config` of the
folder's sizes says what it needs (key-value heads, and a head size of hidden_size / num_attention_heads, which the
checked models have); the graph computes the gated model whatever the config's type. Greedy tokens come from its
`generate` (Transformers 4.57's, with ORTModelForCausalLM feeding the graph its own `present.*` as the past).
"""

import functools
import json
import sys

import torch
from optimum.onnxruntime import ORTModelForCausalLM
from transformers import Qwen3Config

SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings")


def main(folder: str, prompts: list[list[int]], new_tokens: int) -> dict:
    with open(f"{folder}/config.json") as file:
        sizes = {k: v for k, v in json.load(file).items() if k in SIZES}
    assert sizes["hidden_size"] == sizes["num_attention_heads"] * sizes["head_dim"], "ORTModelForCausalLM's head size"
    model = ORTModelForCausalLM.from_pretrained(folder, config=Qwen3Config(**sizes))
    forward, calls = model.forward, []

    @functools.wraps(forward)  # generate checks its arguments against forward's signature
    def recorded(input_ids=None, past_key_values=None, **kwargs):
        calls.append((input_ids.shape[1], past_key_values is not None))
        return forward(input_ids=input_ids, past_key_values=past_key_values, **kwargs)

    model.forward = recorded
    logits, greedy, cached = [], [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            logits.append(model(ids, attention_mask=torch.ones_like(ids)).logits[0].tolist())
            calls.clear()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            greedy.append(out[0, len(prompt):].tolist())
            cached.append(sum(length == 1 and past for length, past in calls))
    return {"logits": logits, "greedy": greedy, "cached_steps": cached}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))))
