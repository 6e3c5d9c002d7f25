"""torchtitan 0.3.0's `qwen3_5` reads `gated-qwen convert --to qwen3_5 --language-model-prefix` through its own
state-dict adapter (`Qwen35StateDictAdapter.from_hf`, what its checkpoint manager applies to Hugging Face weights),
every layer full attention, and its forward (on the CPU: `no_grad`, flex attention, the DTensor SPMD backend) gives
GatedQwen's logits within 1e-5 in float32, elementwise and headwise; without the prefix its adapter leaves every
text-model tensor out without a word (docs/conversion.md).

What is set here to run torchtitan's model outside its trainer, each with its reason: `set_spmd_backend
("full_dtensor")` (its default, spmd_types, asserts on a device mesh that only the trainer sets up); a tiny vision
encoder in the config (Qwen3.5's model always builds one; its tensors are not part of a text checkpoint and stay
unloaded); `special_tokens` image/video ids that no token has (the model looks them up on every call).
"""

from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan.models.qwen3_5", reason="needs torchtitan: make test-torchtitan (.venv-torchtitan)")

from safetensors.torch import load_file  # noqa: E402
from torchtitan.distributed.utils import set_spmd_backend  # noqa: E402
from torchtitan.models import qwen3_5 as titan  # noqa: E402
from torchtitan.models.qwen3_5.rope import MRoPE  # noqa: E402

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM  # noqa: E402
from gated_qwen.conversion import convert  # noqa: E402
from tests.conversion.conversion_helpers import TINY, randomize_  # noqa: E402

PARITY = 1e-5
INPUT_IDS = torch.tensor([[1, 5, 9, 20, 33, 7, 3, 3, 101, 64, 12, 90]])


def titan_model(config: dict):
    """torchtitan's Qwen35Model for a Qwen3.5 text config.json whose every layer is full attention."""
    hidden, d, vocab = config["hidden_size"], config["head_dim"], config["vocab_size"]
    rope = MRoPE.Config(dim=d, max_seq_len=64, theta=config["rope_parameters"]["rope_theta"],
                        mrope_section=[d // 2 - 2 * (d // 8), d // 8, d // 8])  # text: one position per token
    layers = titan._build_qwen35_layers(
        rope=rope, attn_backend="flex", n_layers=config["num_hidden_layers"], dim=hidden,
        n_heads=config["num_attention_heads"], n_kv_heads=config["num_key_value_heads"], head_dim=d, rotary_dim=d,
        hidden_dim=config["intermediate_size"], n_key_heads=1, n_value_heads=1, key_head_dim=d, value_head_dim=d,
        full_attention_interval=1)
    for layer in layers:
        layer.attention.q_norm.eps = layer.attention.k_norm.eps = config["rms_norm_eps"]
        layer.attention_norm.eps = layer.ffn_norm.eps = config["rms_norm_eps"]
    norm = titan._offset_norm(hidden)
    norm.eps = config["rms_norm_eps"]
    vision = titan._qwen35_vision_encoder_config(
        dim=32, ffn_dim=32, num_layers=1, num_heads=2, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
        out_hidden_size=hidden, num_position_embeddings=16)
    model_config = titan.Qwen35Model.Config(
        vocab_size=vocab, dim=hidden, norm=norm, layers=layers, vision_encoder=vision,
        tok_embeddings=titan.Embedding.Config(num_embeddings=vocab, embedding_dim=hidden,
                                              param_init=titan._EMBEDDING_INIT),
        lm_head=titan.Linear.Config(in_features=hidden, out_features=vocab,
                                    param_init=titan._output_linear_init(hidden)))
    return model_config, model_config.build()


def titan_state(folder: Path):
    """torchtitan's model for the folder's config.json and the state its adapter makes of the folder's tensors."""
    import json

    config = json.loads((folder / "config.json").read_text())
    model_config, model = titan_model(config)
    hf = {name: tensor for file in sorted(folder.glob("*.safetensors")) for name, tensor in load_file(file).items()}
    return model, titan.Qwen35StateDictAdapter(model_config, None).from_hf(hf)


def titan_logits(folder: Path) -> torch.Tensor:
    model, state = titan_state(folder)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(name.startswith("vision_encoder.") for name in missing), (missing, unexpected)
    set_spmd_backend("full_dtensor")
    positions = torch.arange(INPUT_IDS.shape[1])[None]
    with torch.no_grad():
        return model.eval()(INPUT_IDS, attention_masks=model.get_attention_masks(positions), positions=positions,
                            special_tokens={"image_id": -1, "video_id": -2}).float()


@pytest.mark.parametrize("granularity", ["elementwise", "headwise"])
def test_torchtitan_reads_the_qwen3_5_export_with_the_same_logits(tmp_path, granularity):
    config = GatedQwenConfig(**{**TINY, "vocab_size": 128, "head_dim": 16, "num_key_value_heads": 2,
                                "tie_word_embeddings": False, "gate_granularity": granularity})
    model = randomize_(GatedQwenForCausalLM(config), seed=6).eval()
    model.save_pretrained(tmp_path / "gated")
    convert(tmp_path / "gated", tmp_path / "qwen3_5", to_format="qwen3_5", language_model_prefix=True)
    with torch.no_grad():
        expected = model(INPUT_IDS).logits
    error = (titan_logits(tmp_path / "qwen3_5") - expected).abs().max().item()
    print(f"gated_qwen {granularity} -> --to qwen3_5 -> torchtitan: max |logit difference| {error:.3g}")
    assert error <= PARITY


def test_without_the_prefix_torchtitans_adapter_reads_nothing_of_the_text_model(tmp_path):
    """Qwen3_5ForCausalLM's own names (`model.layers...`) are not in the adapter's map: it leaves them out without a
    word, and the model would keep its random weights. Why `--language-model-prefix` exists."""
    config = GatedQwenConfig(**{**TINY, "vocab_size": 128, "head_dim": 16, "num_key_value_heads": 2,
                                "tie_word_embeddings": False})
    randomize_(GatedQwenForCausalLM(config), seed=6).save_pretrained(tmp_path / "gated")
    convert(tmp_path / "gated", tmp_path / "qwen3_5", to_format="qwen3_5")
    _, state = titan_state(tmp_path / "qwen3_5")
    assert set(state) == {"lm_head.weight"}
