"""What the serving tests share: starting and stopping vLLM's offline engine, greedy answers with log-probabilities,
and the comparisons with Transformers' answers (build_models.py) and with the ungated control."""

import gc
from pathlib import Path

LOGPROB_TOLERANCE = 1e-3  # max |log-prob difference| in float32 (the bound; observed: a few 1e-6)
CONTROL_MARGIN = 0.1  # the control (no gate) must be farther than this from vLLM's answer somewhere


def architecture(model) -> str:
    """The class vLLM serves with (run in each worker through `LLM.apply_model`; top level, so it pickles)."""
    return type(model).__name__


def module_of(model) -> str:
    """The module that defines the class vLLM serves with."""
    return type(model).__module__


def gates(model) -> list[str]:
    """The positions of the gated_qwen gates in the served model (empty where vLLM's own model runs)."""
    return [m.position for m in model.modules() if type(m).__name__ == "GatedQwenGate" and m.position]


def attention_kinds(model) -> list[str]:
    """Per decoder layer of vLLM's own Qwen3.5 / Qwen3-Next model, what it built: "linear_attention" (a Gated
    DeltaNet, `linear_attn`) or "full_attention" (`self_attn`)."""
    return ["linear_attention" if hasattr(layer, "linear_attn") else
            "full_attention" if hasattr(layer, "self_attn") else type(layer).__name__ for layer in model.model.layers]


def serve(folder: Path, *, impl: str, tensor_parallel: int = 1):
    """vLLM's offline engine on `folder` (float32, eager, no tokenizer)."""
    from vllm import LLM

    return LLM(model=str(folder), model_impl=impl, trust_remote_code=True, dtype="float32", enforce_eager=True,
               max_model_len=128, skip_tokenizer_init=True, tensor_parallel_size=tensor_parallel, seed=0)


def release(llm) -> None:
    """Shuts the engine down (its worker processes too) before the next one starts."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def greedy(llm, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """vLLM's greedy continuation of each prompt (one batch) and the log-probability of each chosen token."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    answers = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        answers.append({"tokens": tokens,
                        "logprobs": [step[t].logprob for step, t in zip(completion.logprobs, tokens)]})
    return answers


def max_logprob_difference(answers: list[dict], reference: list[dict]) -> float:
    """max |log-prob difference| over the steps of prompts whose tokens agree (inf if some prompt's do not)."""
    if any(a["tokens"] != r["tokens"] for a, r in zip(answers, reference)):
        return float("inf")
    return max(abs(x - y) for a, r in zip(answers, reference) for x, y in zip(a["logprobs"], r["logprobs"]))


def distance_to_control(answers: list[dict], control: list[dict]) -> float:
    """How far vLLM's answer is from the ungated control: the largest |log-prob difference| over the steps before
    the first token on which they part (inf when the first tokens already differ)."""
    worst = 0.0
    for a, c in zip(answers, control):
        for token, logprob, c_token, c_logprob in zip(a["tokens"], a["logprobs"], c["tokens"], c["logprobs"]):
            if token != c_token:
                return float("inf")
            worst = max(worst, abs(logprob - c_logprob))
    return worst
