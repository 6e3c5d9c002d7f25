"""gated-qwen: the gated attention of Qiu et al. (2025) as a Hugging Face Transformers model.

Importing this package registers `model_type="gated_qwen"` (dense) and `"gated_qwen_moe"` (mixture of experts)
with Transformers; `register()` below is the one place that does so, and lists what is registered.

The import itself is instant: neither torch nor Transformers is loaded until something needs them (the `gated-qwen`
command answers `--help` without them). The registration runs as soon as it can: when a name of this package is
first used (`gated_qwen.GatedQwenForCausalLM`), right after Transformers is imported, or at once if Transformers
already is. `register()` runs it explicitly; it is idempotent.
"""

import importlib.abc
import sys

__version__ = "0.1.0"

# The public names: those of the config and modeling modules (a test checks that the lists agree).
__all__ = [
    "GatedQwenConfig", "GatedQwenMoeConfig",
    "GatedQwenPreTrainedModel", "GatedQwenModel", "GatedQwenForCausalLM", "GatedQwenForSequenceClassification",
    "GatedQwenForTokenClassification", "GatedQwenForQuestionAnswering",
    "GatedQwenMoePreTrainedModel", "GatedQwenMoeModel", "GatedQwenMoeForCausalLM",
    "GatedQwenMoeForSequenceClassification", "GatedQwenMoeForTokenClassification", "GatedQwenMoeForQuestionAnswering",
    "register",
]

# Modules of this package whose code is running right now. `register` imports the model's modules, which import
# most of the package, so it runs only when none is half-way through its own import (the last one to finish runs it).
_importing: set[str] = set()
_registered = False


def register() -> None:
    """Registers the package with Transformers and the libraries around it; runs once, later calls do nothing:

    - the configs and models, dense and mixture of experts, with the Auto classes (config, base model, causal LM,
      sequence/token classification, question answering), each also for `trust_remote_code` folders (`auto_map`);
    - the fused Triton kernel as `attn_implementation="gated_triton"` (`integrations.gated_triton`), which the
      models (a saved folder's own code included) find in Transformers' attention registry;
    - the reader of other checkpoint formats (`gated-qwen convert --help` lists them): the loading step of
      `from_pretrained` and the config's `get_config_dict` of these classes (`conversion.loading.read_other_formats`),
      which the code a saved folder ships does not have;
    - the push to the Hub with this package's model card (`push_to_hub` of these models,
      `integrations.hub.model_push_to_hub`);
    - PEFT's default LoRA targets (a no-op without PEFT).
    """
    global _registered
    if _registered:
        return
    _registered = True
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    from .conversion.loading import read_other_formats
    from .integrations import gated_triton, hub
    from .integrations.peft_defaults import register_peft_defaults
    from .model import modeling_gated, modeling_gated_moe
    from .model.configuration_gated import GatedQwenConfig, GatedQwenMoeConfig

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
    read_other_formats(GatedQwenConfig, modeling_gated.GatedQwenPreTrainedModel)
    modeling_gated.GatedQwenPreTrainedModel.push_to_hub = hub.model_push_to_hub
    register_peft_defaults()


def _register_when_possible(finished: str | None = None) -> None:
    if not _registered and "transformers" in sys.modules and not _importing - {finished}:
        register()


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Runs `register` right after `transformers`, or a module of this package that imported it, is imported.

    It wraps the loader of those modules only (the spec is the one the rest of `sys.meta_path` finds) and removes
    itself once the registration has run."""

    def find_spec(self, fullname, path, target=None):
        if _registered:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            return None
        if fullname != "transformers" and not fullname.startswith(f"{__name__}."):
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            _importing.add(fullname)
            try:
                exec_module(module)
            finally:
                _importing.discard(fullname)
            _register_when_possible(finished=fullname)

        loader.exec_module = exec_then_register  # this spec's own loader instance
        return spec


def __getattr__(name: str):
    """The public classes, imported on first use (so that the command line needs neither torch nor Transformers)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .model import configuration_gated, modeling_gated, modeling_gated_moe

    _register_when_possible()
    for module in (configuration_gated, modeling_gated, modeling_gated_moe):
        if name in module.__all__:
            globals()[name] = getattr(module, name)
            return globals()[name]
    raise AttributeError(f"module {__name__!r} lists {name!r} but no module defines it")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if "transformers" in sys.modules:
    register()
else:
    sys.meta_path.insert(0, _RegisterOnImport())
