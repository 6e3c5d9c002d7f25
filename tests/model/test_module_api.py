"""The package's modules keep `torch.nn.Module`'s API: libraries call it on any model (DeepSpeed's engine runs
`model.apply(fn)` at start-up; initialisation and inspection code does the same), so a method of ours that takes
one of its names with another meaning breaks them. Checked three ways: `model.apply(fn)` visits every submodule of
every model class; no class of the package overrides a method of its library base class with a signature that
would refuse the base's arguments; and no attribute of any submodule (set on the instance, or a class attribute or
property of the package's classes) takes the name of a method its class inherits."""

import importlib
import inspect
from pathlib import Path

import pytest
import torch

import gated_qwen
from gated_qwen import GatedQwenConfig, GatedQwenMoeConfig
from tests.helpers import TINY, TINY_MOE, sizes

HEADS = ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
# One of each kind of gate module: a gate projection, input-independent logits, the rmsnorm control, G5, no gate.
GATES = {
    "G1 elementwise": {},
    "G2 headwise": {"gate_position": "value", "gate_granularity": "headwise"},
    "input-independent": {"gate_input_dependent": False},
    "G5, layer 1 only": {"gate_position": "dense", "gate_layers": [1]},
    "rmsnorm control": {"gate_position": None, "sdpa_output_transform": "rmsnorm"},
}
MODELS = [(f"GatedQwen{head}", GatedQwenConfig, TINY, gate) for head in HEADS for gate in GATES] + [
    (f"GatedQwenMoe{head}", GatedQwenMoeConfig, sizes(TINY, **TINY_MOE, mlp_only_layers=[0]), "G1 elementwise")
    for head in HEADS]


@pytest.mark.parametrize("class_name, config_class, size, gate", MODELS,
                         ids=[f"{name}-{gate}" for name, _, _, gate in MODELS])
def test_model_apply_visits_every_submodule(class_name, config_class, size, gate):
    model = getattr(gated_qwen, class_name)(config_class(**size, **GATES[gate]))
    visited = []
    assert model.apply(visited.append) is model
    assert sorted(map(id, visited)) == sorted(map(id, model.modules()))
    assert len(visited) == len(list(model.modules()))

    # The idiom libraries use it for: a function applied to every Linear reaches the gate's projection too.
    model.apply(lambda m: torch.nn.init.zeros_(m.weight) if isinstance(m, torch.nn.Linear) else None)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(not m.weight.any() for m in linears)
    if gate in ("G1 elementwise", "G2 headwise"):
        layers = getattr(model, "model", model).layers
        assert all(not layer.self_attn.gate.g_proj.weight.any() for layer in layers)


# The kernel's `@triton.jit` modules, imported only where Triton is installed (the triton extra).
TRITON_ONLY = {"gated_qwen.kernel.jit_helpers", "gated_qwen.kernel.parallel", "gated_qwen.kernel.decoding"}


def _package_module_classes():
    """Every `nn.Module` subclass defined in the package's importable modules (the vLLM ones need vLLM, the kernel's
    Triton modules Triton)."""
    classes = {}
    root = Path(gated_qwen.__file__).parent
    for path in sorted(root.rglob("*.py")):  # files, not pkgutil: it skips model/, a namespace package
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name.startswith("gated_qwen.integrations.vllm"):
            continue
        if name in TRITON_ONLY and not gated_qwen.kernel.triton_available():
            continue
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, torch.nn.Module)
                    and value.__module__.startswith("gated_qwen.")):
                classes[f"{value.__module__}.{value.__qualname__}"] = value
    return classes


def _library_base_method(cls, name):
    """The first definition of `name` in `cls`'s MRO that is not the package's own, or None."""
    for base in cls.__mro__[1:]:
        if not base.__module__.startswith("gated_qwen") and name in vars(base):
            return base, vars(base)[name]
    return None


def _refusals(base_fn, own_fn) -> list[str]:
    """What a call that `base_fn`'s signature accepts would be refused by `own_fn`'s."""
    base, own = inspect.signature(base_fn), inspect.signature(own_fn)
    kinds = {p.kind for p in own.parameters.values()}
    problems = []
    for param in base.parameters.values():
        if param.kind is param.VAR_POSITIONAL and param.VAR_POSITIONAL not in kinds:
            problems.append(f"*{param.name}")
        elif param.kind is param.VAR_KEYWORD and param.VAR_KEYWORD not in kinds:
            problems.append(f"**{param.name}")
        elif param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD) and param.name not in own.parameters \
                and param.VAR_KEYWORD not in kinds:
            problems.append(param.name)
    for param in own.parameters.values():  # a new required argument: every existing caller would be refused
        if param.name not in base.parameters and param.default is param.empty \
                and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            problems.append(f"requires {param.name}")
    return problems


def test_no_class_of_the_package_hides_a_method_of_its_library_base():
    classes = _package_module_classes()
    assert "gated_qwen.model.gating.GatedQwenGate" in classes and "gated_qwen.model.modeling_gated.GatedQwenModel" in classes
    found = []
    for qualname, cls in classes.items():
        for name, value in vars(cls).items():
            if name.startswith("__") or not callable(getattr(value, "__func__", value)):
                continue
            base = _library_base_method(cls, name)
            if base is None:
                continue
            if name == "forward" and base[0] is torch.nn.Module:  # every module defines its own forward
                continue
            base_fn = getattr(base[1], "__func__", base[1])
            if not callable(base_fn):  # an attribute hook the base leaves unset (None), not a method
                continue
            problems = _refusals(base_fn, getattr(value, "__func__", value))
            if problems:
                found.append(f"{qualname}.{name} hides {base[0].__qualname__}.{name}: {problems}")
    assert not found, "\n".join(found)


def test_the_check_finds_a_shadowed_apply():
    """The check above on the mistake it is for (an `apply(position, y, logits)` as the gate once had)."""
    def apply(self, position, y, logits):
        return y

    assert _refusals(torch.nn.Module.apply, apply) == ["fn", "requires position", "requires y", "requires logits"]



def _hiding_attributes(module: torch.nn.Module) -> list[str]:
    """The attributes of `module` (its own, or its package classes' that are not methods) named as a method that its
    class inherits from a library base."""
    own = {name: value for cls in reversed(type(module).__mro__) if cls.__module__.startswith("gated_qwen.")
           for name, value in vars(cls).items()}
    own.update(vars(module))
    found = []
    for name, value in own.items():
        base = _library_base_method(type(module), name)
        if base is None or not inspect.isfunction(base[1]) or inspect.isfunction(value) \
                or isinstance(value, (classmethod, staticmethod)):
            continue
        found.append(f"{name} ({type(value).__name__}) hides {base[0].__qualname__}.{name}")
    return found


def test_no_attribute_of_a_module_hides_a_method():
    """An attribute under a method's name hides it as surely as a method does (`self.apply = ...` in `__init__`, or a
    class attribute or property of that name): none, on any submodule of any model class."""
    found = []
    for class_name, config_class, size, gate in MODELS:
        model = getattr(gated_qwen, class_name)(config_class(**size, **GATES[gate]))
        for module_name, module in model.named_modules():
            found += [f"{class_name}/{gate}: {module_name or 'model'}.{problem}" for problem in _hiding_attributes(module)]
    assert not found, "\n".join(sorted(set(found)))


def test_the_attribute_check_finds_a_hidden_method():
    gate = gated_qwen.GatedQwenForCausalLM(GatedQwenConfig(**TINY)).model.layers[0].self_attn.gate
    gate.train = False  # an instance attribute: `gate.train()` would now raise
    assert _hiding_attributes(gate) == ["train (bool) hides Module.train"]
