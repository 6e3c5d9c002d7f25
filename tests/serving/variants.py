"""The gated models tests/serving serves (built by build_models.py): every gate of the registry
(`helpers.gate_variants`) as a native folder, and every one that `--to qwen3_5` writes as that export. Imports
gated_qwen: transformers_answers.py, which loads the folders as a user without the package does, reads cases.py only."""

from gated_qwen.conversion.export_steps import check_qwen3_5_attention
from tests.helpers import gate_variants, written_gates
from tests.serving.cases import MOE, SERVING

# name -> fields of a dense GatedQwenConfig: every gate of the registry (its non-gate controls and no gate included),
# then a gate on some layers and Qwen3's attention biases
NATIVE = gate_variants() | {
    "g1_gate_layers": dict(gate_layers=[1]),
    "g1_attention_bias": dict(attention_bias=True),
}
# name -> (the case it exports, the format): every gate `--to qwen3_5` writes (it refuses the others with
# check_qwen3_5_attention), a gate on some layers, and the mixtures of experts as Qwen3-Next
EXPORTS = {f"qwen3_5-{name}": (name, "qwen3_5") for name in [*written_gates(check_qwen3_5_attention), "g1_gate_layers"]}
EXPORTS |= {f"qwen3_next-{name}": (name, "qwen3_next") for name in MOE}


def gate_positions(fields: dict) -> list[str]:
    """The gate's position in each gated layer of the native case with `fields`: none without a gate, G1 ('sdpa',
    the config's default) where the fields name no position."""
    position = fields.get("gate_position", "sdpa")
    layers = fields.get("gate_layers") or range(SERVING["num_hidden_layers"])
    return [position] * len(layers) if position else []
