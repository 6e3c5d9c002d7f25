"""gated_qwen's vLLM plugin (`vllm.general_plugins` entry point; `gated_qwen.integrations.vllm_model`): dense native folders
served with vLLM's own layers and the gate, every variant, as Transformers computes them (the checks of
test_offline.py), and with 2-way tensor parallelism, which here also splits the input-independent gate's logits.
`model_impl="vllm"` makes vLLM take the model from its registry, where the plugin put it."""

from importlib.metadata import entry_points

import pytest

from tests.serving.variants import NATIVE, gate_positions
from tests.serving.vllm_helpers import (
    CONTROL_MARGIN,
    LOGPROB_TOLERANCE,
    architecture,
    distance_to_control,
    gates,
    greedy,
    max_logprob_difference,
    module_of,
    release,
    serve,
)


def test_the_plugin_is_installed_where_vllm_finds_it():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("gated_qwen") == "gated_qwen.integrations.vllm_plugin:register"


def check(models, name, tensor_parallel=1):
    case = models["cases"][name]
    llm = serve(models["root"] / case["folder"], impl="vllm", tensor_parallel=tensor_parallel)
    try:
        served = llm.apply_model(architecture)
        modules = llm.apply_model(module_of)
        served_gates = llm.apply_model(gates)[0]
        answers = greedy(llm, models["prompts"], models["new_tokens"])
    finally:
        release(llm)
    assert served == ["GatedQwenForCausalLM"] * tensor_parallel
    assert modules == ["gated_qwen.integrations.vllm_model"] * tensor_parallel  # vLLM's layers, not the Transformers backend
    assert served_gates == gate_positions(NATIVE[name])
    assert [a["tokens"] for a in answers] == [r["tokens"] for r in case["reference"]]
    assert max_logprob_difference(answers, case["reference"]) <= LOGPROB_TOLERANCE
    if case["control"] is not None:
        assert distance_to_control(answers, case["control"]) > CONTROL_MARGIN


@pytest.mark.parametrize("name", NATIVE)
def test_plugin_serves_as_transformers_computes(models, name):
    check(models, name)


@pytest.mark.parametrize("name", ["G1-elementwise", "G1-input-independent", "G2-elementwise"])
def test_plugin_with_two_ranks(models, name, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    check(models, name, tensor_parallel=2)


def test_plugin_refuses_a_folder_where_only_some_layers_slide_with_its_own_message(tmp_path):
    """vLLM's Qwen2Model, the plugin model's base, asserts on a folder where some layers (not all) use a sliding
    window ("... Please open an issue"); the plugin refuses it first, naming the Transformers backend."""
    from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
    from tests.serving.cases import SERVING

    config = GatedQwenConfig(**SERVING, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    GatedQwenForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(Exception, match=r"full attention only\. Serve this folder with model_impl='transformers'") as refused:
        release(serve(tmp_path, impl="vllm"))
    assert "layers [1] of this folder are sliding_attention" in str(refused.value)
    assert "Please open an issue" not in str(refused.value)
