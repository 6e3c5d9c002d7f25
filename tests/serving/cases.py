"""The models tests/serving serves (built by build_models.py) and the prompts: plain data, importable in either
environment."""

# vLLM's CPU attention takes head sizes 32, 64, 80, ...: the smallest is used. Two layers, GQA (2 query heads per kv
# head, 2 kv heads: one per rank under 2-way tensor parallelism), an untied output layer.
SERVING = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)
PROMPTS = [[1, 5, 9, 20, 33], [7, 3, 3, 101, 64, 12, 90, 2, 45], [100, 22, 8, 17, 54, 31, 77, 6, 9, 60, 3, 11, 29]]
NEW_TOKENS = 12

# name -> gate fields of a dense GatedQwenConfig (every variant of the paper, and its non-gate controls)
NATIVE = {
    "g1_elementwise": dict(gate_position="sdpa"),
    "g1_headwise": dict(gate_position="sdpa", gate_granularity="headwise"),
    "g1_head_shared": dict(gate_position="sdpa", gate_shared_across_heads=True),
    "g1_gate_layers": dict(gate_position="sdpa", gate_layers=[1]),
    "g1_input_independent": dict(gate_position="sdpa", gate_input_dependent=False),
    "g1_bias": dict(gate_position="sdpa", gate_bias=True),
    "g1_attention_bias": dict(gate_position="sdpa", attention_bias=True),
    "g1_add_silu": dict(gate_position="sdpa", gate_combine="add", gate_activation="silu"),
    "g1_ns_sigmoid_headwise_shared": dict(gate_position="sdpa", gate_activation="ns_sigmoid",
                                          gate_granularity="headwise", gate_shared_across_heads=True),
    "g2_value": dict(gate_position="value"),
    "g3_key_headwise": dict(gate_position="key", gate_granularity="headwise"),
    "g4_query": dict(gate_position="query"),
    "g5_dense": dict(gate_position="dense"),
    "control_sdpa_rmsnorm": dict(gate_position=None, sdpa_output_transform="rmsnorm"),
    "control_sdpa_silu": dict(gate_position=None, sdpa_output_transform="silu"),
    "no_gate": dict(gate_position=None),
}
# name -> the fields of a GatedQwenMoeConfig (a G1 gate; Qwen3-Next's shared expert; one layer dense)
MOE = {
    "moe_g1": dict(gate_position="sdpa", shared_expert_intermediate_size=48),
    "moe_g1_dense_layer": dict(gate_position="sdpa", shared_expert_intermediate_size=48, mlp_only_layers=[0]),
}
# name -> (the case it exports, the format)
EXPORTS = {
    "qwen3_5_g1_elementwise": ("g1_elementwise", "qwen3_5"),
    "qwen3_5_g1_headwise": ("g1_headwise", "qwen3_5"),
    "qwen3_5_g1_head_shared": ("g1_head_shared", "qwen3_5"),
    "qwen3_5_g1_gate_layers": ("g1_gate_layers", "qwen3_5"),
    "qwen3_5_g1_input_independent": ("g1_input_independent", "qwen3_5"),
    "qwen3_5_g1_bias": ("g1_bias", "qwen3_5"),
    "qwen3_next_moe_g1": ("moe_g1", "qwen3_next"),
    "qwen3_next_moe_g1_dense_layer": ("moe_g1_dense_layer", "qwen3_next"),
}
# Exports that `gated-qwen convert` refuses, written anyway (the flag, or stock Transformers) to show vLLM's side:
# name -> (the case it exports or None for a stock folder, the format)
REFUSED = {
    "qwen3_5_o_proj_bias_allowed": ("g1_attention_bias", "qwen3_5"),  # --allow-o-proj-bias
    "qwen3_next_dense_stock": (None, "qwen3_next"),  # a dense Qwen3NextForCausalLM saved by Transformers
}
