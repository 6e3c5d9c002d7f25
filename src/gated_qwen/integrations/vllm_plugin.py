"""vLLM plugin (entry point `vllm.general_plugins: gated_qwen`, see pyproject.toml): registers gated_qwen's vLLM
model (`vllm_model.GatedQwenForCausalLM`, vLLM's own layers with the gate) for the architecture that dense
gated_qwen folders name. vLLM calls `register` in every process it starts; the model module is imported only when
vLLM builds that model (a lazy "module:class" string), so loading the plugin costs nothing else."""

ARCHITECTURE = "GatedQwenForCausalLM"


def register() -> None:
    from vllm import ModelRegistry  # run by vLLM, where it is installed

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "gated_qwen.integrations.vllm_model:GatedQwenForCausalLM")
