"""2-way tensor parallelism on two CPU processes (vLLM's multiprocess executor), on models whose plan vLLM can
shard: the answers stay Transformers' (single process) to LOGPROB_TOLERANCE.

vLLM's Transformers backend shards the linear layers by the model's `base_model_tp_plan` and replicates what it
does not know: of gated_qwen's rules, `colwise` per-head gate projections (G1-G4) are split with the heads, the
custom `head_shared_gate` projection is replicated (correct: a head-shared gate is whole on every rank), and the
G5 projection (no rule) is replicated. A raw parameter is never split, so the input-independent head-specific gate
(`gate.logits`, rule `colwise`) would hold every head's logits on each rank: that model is refused with the reason
(the gate's own check), not served wrong."""

import pytest

from tests.serving.vllm_helpers import LOGPROB_TOLERANCE, architecture, greedy, max_logprob_difference, release, serve

CASES = {"G1-elementwise": "TransformersForCausalLM", "G1-shared": "TransformersForCausalLM",
         "G3-headwise": "TransformersForCausalLM", "qwen3_5-G1-elementwise": "Qwen3_5ForCausalLM"}


@pytest.fixture(autouse=True)
def one_core_per_rank(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")


@pytest.mark.parametrize("name", CASES)
def test_two_ranks_serve_as_one_process_computes(models, name):
    case = models["cases"][name]
    llm = serve(models["root"] / case["folder"], impl="transformers" if case["kind"] == "native" else "auto",
                tensor_parallel=2)
    try:
        served = llm.apply_model(architecture)
        answers = greedy(llm, models["prompts"], models["new_tokens"])
    finally:
        release(llm)
    assert served == [CASES[name]] * 2  # one model per rank
    assert max_logprob_difference(answers, case["reference"]) <= LOGPROB_TOLERANCE


def test_input_independent_gate_is_refused_with_the_reason(models):
    folder = models["root"] / models["cases"]["G1-input-independent"]["folder"]
    with pytest.raises(Exception) as error:  # the worker's ValueError, re-raised by vLLM as its own error
        llm = serve(folder, impl="transformers", tensor_parallel=2)
        try:
            greedy(llm, models["prompts"], models["new_tokens"])
        finally:
            release(llm)
    assert "input-independent gate holds logits for 4 heads but this attention computes 2" in str(error.value)
