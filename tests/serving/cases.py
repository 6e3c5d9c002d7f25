"""The models' sizes and prompts of tests/serving, its mixtures of experts, and the exports it writes although
`gated-qwen convert` refuses them: plain data, importable in either environment and by Pythons without gated_qwen
(transformers_answers.py). The gate variants are in variants.py."""

# vLLM's CPU attention takes head sizes 32, 64, 80, ...: the smallest is used. Two layers, GQA (2 query heads per kv
# head, 2 kv heads: one per rank under 2-way tensor parallelism), an untied output layer.
SERVING = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)
PROMPTS = [[1, 5, 9, 20, 33], [7, 3, 3, 101, 64, 12, 90, 2, 45], [100, 22, 8, 17, 54, 31, 77, 6, 9, 60, 3, 11, 29]]
NEW_TOKENS = 12

# name -> the fields of a GatedQwenMoeConfig (a G1 gate; Qwen3-Next's shared expert; one layer dense)
MOE = {
    "moe_g1": dict(gate_position="sdpa", shared_expert_intermediate_size=48),
    "moe_g1_dense_layer": dict(gate_position="sdpa", shared_expert_intermediate_size=48, mlp_only_layers=[0]),
}
# Exports that `gated-qwen convert` refuses, written anyway (the flag, or stock Transformers) to show vLLM's side:
# name -> (the case it exports or None for a stock folder, the format)
REFUSED = {
    "qwen3_5_o_proj_bias_allowed": ("g1_attention_bias", "qwen3_5"),  # --allow-o-proj-bias
    "qwen3_next_dense_stock": (None, "qwen3_next"),  # a dense Qwen3NextForCausalLM saved by Transformers
}
