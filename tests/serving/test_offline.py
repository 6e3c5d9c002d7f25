"""vLLM's offline engine serves every gated model as Transformers computes it: each variant of the native
gated_qwen folder through vLLM's Transformers backend, each export through vLLM's own Qwen3.5 / Qwen3-Next model.

For every case (build_models.py): vLLM's greedy tokens for a batch of three prompts equal Transformers' and the
log-probabilities of the chosen tokens agree to LOGPROB_TOLERANCE in float32; the ungated control (the same
weights without the gate) is farther than CONTROL_MARGIN from vLLM's answer, so the gate is what agrees; and the
model vLLM ran is the one the case is about (the Transformers backend with the gated_qwen gate in every gated layer,
or vLLM's own model class, which for an export builds every layer as full attention, as its config.json says both
ways: `layer_types` and `full_attention_interval`)."""

import json

import pytest

from tests.serving.cases import MOE, SERVING
from tests.serving.variants import EXPORTS, NATIVE, gate_positions
from tests.serving.vllm_helpers import (
    CONTROL_MARGIN,
    LOGPROB_TOLERANCE,
    architecture,
    attention_kinds,
    distance_to_control,
    gates,
    greedy,
    max_logprob_difference,
    release,
    serve,
)

EXPECTED = {"native": "TransformersForCausalLM", "native_moe": "TransformersMoEForCausalLM",
            "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}


@pytest.mark.parametrize("name", [*NATIVE, *MOE, *EXPORTS])
def test_vllm_serves_as_transformers_computes(models, name):
    case = models["cases"][name]
    llm = serve(models["root"] / case["folder"], impl="transformers" if case["kind"] == "native" else "auto")
    try:
        served = llm.apply_model(architecture)[0]
        served_gates = llm.apply_model(gates)[0]
        kinds = llm.apply_model(attention_kinds)[0] if case["kind"] != "native" else None
        answers = greedy(llm, models["prompts"], models["new_tokens"])
    finally:
        release(llm)

    kind = "native_moe" if case["kind"] == "native" and case["moe"] else case["kind"]
    assert served == EXPECTED[kind]
    if case["kind"] == "native":
        assert served_gates == gate_positions({**NATIVE, **MOE}[name])
    else:
        assert served_gates == []  # vLLM's own model: the gate is its q_proj's gate rows
        layers = SERVING["num_hidden_layers"]
        written = json.loads((models["root"] / case["folder"] / "config.json").read_text())
        assert written["full_attention_interval"] == 1 and written["layer_types"] == ["full_attention"] * layers
        assert kinds == ["full_attention"] * layers

    assert [a["tokens"] for a in answers] == [r["tokens"] for r in case["reference"]]
    assert max_logprob_difference(answers, case["reference"]) <= LOGPROB_TOLERANCE
    if case["control"] is not None:
        assert distance_to_control(answers, case["control"]) > CONTROL_MARGIN
