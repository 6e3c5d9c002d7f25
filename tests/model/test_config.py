"""GatedQwenConfig validation: every refusal names the field, the bad value and what is allowed (the property-based
check over the whole gate space is test_config_properties.py)."""


import pytest
import torch

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.model.configuration_gated import CONFIG_ERRORS
from gated_qwen.model.gating import gate_shape, gated_layers
from tests.helpers import TINY, sizes


def config(**fields) -> GatedQwenConfig:
    return GatedQwenConfig(**sizes(TINY, **fields))


def test_defaults_are_the_papers_recommendation():
    c = GatedQwenConfig()
    assert (c.gate_position, c.gate_granularity, c.gate_shared_across_heads, c.gate_combine, c.gate_activation,
            c.gate_input_dependent, c.gate_bias, c.gate_layers) == (
        "sdpa", "elementwise", False, "multiply", "sigmoid", True, False, None)
    assert gated_layers(c) == list(range(c.num_hidden_layers))


@pytest.mark.parametrize("alias, name", [("G1", "sdpa"), ("G2", "value"), ("g3", "key"), ("G4", "query"),
                                         ("G5", "dense")])
def test_paper_aliases(alias, name):
    c = config(gate_position=alias)
    assert c.gate_position == name
    assert GatedQwenConfig.from_dict(c.to_dict()).gate_position == name


@pytest.mark.parametrize(
    "fields, named, allowed",
    [
        (dict(gate_position="G6"), "gate_position", "'sdpa'"),
        (dict(gate_position="output"), "gate_position", "'dense'"),
        (dict(gate_granularity="rowwise"), "gate_granularity", "'headwise'"),
        (dict(gate_combine="mul"), "gate_combine", "'multiply'"),
        (dict(gate_activation="tanh"), "gate_activation", "'ns_sigmoid'"),
        (dict(gate_shared_across_heads="yes"), "gate_shared_across_heads", "expected bool"),
        (dict(gate_input_dependent=1), "gate_input_dependent", "expected bool"),
        (dict(gate_bias=None), "gate_bias", "expected bool"),
        (dict(gate_layers=[0, 2]), "gate_layers", "[0, 2)"),
        (dict(gate_layers=[1, 1]), "gate_layers", "distinct"),
        (dict(gate_layers=[]), "gate_layers", "non-empty"),
        (dict(gate_layers="all"), "gate_layers", "None"),
        (dict(sdpa_output_transform="layernorm"), "sdpa_output_transform", "'rmsnorm'"),
        (dict(num_key_value_heads=3), "num_key_value_heads", "divide"),
        (dict(head_dim=7), "head_dim", "even"),
        (dict(hidden_size=0), "hidden_size", "positive"),
        (dict(use_qk_norm="on"), "use_qk_norm", "expected bool"),
        (dict(gate_postion="value"), "gate_postion", "gate_position"),
        # combinations the paper does not define
        (dict(gate_position="dense", gate_granularity="headwise"), "gate_granularity", "no heads"),
        (dict(gate_position="G5", gate_shared_across_heads=True), "gate_shared_across_heads", "no heads"),
        (dict(sdpa_output_transform="rmsnorm"), "sdpa_output_transform", "without a gate"),
        (dict(gate_input_dependent=False, gate_bias=True), "gate_bias", "redundant"),
        (dict(gate_position=None, gate_granularity="headwise"), "gate_granularity", "no effect"),
        (dict(gate_position=None, gate_layers=[0]), "gate_layers", "no effect"),
        # the Hub kernel of a saved folder: a repository id and a commit of it, both or neither
        (dict(hub_kernel_repo="gated-qwen-kernel", hub_kernel_revision="0" * 40), "hub_kernel_repo", "'owner/name'"),
        (dict(hub_kernel_repo="org/kernel", hub_kernel_revision="main"), "hub_kernel_revision", "not a branch"),
        (dict(hub_kernel_repo="org/kernel", hub_kernel_revision="ABCDEF" + "0" * 34), "hub_kernel_revision", "40"),
        (dict(hub_kernel_repo="org/kernel"), "hub_kernel_revision", "both, or neither"),
        (dict(hub_kernel_revision="0" * 40), "hub_kernel_repo", "both, or neither"),
    ],
)
def test_refusals_name_the_field_and_the_fix(fields, named, allowed):
    with pytest.raises(CONFIG_ERRORS) as error:
        config(**fields)
    message = str(error.value)
    assert named in message and allowed in message, message


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("gate_position", "bogus", "'sdpa'"),
        ("gate_granularity", "rowwise", "'headwise'"),
        ("gate_combine", "mul", "'multiply'"),
        ("gate_activation", "tanh", "'ns_sigmoid'"),
        ("gate_bias", "yes", "expected bool"),
        ("gate_layers", [], "non-empty"),
        ("sdpa_output_transform", "layernorm", "'rmsnorm'"),
        ("head_dim", 7, "even"),
        ("hub_kernel_repo", "org/kernel/extra", "'owner/name'"),
        ("hub_kernel_revision", "v1", "commit hash"),
    ],
)
def test_assignment_after_construction_is_checked(field, value, allowed):
    """As in Qwen3Config (a strict dataclass): a bad value set on a built config is refused, naming the field (the
    mixture-of-experts fields: test_moe.py)."""
    c = config()
    before = getattr(c, field)
    with pytest.raises(CONFIG_ERRORS) as error:
        setattr(c, field, value)
    assert field in str(error.value) and allowed in str(error.value), str(error.value)
    assert getattr(c, field) == before


def test_rules_across_fields_are_checked_by_validate_after_assignment():
    c = config(gate_position="dense")
    c.gate_granularity = "headwise"  # each field is valid alone; together they are not
    with pytest.raises(CONFIG_ERRORS, match="no heads"):
        c.validate()
    c = config()
    c.num_key_value_heads = 3
    with pytest.raises(CONFIG_ERRORS, match="divide"):
        c.validate()


def test_a_hub_kernel_is_set_at_save_time_and_empty_by_default(tmp_path):
    """`hub_kernel_repo` / `hub_kernel_revision` (docs/kernel.md): None by default, set on a built config together,
    written to config.json and read back; one without the other is refused by `validate()` (save_pretrained)."""
    c = config()
    assert (c.hub_kernel_repo, c.hub_kernel_revision) == (None, None)
    c.hub_kernel_repo = "org/gated-qwen-kernel"
    with pytest.raises(CONFIG_ERRORS, match="needs `hub_kernel_revision` too"):
        c.validate()
    c.hub_kernel_revision = "0123456789abcdef" * 2 + "01234567"
    c.save_pretrained(tmp_path)
    again = GatedQwenConfig.from_pretrained(tmp_path)
    assert (again.hub_kernel_repo, again.hub_kernel_revision) == (c.hub_kernel_repo, c.hub_kernel_revision)


def test_assigned_paper_names_are_stored_as_the_config_names():
    c = config()
    c.gate_position = "G2"
    assert c.gate_position == "value" and gate_shape(c) == (TINY["num_key_value_heads"], TINY["head_dim"])


def test_presets_build_on_the_meta_device():
    for preset in ("dense-1.7b-28l", "dense-1.7b-48l"):
        c = GatedQwenConfig.from_paper(preset, gate_position="G2", gate_granularity="headwise")
        with torch.device("meta"):
            model = GatedQwenForCausalLM(c)
        assert model.model.layers[0].self_attn.gate.g_proj.weight.is_meta
        assert model.model.layers[0].self_attn.gate.g_proj.out_features == c.num_key_value_heads


@pytest.mark.parametrize("cls", ["GatedQwenConfig", "GatedQwenMoeConfig"])
def test_the_configs_docstring_example_builds_the_model_it_describes(cls):
    """The example a saved folder's config file carries uses only what the folder has (no package function)."""
    import gated_qwen

    config_class = getattr(gated_qwen, cls)
    lines = [line.strip()[4:] for line in config_class.__doc__.splitlines() if line.strip()[:4] in (">>> ", "... ")]
    namespace = {name: getattr(gated_qwen, name) for name in (cls, cls.replace("Config", "ForCausalLM"))}
    exec("\n".join(lines), namespace)
    assert type(namespace["config"]) is config_class and namespace["config"].gate_granularity == "headwise"
    assert namespace["model"].config is namespace["config"]
