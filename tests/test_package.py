"""The package's face: `import gated_qwen` registers it with Transformers' Auto classes, as flash-linear-attention
and PEFT register theirs, with no import hook and no lazy attribute; whichever way a program reaches the model (a
name of the package, Transformers first or last, a module of the package imported directly, the command), the Auto
classes know `model_type="gated_qwen"` and `"gated_qwen_moe"` by the time it uses them.

What an import does is seen only in a fresh interpreter, one per order that can differ: Python runs the package's
`__init__` before any module of it, so a module reached directly (here `gated_qwen.model.gating`) stands for every
other, and Transformers is imported before the package or by it."""

import subprocess
import sys

import pytest

import gated_qwen

REGISTERED = """
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification
config = AutoConfig.for_model("gated_qwen", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8)
assert type(config).__name__ == "GatedQwenConfig", type(config)
for auto in (AutoModelForCausalLM, AutoModelForTokenClassification):
    model = auto.from_config(config)
    assert type(model).__module__ == "gated_qwen.model.modeling_gated", type(model)
moe = AutoConfig.for_model("gated_qwen_moe", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=2,
                           num_experts_per_tok=1, moe_intermediate_size=8)
assert type(moe).__name__ == "GatedQwenMoeConfig", type(moe)
for auto in (AutoModelForCausalLM, AutoModelForTokenClassification):
    model = auto.from_config(moe)
    assert type(model).__module__ == "gated_qwen.model.modeling_gated_moe", type(model)
print("registered")
"""

def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow  # a fresh interpreter
def test_a_module_of_the_package_reached_first_registers_it_quietly():
    """Registered by the import itself, and the import says nothing on stderr (torchao's import-time warnings about
    its C extensions, which Transformers' import brings, are quieted during it)."""
    result = run("import gated_qwen.model.gating\n" + REGISTERED)
    assert result.returncode == 0 and result.stdout == "registered\n", result.stderr[-3000:]
    assert result.stderr == ""


@pytest.mark.slow  # a fresh interpreter
def test_a_name_of_the_package_imported_after_transformers_registers_it():
    result = run("import transformers\nfrom gated_qwen import GatedQwenConfig\n" + REGISTERED)
    assert result.returncode == 0 and "registered" in result.stdout, result.stderr[-3000:]


def test_no_import_hook_no_lazy_names_and_an_unknown_name_is_an_attribute_error():
    """No finder of the package in `sys.meta_path`, no module `__getattr__`: every public name is defined by the
    import, and any other name is Python's AttributeError."""
    assert [type(f).__module__ for f in sys.meta_path if type(f).__module__.startswith("gated_qwen")] == []
    assert "__getattr__" not in vars(gated_qwen) and all(name in vars(gated_qwen) for name in gated_qwen.__all__)
    assert gated_qwen.__version__ == "0.1.0"
    with pytest.raises(AttributeError, match="has no attribute 'GatedQwenForPretraining'"):
        gated_qwen.GatedQwenForPretraining  # noqa: B018


@pytest.mark.slow  # a fresh interpreter
def test_the_command_converts_in_a_fresh_interpreter(tmp_path):
    """`gated-qwen convert` as a user runs it: the command's own imports must register and convert (reading the
    gated folder back to verify the export) as an import of the package does."""
    import torch

    from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
    from tests.helpers import TINY

    torch.manual_seed(0)
    GatedQwenForCausalLM(GatedQwenConfig(**TINY)).save_pretrained(tmp_path / "gated")
    out = tmp_path / "qwen3_5"
    result = subprocess.run([sys.executable, "-m", "gated_qwen.cli", "convert", str(tmp_path / "gated"), str(out),
                             "--to", "qwen3_5"], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (out / "config.json").is_file() and "verified" in result.stderr
