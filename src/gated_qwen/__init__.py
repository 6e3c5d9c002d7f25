"""gated-qwen: the gated attention of Qiu et al. (2025) as a Hugging Face Transformers model.

Importing this package registers it, as flash-linear-attention and PEFT register theirs (`register()` below, which
lists what): `model_type="gated_qwen"` (dense) and `"gated_qwen_moe"` (mixture of experts) with the Auto classes,
the fused kernel as `attn_implementation="gated_triton"`, the reader of other checkpoint formats, the Hub push with
this package's model card, the paper's presets (`from_paper`) and PEFT's default LoRA targets.
"""

from .import_noise import import_noise_quieted

with import_noise_quieted():  # what torch and Transformers' optional imports warn about at import, nothing to act on
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    from .conversion.loading import read_other_formats
    from .integrations import gated_triton, model_card
    from .integrations.peft_defaults import register_peft_defaults
    from .model import modeling_gated, modeling_gated_moe
    from .model.configuration_gated import GatedQwenConfig
    from .model.configuration_gated_moe import GatedQwenMoeConfig
    from .model.modeling_gated import (
        GatedQwenForCausalLM,
        GatedQwenForQuestionAnswering,
        GatedQwenForSequenceClassification,
        GatedQwenForTokenClassification,
        GatedQwenModel,
        GatedQwenPreTrainedModel,
    )
    from .model.modeling_gated_moe import (
        GatedQwenMoeForCausalLM,
        GatedQwenMoeForQuestionAnswering,
        GatedQwenMoeForSequenceClassification,
        GatedQwenMoeForTokenClassification,
        GatedQwenMoeModel,
        GatedQwenMoePreTrainedModel,
    )
    from .paper_presets import from_paper

__version__ = "0.1.0"

__all__ = [
    "GatedQwenConfig", "GatedQwenMoeConfig",
    "GatedQwenPreTrainedModel", "GatedQwenModel", "GatedQwenForCausalLM", "GatedQwenForSequenceClassification",
    "GatedQwenForTokenClassification", "GatedQwenForQuestionAnswering",
    "GatedQwenMoePreTrainedModel", "GatedQwenMoeModel", "GatedQwenMoeForCausalLM",
    "GatedQwenMoeForSequenceClassification", "GatedQwenMoeForTokenClassification", "GatedQwenMoeForQuestionAnswering",
    "register",
]

_registered = False


def register() -> None:
    """Registers the package with Transformers and the libraries around it; importing the package runs it, and later
    calls do nothing:

    - the configs and models, dense and mixture of experts, with the Auto classes (config, base model, causal LM,
      sequence/token classification, question answering), each also for `trust_remote_code` folders (`auto_map`);
    - the fused Triton kernel as `attn_implementation="gated_triton"` (`integrations.gated_triton`), which the
      models (a saved folder's own code included) find in Transformers' attention registry;
    - the reader of other checkpoint formats (`gated-qwen convert --help` lists them): the loading step of
      `from_pretrained` and the config's `get_config_dict` of these classes (`conversion.loading.read_other_formats`),
      which the code a saved folder ships does not have;
    - the push to the Hub with this package's model card (`push_to_hub` of these models,
      `integrations.model_card.model_push_to_hub`);
    - the paper's models by name, `from_paper` of both configs (`paper_presets`);
    - PEFT's default LoRA targets (a no-op without PEFT).
    """
    global _registered
    if _registered:
        return
    _registered = True
    heads = ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
    autos = (AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification,
             AutoModelForQuestionAnswering)
    for config_class, modeling, prefix in ((GatedQwenConfig, modeling_gated, "GatedQwen"),
                                           (GatedQwenMoeConfig, modeling_gated_moe, "GatedQwenMoe")):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        config_class.register_for_auto_class()
        for auto, head in zip(autos, heads, strict=True):
            model = getattr(modeling, f"{prefix}{head}")
            auto.register(config_class, model, exist_ok=True)
            model.register_for_auto_class(auto.__name__)
    gated_triton.register()
    # Attached to the bases, so the mixture of experts' config and models have them too.
    read_other_formats(GatedQwenConfig, GatedQwenPreTrainedModel)
    GatedQwenPreTrainedModel.push_to_hub = model_card.model_push_to_hub
    GatedQwenConfig.from_paper = classmethod(from_paper)  # the paper's presets, data of the package
    register_peft_defaults()


register()
