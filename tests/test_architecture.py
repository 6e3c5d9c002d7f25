"""The seams of the package, checked where a change could quietly break them: one name per tensor (on disk as in
memory, so a gated_qwen folder loads with no conversion and Transformers' own reverse-mapping check passes), a saved
folder that ships only the code a saved model runs, no import circle, and the gate registry as the one source of the
config's allowed values."""

import ast
import copy
import importlib
import json
import re
import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
from transformers.core_model_loading import PrefixChange, WeightRenaming

import gated_qwen
from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, GatedQwenMoeConfig, GatedQwenMoeForCausalLM
from gated_qwen.model import configuration_gated, configuration_gated_moe, gating, modeling_gated, modeling_gated_moe
from tests.helpers import SMALL, TINY, TINY_MOE, randomize_, sizes

PACKAGE = Path(gated_qwen.__file__).parent
VARIANTS = {  # one of each kind of gate tensor, and a model without any
    "G1 elementwise": dict(),
    "G2 headwise, bias": dict(gate_position="value", gate_granularity="headwise", gate_bias=True),
    "input-independent": dict(gate_input_dependent=False),
    "G5, layer 1": dict(gate_position="dense", gate_layers=[1]),
    "rmsnorm control": dict(gate_position=None, sdpa_output_transform="rmsnorm"),
    "no gate": dict(gate_position=None),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_gated_qwen_folder_holds_the_models_own_names_and_loads_with_no_conversion(tmp_path, variant):
    model = randomize_(GatedQwenForCausalLM(GatedQwenConfig(**TINY, **VARIANTS[variant])), seed=1)
    assert get_model_conversion_mapping(model, add_legacy=False) == []  # nothing between the folder and the model
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    expected = {name for name in model.state_dict() if name != "lm_head.weight"}  # tied to the embedding
    assert set(saved) == expected
    assert any(".self_attn.gate." in name for name in saved) == (variant != "no gate")
    loaded, info = GatedQwenForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_mixture_of_experts_folder_has_qwen3_moes_expert_layout_and_nothing_else():
    model = GatedQwenMoeForCausalLM(GatedQwenMoeConfig(**sizes(SMALL, **TINY_MOE)))
    names = [repr(t) for t in get_model_conversion_mapping(model, add_legacy=False)]
    assert names == [repr(t) for t in get_checkpoint_conversion_mapping("qwen3_moe")]


@pytest.mark.parametrize("model_class, config", [
    (GatedQwenForCausalLM, GatedQwenConfig(**TINY)),
    (GatedQwenMoeForCausalLM, GatedQwenMoeConfig(**sizes(SMALL, **TINY_MOE, mlp_only_layers=[0]))),
], ids=["dense", "mixture of experts"])
def test_transformers_reverse_loading_mapping_check(tmp_path, model_class, config):
    """Transformers' `test_reverse_loading_mapping` (tests/test_modeling_common.py, which the wheel does not ship),
    written out: each registered conversion's source patterns match the keys `save_pretrained` writes (the mapping
    reverses), and a model saved, loaded and saved again gives the same state dicts. The dense model has no
    conversion (Transformers skips the check then); the mixture of experts has Qwen3-MoE's."""
    model = model_class(copy.deepcopy(config))
    model_keys = set(model.state_dict())
    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    model.save_pretrained(tmp_path / "a")
    serialized = set(load_file(tmp_path / "a" / "model.safetensors"))
    if conversions:
        assert serialized != model_keys, "no key mapping was performed"
    for conversion in conversions:
        for pattern in conversion.source_patterns:
            if isinstance(conversion, WeightRenaming) and pattern.startswith("lm_head"):
                continue
            assert any(re.search(pattern, key) for key in serialized), (pattern, conversion)
    reloaded = model_class.from_pretrained(tmp_path / "a")
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    reloaded.save_pretrained(tmp_path / "b")
    first, second = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


# What a saved folder ships is exactly src/gated_qwen/model/ (a namespace package: no __init__.py to ship): the config,
# the gate, the model and the Transformers version seam, with the mixture of experts' modeling file where it is one,
# as a Transformers model folder holds its configuration and modeling files.
MODEL = PACKAGE / "model"
MOE_ONLY = {"configuration_gated_moe.py", "modeling_gated_moe.py"}
# What the package adds to the shipped classes when it is imported (`gated_qwen.register`), never their own code
# (their `from_pretrained` is their own: it refuses a missing gate tensor; the package replaces only the loading step
# it calls, `_read_pretrained`, with one that also reads other formats).
PACKAGE_HOOKS = {"read_other_formats", "read_pretrained", "push_to_hub", "checkpoint_reader", "hub_push", "from_paper",
                 "PAPER_PRESETS"}
# Registration with the Auto classes is the package's (`gated_qwen.register`), never a shipped file's.
AUTO_REGISTRATION = {"register_for_auto_class", "AutoConfig", "AutoModel", "AutoModelForCausalLM"}


@pytest.mark.parametrize("model_class, config", [
    (GatedQwenForCausalLM, GatedQwenConfig(**TINY)),
    (GatedQwenMoeForCausalLM, GatedQwenMoeConfig(**sizes(SMALL, **TINY_MOE))),
], ids=["dense", "mixture of experts"])
def test_a_saved_folder_ships_the_model_folder_and_nothing_of_the_package(tmp_path, model_class, config):
    """What `save_pretrained` writes is exactly src/gated_qwen/model/ (less the mixture of experts' file for a dense
    model), at most 1,600 lines for the dense model; these files import nothing from outside model/ (the fused
    kernel is found in Transformers' attention registry), register nothing with the Auto classes and contain no
    package hook; Transformers' remote-code import check asks for nothing of the package."""
    from transformers.dynamic_module_utils import get_imports

    model_class(config).save_pretrained(tmp_path)
    shipped = {path.name for path in tmp_path.glob("*.py")}
    moe = model_class is GatedQwenMoeForCausalLM
    assert shipped == {path.name for path in MODEL.glob("*")} - (set() if moe else MOE_ONLY)
    if not moe:
        lines = {p.name: len(p.read_text().splitlines()) for p in tmp_path.glob("*.py")}
        assert sum(lines.values()) <= 1600 and lines["configuration_gated.py"] < lines["modeling_gated.py"]
    for path in tmp_path.glob("*.py"):
        assert path.read_bytes() == (MODEL / path.name).read_bytes()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and f"{node.module}.py" in shipped, (path.name, node.module)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not [name for name in names if name.split(".")[0] == "gated_qwen"], (path.name, names)
            if isinstance(node, (ast.FunctionDef, ast.Name, ast.Attribute)):
                name = getattr(node, "name", None) or getattr(node, "id", None) or getattr(node, "attr", None)
                assert name not in PACKAGE_HOOKS | AUTO_REGISTRATION, (path.name, name, node.lineno)
        # What trust_remote_code demands to be installed: neither the package, nor what the fused kernel needs
        # (`kernels`, for the Hub kernel config.json may name, is imported only inside try).
        assert not {"gated_qwen", "kernels", "triton"} & set(get_imports(path)), path.name
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert {ref.split(".")[0] + ".py" for ref in auto_map.values()} <= shipped


def test_the_package_registers_its_kernel_reader_and_push_for_the_shipped_classes():
    """Importing the package registered its fused kernel in Transformers' attention registry, where the shipped
    model finds it (with the attributes it asks: `applies_output_gate`, `runs_by_default`), and attached the reader
    and the push to the shipped bases (the mixture of experts inherits them)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from gated_qwen.conversion import loading
    from gated_qwen.integrations import gated_triton, model_card
    from gated_qwen.kernel import attention

    registered = ALL_ATTENTION_FUNCTIONS[gating.FUSED_ATTENTION]
    assert registered is gated_triton.gated_triton_attention_forward and gating.applies_output_gate(registered)
    assert registered is attention.gated_attention_forward  # the kernel's own, which the Hub kernel carries too
    assert registered.runs_by_default is gated_triton.runs_by_default
    assert attention.ATTENTION_NAME == gating.FUSED_ATTENTION  # the name the kernel's messages use
    assert not gating.applies_output_gate(ALL_ATTENTION_FUNCTIONS["sdpa"])
    base = modeling_gated.GatedQwenPreTrainedModel
    assert base.push_to_hub is model_card.model_push_to_hub
    assert base._read_pretrained.__func__.__module__ == loading.__name__
    assert GatedQwenConfig.get_config_dict.__func__.__module__ == loading.__name__
    assert GatedQwenMoeForCausalLM._read_pretrained.__func__ is base._read_pretrained.__func__


def _imports(path: Path, module: str) -> set[str]:
    """The modules of this package that `module` (at `path`) imports, at module level or inside functions."""
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            for alias in node.names:  # `from . import x` imports the submodule x where there is one
                candidate = f"{target}.{alias.name}"
                found.add(candidate if _module_path(candidate) else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "gated_qwen" or name.startswith("gated_qwen.")}


def _module_path(module: str) -> Path | None:
    parts = module.split(".")[1:]
    for candidate in (PACKAGE.joinpath(*parts).with_suffix(".py"), PACKAGE.joinpath(*parts, "__init__.py")):
        if parts and candidate.is_file() or not parts and candidate.name == "__init__.py":
            return candidate
    return None


def test_no_import_circle():
    """No module of the package reaches itself through imports, counting those inside functions too (where a
    circle hides until the function runs)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[module] = _imports(path, module) - {module}
    state = {}

    def visit(module, trail):
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", " -> ".join([*trail[trail.index(module):], module])
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            visit(imported, [*trail, module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])


def test_the_integrations_import_nothing_from_the_package_above_them():
    """integrations/ plugs the lower rooms (model, kernel, files, conversion) into other libraries: none of its
    modules imports the package's front door (`gated_qwen/__init__.py`), which imports them."""
    for path in (PACKAGE / "integrations").glob("*.py"):
        module = "gated_qwen.integrations" + ("" if path.name == "__init__.py" else f".{path.stem}")
        assert "gated_qwen" not in _imports(path, module), path.name


def test_the_gate_registry_is_the_one_source_of_the_configs_values():
    """Each gate field accepts exactly the registry's values (adding an activation is one entry of
    `gating.ACTIVATIONS`), and the package's public names are those its modules define."""
    fields = GatedQwenConfig.__dataclass_fields__
    assert typing.get_args(fields["gate_granularity"].type) == gating.GRANULARITIES
    assert typing.get_args(fields["gate_combine"].type) == tuple(gating.COMBINES)
    assert typing.get_args(fields["gate_activation"].type) == tuple(gating.ACTIVATIONS)
    assert typing.get_args(typing.get_args(fields["sdpa_output_transform"].type)[0]) == gating.SDPA_OUTPUT_TRANSFORMS
    assert {k: fields[k].default for k in gating.DEFAULTS} == gating.DEFAULTS
    defined = {*configuration_gated.__all__, *configuration_gated_moe.__all__, *modeling_gated.__all__,
               *modeling_gated_moe.__all__, "register"}
    assert set(gated_qwen.__all__) == defined


def _strings_compared(tree: ast.AST):
    """`(line, string)` for every string literal that a comparison, a `match` case or a subscript holds (directly or
    in a tuple, list or set literal): where code matches a name."""
    def literals(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for element in node.elts:
                yield from literals(element)

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        elif isinstance(node, ast.Subscript):
            operands = [node.slice]
        else:
            continue
        for operand in operands:
            for value in literals(operand):
                yield node.lineno, value


def test_no_format_name_is_compared_outside_its_own_module():
    """A checkpoint format's name (`--from` / `--to`) is matched as a string only in the module that defines its
    `Format`: everywhere else code asks the format object (so a new format is its module and one registry line)."""
    from gated_qwen.conversion import formats
    from gated_qwen.conversion.formats import FORMATS

    owners = {}
    for path in (PACKAGE / "conversion").rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        owners |= {fmt.name: path for fmt in FORMATS.values() if any(value is fmt for value in vars(module).values())
                   and module is not formats}
    assert set(owners) == set(FORMATS)  # every format is defined in its own module of conversion/formats/
    assert {path.parent.name for path in owners.values()} == {"formats"}
    found = [f"{path.relative_to(PACKAGE)}:{line} matches {value!r}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for line, value in _strings_compared(ast.parse(path.read_text()))
             if value in FORMATS and owners[value] != path]
    assert not found, "\n".join(found)


MAX_FUNCTION_LINES = 80


def test_no_function_is_longer_than_80_lines():
    """Every function and method of src/ (nested ones too) fits in 80 lines, from `def` to its last line: a longer
    one reads as several steps that want names."""
    lengths = {f"{path.relative_to(PACKAGE).as_posix()}:{node.name}": node.end_lineno - node.lineno + 1
               for path in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    too_long = {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES}
    assert not too_long, too_long


def test_no_module_of_the_file_safety_library_is_longer_than_400_lines():
    """src/gated_qwen/files/ is split by job (identity checks, staging and publishing, scratch folders, reading):
    no module of it grows past 400 lines."""
    lengths = {path.name: len(path.read_text().splitlines()) for path in (PACKAGE / "files").glob("*.py")}
    assert lengths and max(lengths.values()) <= 400, lengths


def test_contributings_layout_names_every_folder():
    """CONTRIBUTING.md's layout matches the tree, folder by folder: each folder of src/gated_qwen that holds modules
    is listed under its parent (by indentation), and every folder it lists exists."""
    root = PACKAGE.parents[1]
    text = (root / "CONTRIBUTING.md").read_text()
    layout = text[text.index("## Layout"):].split("```text\n", 1)[1].split("```", 1)[0]
    listed, parents = [], []  # parents: the folders the current line lies in, outermost first
    for line in layout.splitlines():
        indent, name = len(line) - len(line.lstrip()), line.split()[0]
        parents = parents[: indent // 2]
        if name.endswith("/"):
            listed.append("".join(parents) + name)
            parents.append(name)
    package = {(path.parent.relative_to(root).as_posix() + "/") for path in PACKAGE.rglob("*.py")}
    assert sorted(package - set(listed)) == []
    assert [name for name in listed if not (root / name).is_dir()] == []
