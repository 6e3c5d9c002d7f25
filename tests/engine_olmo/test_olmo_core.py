"""GatedQwen and OLMo-core 3.0.0, each way, against OLMo-core's own forward (docs/conversion.md).

- The fixtures `make test` reads (tests/conversion/formats/olmo_core) are what OLMo-core makes today, and `--from
  olmo_core` of fresh ones gives OLMo-core's logits within 1e-5 (float32), headwise and elementwise.
- `--to olmo_core` of GatedQwen models (elementwise, headwise natively, a head-shared gate) loads in OLMo-core
  (`TransformerConfig.from_dict` of the written config, `load_model_and_optim_state`) with GatedQwen's logits.
- OLMo-core's `reordered_norm` block (OLMo 2/3) with the same weights computes another function: why it is refused.
"""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("olmo_core", reason="needs ai2-olmo-core: make test-olmo (.venv-olmo)")

from olmo_core.nn.transformer import TransformerConfig  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM  # noqa: E402
from gated_qwen.conversion import convert  # noqa: E402
from gated_qwen.conversion.dcp import DcpCheckpoint  # noqa: E402
from tests.conversion.conversion_helpers import TINY, gated_logits, randomize_  # noqa: E402
from tests.engine_olmo.olmo_cpu import INPUT_IDS, fixtures, load_and_run  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "conversion" / "formats" / "olmo_core"
PARITY = 1e-5
GRANULARITIES = ["elementwise", "headwise"]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("olmo-fixtures")
    fixtures(out)
    return out


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_the_committed_fixtures_are_what_olmo_core_saves_and_computes(fresh, granularity):
    new, committed = (DcpCheckpoint(root / granularity / "model_and_optim", {}) for root in (fresh, FIXTURES))
    assert new.tensors.keys() == committed.tensors.keys()
    assert all(torch.equal(new.get(name), committed.get(name)) for name in new.tensors)
    assert json.loads((fresh / granularity / "config.json").read_text()) == json.loads(
        (FIXTURES / granularity / "config.json").read_text())
    new_logits, old_logits = (load_file(root / f"{granularity}.logits.safetensors") for root in (fresh, FIXTURES))
    assert torch.equal(new_logits["logits"], old_logits["logits"])


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_from_olmo_core_gives_its_logits(fresh, tmp_path, granularity):
    convert(fresh / granularity, tmp_path / "gated", from_format="olmo_core")
    expected = load_file(fresh / f"{granularity}.logits.safetensors")
    error = (gated_logits(tmp_path / "gated", expected["input_ids"]) - expected["logits"]).abs().max().item()
    print(f"OLMo-core {granularity} -> gated_qwen: max |logit difference| {error:.3g}")
    assert error <= PARITY


CASES = {"elementwise": {}, "headwise": {"gate_granularity": "headwise"}, "head-shared": {"gate_shared_across_heads": True}}


@pytest.mark.parametrize("name", list(CASES))
def test_to_olmo_core_loads_in_olmo_core_with_the_same_logits(tmp_path, name):
    config = GatedQwenConfig(**{**TINY, "vocab_size": 128, "num_key_value_heads": 2, "tie_word_embeddings": False,
                                **CASES[name]})
    randomize_(GatedQwenForCausalLM(config), seed=4).save_pretrained(tmp_path / "gated")
    convert(tmp_path / "gated", tmp_path / "olmo", to_format="olmo_core")
    load_and_run(tmp_path / "olmo", tmp_path / "logits.safetensors")
    ran = load_file(tmp_path / "logits.safetensors")
    error = (gated_logits(tmp_path / "gated", ran["input_ids"]) - ran["logits"]).abs().max().item()
    print(f"gated_qwen {name} -> OLMo-core: max |logit difference| {error:.3g}")
    assert error <= PARITY


def test_the_reordered_norm_block_computes_another_function(fresh):
    """The same weights in OLMo-core's reordered_norm block (OLMo 2/3: norms after attention and MLP, the gate reads
    the un-normed residual) give other logits: `--from olmo_core` refuses that block rather than convert it."""
    saved = json.loads((fresh / "elementwise" / "config.json").read_text())["model"]
    saved["block"]["name"] = "reordered_norm"
    cfg = TransformerConfig.from_dict(saved)
    model = cfg.build(init_device="cpu")
    state = {name.removeprefix("model."): tensor for name, tensor in
             DcpCheckpoint(fresh / "elementwise" / "model_and_optim", {}).tensors.items()}
    ckpt = DcpCheckpoint(fresh / "elementwise" / "model_and_optim", {})
    model.load_state_dict({name: ckpt.get("model." + name) for name in state})
    with torch.no_grad():
        other = model(INPUT_IDS).float()
    expected = load_file(fresh / "elementwise.logits.safetensors")["logits"]
    assert (other - expected).abs().max().item() > 0.1
