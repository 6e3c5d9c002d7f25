"""PEFT on GatedQwen: `LoraConfig(task_type="CAUSAL_LM")` without `target_modules` (Qwen3's default targets plus the
gate projection), LoRA training with gradient checkpointing, `merge_and_unload`, saving and loading adapters."""

import re
import subprocess
import sys

import pytest

pytest.importorskip("peft", reason="needs the peft extra: pip install 'gated-qwen[peft]'")

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from transformers import AutoModelForCausalLM

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from tests.helpers import TINY


def tiny_model(seed: int = 0, **overrides) -> GatedQwenForCausalLM:
    torch.manual_seed(seed)
    return GatedQwenForCausalLM(GatedQwenConfig(**{**TINY, **overrides}))


def token_batch(seed: int = 1) -> torch.Tensor:
    """`[4, 16]`: each row a random 4-token motif repeated, so there is something for the adapters to learn."""
    motifs = torch.randint(0, TINY["vocab_size"], (4, 4), generator=torch.Generator().manual_seed(seed))
    return motifs.repeat(1, 4)


def adapted_modules(model: torch.nn.Module) -> set[tuple[int, str]]:
    """(layer, projection) of every module LoRA wrapped."""
    found = set()
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            layer, proj = re.search(r"layers\.(\d+)\..*\.(\w+)$", name).groups()
            found.add((int(layer), proj))
    return found


@pytest.mark.parametrize(
    "gate, expected_extra",
    [
        ({}, ["g_proj"]),                                 # G1: the gate projection is adapted too
        ({"gate_position": "dense"}, ["g_proj"]),         # G5
        ({"gate_input_dependent": False}, []),            # no g_proj: the gate is a learned constant
        ({"gate_position": None}, []),                    # baseline: exactly Qwen3's targets
    ],
)
def test_default_lora_targets_are_qwen3s_plus_the_gate(gate, expected_extra):
    model = get_peft_model(tiny_model(**gate), LoraConfig(task_type="CAUSAL_LM"))
    qwen3 = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["qwen3"]
    assert adapted_modules(model) == {(i, p) for i in range(TINY["num_hidden_layers"]) for p in qwen3 + expected_extra}


def test_default_lora_targets_of_the_mixture_of_experts_are_the_attention_and_the_gate():
    """PEFT has no Qwen3-MoE defaults: GatedQwen-MoE takes Qwen3's attention targets plus the gate, in every layer,
    sparse or not."""
    from gated_qwen import GatedQwenMoeConfig, GatedQwenMoeForCausalLM
    from tests.helpers import TINY_MOE

    torch.manual_seed(0)
    moe = GatedQwenMoeForCausalLM(GatedQwenMoeConfig(**TINY, **TINY_MOE, mlp_only_layers=[0]))
    model = get_peft_model(moe, LoraConfig(task_type="CAUSAL_LM"))
    qwen3 = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["qwen3"]
    assert TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["gated_qwen_moe"] == [*qwen3, "g_proj"]
    assert adapted_modules(model) == {(i, p) for i in range(TINY["num_hidden_layers"]) for p in [*qwen3, "g_proj"]}


def test_the_defaults_hold_when_peft_is_imported_after_the_package():
    """`import gated_qwen` first, PEFT after, in a fresh process (in this one the order is whatever came first): a LoRA
    without `target_modules` still wraps Qwen3's targets and the gate."""
    code = (
        "import sys\n"
        "assert 'peft' not in sys.modules\n"  # the order under test
        "import gated_qwen\n"
        "from peft import LoraConfig, get_peft_model\n"
        "from peft.tuners.lora import LoraLayer\n"
        "from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as targets\n"
        f"model = gated_qwen.GatedQwenForCausalLM(gated_qwen.GatedQwenConfig(**{TINY!r}))\n"
        "model = get_peft_model(model, LoraConfig(task_type='CAUSAL_LM'))\n"
        "wrapped = {name.rsplit('.', 1)[1] for name, module in model.named_modules() if isinstance(module, LoraLayer)}\n"
        "assert wrapped == {*targets['qwen3'], 'g_proj'}, wrapped\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr


def test_gated_qwen_imports_without_peft():
    code = (
        "import sys; sys.modules['peft'] = None\n"  # `import peft` now raises ImportError
        "import gated_qwen\n"
        "from gated_qwen.integrations.peft_defaults import register_peft_defaults\n"
        "assert register_peft_defaults() is False\n"
        "assert sys.modules['peft'] is None\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------------------- training with checkpointing
STEPS = 20


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA model trained for STEPS AdamW steps with gradient checkpointing on one batch; its base saved first."""
    base_dir = tmp_path_factory.mktemp("peft") / "base"
    model = tiny_model()
    model.save_pretrained(base_dir)
    model.activation_checkpointing_enable()
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16))
    ids = token_batch()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=3e-2)
    losses = []
    for _ in range(STEPS):
        loss = peft_model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    peft_model.eval()
    return peft_model, base_dir, ids, losses


def test_lora_training_with_gradient_checkpointing_lowers_the_loss(trained):
    _, _, _, losses = trained
    assert losses[-1] < 0.93 * losses[0], losses  # 4.59 -> 4.04 when written


def test_gradient_checkpointing_recomputes_and_gives_the_same_lora_gradients():
    """With checkpointing the inside of each decoder layer runs twice per step (the backward recomputes it) and the
    LoRA gradients equal those of a run without it (same weights, same batch)."""
    ids = token_batch()
    grads, calls = {}, {}
    for checkpointing in (False, True):
        model = tiny_model()
        if checkpointing:
            model.activation_checkpointing_enable()
        peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False))
        calls[checkpointing] = 0

        def count_call(*args, key=checkpointing):
            calls[key] += 1

        model.model.layers[0].self_attn.register_forward_hook(count_call)
        peft_model.train()
        peft_model(ids, labels=ids).loss.backward()
        grads[checkpointing] = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    assert calls == {False: 1, True: 2}
    assert all(g is not None for g in grads[True].values()) and grads[True].keys() == grads[False].keys()
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], rtol=1e-5, atol=1e-7, msg=name)


def _saved_adapter(peft_model, folder):
    peft_model.save_pretrained(folder / "adapter")
    return folder / "adapter"


def test_merge_and_unload_gives_the_adapted_logits(trained, tmp_path):
    peft_model, base_dir, ids, _ = trained
    with torch.no_grad():
        adapted = peft_model(ids).logits
        base = GatedQwenForCausalLM.from_pretrained(base_dir)(ids).logits
    merged = PeftModel.from_pretrained(
        GatedQwenForCausalLM.from_pretrained(base_dir), _saved_adapter(peft_model, tmp_path)
    ).merge_and_unload()
    assert type(merged) is GatedQwenForCausalLM and not adapted_modules(merged)
    with torch.no_grad():
        merged_logits = merged(ids).logits
    assert (adapted - base).abs().max() > 0.1  # the adapters changed the model
    torch.testing.assert_close(merged_logits, adapted, rtol=1e-5, atol=1e-5)


def test_adapters_save_and_load(trained, tmp_path):
    peft_model, base_dir, ids, _ = trained
    adapter_dir = _saved_adapter(peft_model, tmp_path)
    assert (adapter_dir / "adapter_model.safetensors").is_file()
    assert "g_proj" in LoraConfig.from_pretrained(adapter_dir).target_modules
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, peft_model(ids).logits, rtol=0, atol=0)
