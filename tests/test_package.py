"""The package's face: `import gated_qwen` registers it with Transformers' Auto classes, as flash-linear-attention
and PEFT register theirs, with no import hook and no lazy attribute; whichever way a program reaches the model (a
name of the package, Transformers first or last, a module of the package imported directly), the Auto classes know
`model_type="gated_qwen"` and `"gated_qwen_moe"` by the time it uses them. Each case runs in a fresh interpreter."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every check here starts fresh interpreters

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

CASES = {
    "package-then-transformers": "import gated_qwen\n",
    "transformers-then-package": "import transformers\nimport gated_qwen\n",
    "a-name-of-the-package": "from gated_qwen import GatedQwenConfig\n",
    "modeling-module-directly": "from gated_qwen.model.modeling_gated import GatedQwenForCausalLM\n",
    "moe-modeling-module-directly": "from gated_qwen.model.modeling_gated_moe import GatedQwenMoeForCausalLM\n",
    "configuration-module-directly": "import gated_qwen.model.configuration_gated\n",
    "analysis-subpackage": "import gated_qwen.analysis.measure\n",
    "gate-module-directly": "import gated_qwen.model.gating\n",
    "checkpoint-reader-directly": "import gated_qwen.conversion.loading\n",
    "conversion-subpackage": "from gated_qwen.conversion import convert\nimport gated_qwen.conversion.formats.release\n",
    "kernel-module-directly": "import gated_qwen.integrations.gated_triton\n",
}


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("case", list(CASES))
def test_auto_classes_know_gated_qwen_however_the_package_is_reached(case):
    result = run(CASES[case] + REGISTERED)
    assert result.returncode == 0 and "registered" in result.stdout, result.stderr[-3000:]


def test_importing_the_package_registers_it_with_no_import_hook_and_no_lazy_names():
    """Registered by the import itself: no finder of the package in `sys.meta_path`, no module `__getattr__`, the
    public names defined; and the import says nothing on stderr (torchao's import-time warnings about its C
    extensions, which Transformers' import brings, are quieted during it)."""
    code = ("import sys, gated_qwen\n"
            "from transformers import CONFIG_MAPPING\n"
            "print(CONFIG_MAPPING['gated_qwen'].__name__, CONFIG_MAPPING['gated_qwen_moe'].__name__)\n"
            "print([type(f).__module__ for f in sys.meta_path if type(f).__module__.startswith('gated_qwen')])\n"
            "print(gated_qwen.__version__, '__getattr__' in vars(gated_qwen), "
            "all(name in vars(gated_qwen) for name in gated_qwen.__all__))\n")
    result = run(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:3] == ["GatedQwenConfig GatedQwenMoeConfig", "[]", "0.1.0 False True"]
    assert result.stderr == ""


def test_an_unknown_name_is_an_attribute_error():
    result = run("import gated_qwen\ntry:\n    gated_qwen.GatedQwenForPretraining\nexcept AttributeError as e:\n"
                 "    print(e)\n")
    assert "has no attribute 'GatedQwenForPretraining'" in result.stdout, result.stderr


def test_the_command_converts_in_a_fresh_interpreter(tmp_path):
    """`gated-qwen convert` as a user runs it: the command's own import order (the conversion package first, the
    model later) must register and convert like an import of the package does."""
    import torch

    from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
    from tests.helpers import TINY

    torch.manual_seed(0)
    GatedQwenForCausalLM(GatedQwenConfig(**TINY)).save_pretrained(tmp_path / "gated")
    for args in (["--to", "release"], ["--to", "qwen3_5"]):
        out = tmp_path / args[1]
        result = subprocess.run([sys.executable, "-m", "gated_qwen.cli", "convert", str(tmp_path / "gated"), str(out),
                                 *args], capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 0, result.stderr[-2000:]
        assert (out / "config.json").is_file() and "verified" in result.stderr
