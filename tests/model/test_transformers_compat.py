"""The compatibility seam (`gated_qwen/transformers_compat.py`): each name it chooses does, under the installed
Transformers, what the model files need; and the package's tie to Transformers' internals holds (the reading class
of conversion/loading.py with its `__class__` swap). `make test` runs this under the lock's 5.25, `make test-serving` under 5.19 (vLLM's pin), `make test-compat` under 5.17 (the GPU
machine's image), and tests/serving/test_shipped_files.py runs the saved model files under each version met.

References are independent of the seam: hand-written slices and masks, the registry Transformers' tensor
parallelism reads, generation without a cache, the stock Qwen3 model."""

import pytest
import torch

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.model import transformers_compat as compat
from tests.helpers import SMALL, randomize_


def test_slice_logits_to_keep_keeps_the_last_positions_or_the_given_ones():
    hidden = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    assert torch.equal(compat.slice_logits_to_keep(hidden, 0), hidden)
    assert torch.equal(compat.slice_logits_to_keep(hidden, 2), hidden[:, 3:])
    assert torch.equal(compat.slice_logits_to_keep(hidden, torch.tensor([0, 4])), hidden[:, [0, 4]])


@pytest.mark.parametrize("keep", [0, 1, 3, torch.tensor([0, 4])], ids=["0", "1", "3", "tensor"])
def test_the_slice_of_the_releases_without_the_helper_gives_the_logits_kept(keep, monkeypatch):
    """5.17 - 5.19 have no `modeling_utils.slice_logits_to_keep`: the seam's own slice then runs before `lm_head`.
    Run here in the helper's place (a spy asserts it ran): the logits with `logits_to_keep` are the full forward's
    logits at the kept positions, sliced by hand; and it slices as the installed Transformers' helper does."""
    from transformers import modeling_utils

    from gated_qwen.model import modeling_gated

    hidden = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0))
    if hasattr(modeling_utils, "slice_logits_to_keep"):
        assert torch.equal(compat._qwen3_slice_logits_to_keep(hidden, keep),
                           modeling_utils.slice_logits_to_keep(hidden, keep))
    calls = []

    def older_releases_slice(hidden_states, logits_to_keep):
        calls.append(logits_to_keep)
        return compat._qwen3_slice_logits_to_keep(hidden_states, logits_to_keep)

    monkeypatch.setattr(modeling_gated, "slice_logits_to_keep", older_releases_slice)
    model = randomize_(GatedQwenForCausalLM(GatedQwenConfig(**SMALL)), seed=4, scale=0.3).eval()
    prompt = torch.tensor([[3, 14, 15, 9, 2], [7, 1, 8, 2, 8]])
    with torch.no_grad():
        full = model(prompt).logits
        kept = model(prompt, logits_to_keep=keep).logits
    positions = list(range(5)) if isinstance(keep, int) and keep == 0 else (
        list(range(5 - keep, 5)) if isinstance(keep, int) else keep.tolist())
    torch.testing.assert_close(kept, full[:, positions])  # float32 defaults: lm_head over fewer rows
    assert len(calls) == 2


def test_causal_mask_takes_the_cache_and_masks_padding_and_the_future():
    config = GatedQwenConfig(**SMALL)
    config._attn_implementation = "eager"
    padding = torch.tensor([[0, 1, 1, 1]])
    mask = compat.create_causal_mask(config=config, inputs_embeds=torch.zeros(1, 4, SMALL["hidden_size"]),
                                     attention_mask=padding, cache=None, position_ids=torch.arange(4)[None])
    allowed = torch.tril(torch.ones(4, 4, dtype=torch.bool)) & padding.bool()  # query i sees keys j <= i, not padding
    assert torch.equal(mask[0, 0] == 0, allowed)


def test_generation_with_the_cache_matches_generation_without_it():
    # The causal LM hands its cache back under CACHE_FIELD; under a wrong name `generate` would lose it.
    model = randomize_(GatedQwenForCausalLM(GatedQwenConfig(**SMALL)), seed=3, scale=0.3).eval()
    prompt = torch.tensor([[3, 14, 15, 9, 2, 6]])
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
        recomputed = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=0)
        output = model(prompt, use_cache=True)
    assert torch.equal(cached, recomputed)
    assert output[compat.CACHE_FIELD].get_seq_length() == prompt.shape[1]


def test_head_shared_gate_style_is_in_the_registry_tensor_parallelism_reads():
    from transformers.distributed import tensor_parallel

    GatedQwenForCausalLM(GatedQwenConfig(**SMALL))  # a model registers the style when it is built
    assert compat.ALL_PARALLEL_STYLES is tensor_parallel.ALL_PARALLEL_STYLES
    assert "head_shared_gate" in tensor_parallel.ALL_PARALLEL_STYLES


def test_head_shared_gate_style_takes_the_arguments_tensor_parallelism_passes():
    """Each hook the style overrides takes every parameter of the installed Transformers' own (5.25 added `config`),
    and nothing more without a default."""
    import inspect

    from transformers.distributed import tensor_parallel

    GatedQwenForCausalLM(GatedQwenConfig(**SMALL))  # a model registers the style when it is built
    style = type(tensor_parallel.ALL_PARALLEL_STYLES["head_shared_gate"])
    hooks = [name for name in vars(style) if callable(getattr(compat.TensorParallelLayer, name, None))]
    assert "transform_output_post_forward" in hooks
    for name in hooks:
        expected = inspect.signature(getattr(compat.TensorParallelLayer, name)).parameters
        ours = inspect.signature(getattr(style, name)).parameters
        assert list(ours)[:len(expected)] == list(expected), name
        assert all(p.default is not p.empty for p in list(ours.values())[len(expected):]), name


# ------------------------------------------------------------------------ the package's ties to Transformers' internals
def test_another_format_is_read_through_a_reading_class_and_given_back_the_class_asked_for(tmp_path):
    """conversion/loading.py: Transformers finds load-time conversions by the name of the class it builds, so a stock
    Qwen3 folder with a gate added is loaded through a subclass registered under its own name (the format's rules as
    `WeightConverter`s), and the loaded model is then given back the class asked for (`__class__` reassigned). The
    rules ran (the added sigmoid gate halves the attention output until o_proj is doubled: the stock logits only
    come out if they did), the model is the requested class and saves the gated_qwen layout, which loads with no
    conversion."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    from gated_qwen.conversion import loading
    from gated_qwen.conversion.formats import FORMATS

    stock = randomize_(Qwen3ForCausalLM(Qwen3Config(**SMALL)), seed=4).eval()
    stock.save_pretrained(tmp_path / "qwen3")
    model = GatedQwenForCausalLM.from_pretrained(tmp_path / "qwen3", gate_position="sdpa").eval()
    assert type(model) is GatedQwenForCausalLM
    reading = loading.reading_class(GatedQwenForCausalLM, FORMATS["qwen3"])
    assert issubclass(reading, GatedQwenForCausalLM) and get_checkpoint_conversion_mapping(reading.__name__)
    prompt = torch.tensor([[3, 14, 15, 9, 2, 6]])
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, stock(prompt).logits, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "gated")
    reloaded, info = GatedQwenForCausalLM.from_pretrained(tmp_path / "gated", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert all(torch.equal(reloaded.state_dict()[name], t) for name, t in model.state_dict().items())


def test_the_cache_is_kept_off_device_placement_under_the_name_the_installed_transformers_uses():
    """With `device_map` dispatch, Accelerate leaves the forward argument these keys name where it is: the cache,
    named as the installed Transformers' own models name it (`cache` from 5.2x, `past_key_values` before)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel

    assert GatedQwenForCausalLM._skip_keys_device_placement == Qwen3PreTrainedModel._skip_keys_device_placement


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_plan_assigned_as_5_17_to_5_19_do_keeps_the_derived_rules_and_stays_out_of_config_json(moe):
    """5.17 - 5.19 assign the config's plan with their tied-embedding rule added (`derived_plan`): the config then
    gives the plan it derives from its fields plus that rule, again after a second assignment, and config.json
    holds no plan."""
    from gated_qwen import GatedQwenMoeConfig

    fields = dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if moe else SMALL
    cls = GatedQwenMoeConfig if moe else GatedQwenConfig
    config, derived = cls(**fields), cls(**fields).base_model_tp_plan
    config.base_model_tp_plan = {**config.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    config.base_model_tp_plan = {**config.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    assert config.base_model_tp_plan == {**derived, "embed_tokens": "embedding_rowwise"}
    config.gate_granularity = "headwise"  # the derived rules follow the fields; the assigned one stays
    assert config.base_model_tp_plan == {**cls(**fields, gate_granularity="headwise").base_model_tp_plan,
                                         "embed_tokens": "embedding_rowwise"}
    assert "base_model_tp_plan" not in config.to_dict()
