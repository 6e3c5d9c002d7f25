"""Why `gated-qwen convert` refuses two exports (tests/conversion/formats/qwen3_5/test_qwen3_5.py checks the refusals), seen in vLLM: written
anyway, vLLM's Qwen3.5 model serves an export with an o_proj bias (`--allow-o-proj-bias`) far from what stock
Transformers computes on the same folder (it drops the bias without a word), and vLLM's Qwen3-Next refuses a dense
model. (The gate bias, written with `qkv_bias`, is served exactly: test_offline.py, `qwen3_5-G1-bias`.)"""

import pytest

from tests.serving.vllm_helpers import CONTROL_MARGIN, architecture, greedy, max_logprob_difference, release, serve


def test_vllm_computes_an_o_proj_bias_export_wrongly(models):
    case = models["cases"]["qwen3_5_o_proj_bias_allowed"]
    llm = serve(models["root"] / case["folder"], impl="auto")
    try:
        served = llm.apply_model(architecture)[0]
        answers = greedy(llm, models["prompts"], models["new_tokens"])
    finally:
        release(llm)
    assert served == "Qwen3_5ForCausalLM"
    assert max_logprob_difference(answers, case["reference"]) > CONTROL_MARGIN


def test_vllm_refuses_a_dense_qwen3_next(models):
    case = models["cases"]["qwen3_next_dense_stock"]
    with pytest.raises(Exception, match="No Qwen3Next layer found"):
        release(serve(models["root"] / case["folder"], impl="auto"))
