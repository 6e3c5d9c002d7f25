"""Transformers' greedy answers: `greedy(model)` (used by build_models.py), and, as a script, the answers of the
native folders loaded the way a user without this package loads them (`trust_remote_code=True`: the model files the
folder ships) under whatever Transformers the running Python has.

usage: python -m tests.serving.transformers_answers ROOT CASE ...   ->   JSON on stdout:
       {"transformers": version, "cases": {CASE: {"class_module": ..., "answers": [...]}}}
"""

import json
import sys
from pathlib import Path

import torch

from tests.serving.cases import NEW_TOKENS, PROMPTS  # noqa: E402


@torch.no_grad()
def greedy(model: torch.nn.Module) -> list[dict]:
    """Transformers' greedy continuation of each prompt of PROMPTS and the log-probability of each chosen token."""
    answers = []
    for prompt in PROMPTS:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
        answers.append({"tokens": tokens, "logprobs": logprobs})
    return answers


def main(root: Path, cases: list[str]) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    result = {"transformers": transformers.__version__, "cases": {}}
    for name in cases:
        model = AutoModelForCausalLM.from_pretrained(root / name, trust_remote_code=True, dtype=torch.float32)
        result["cases"][name] = {"class_module": type(model).__module__, "answers": greedy(model.eval())}
    print(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
