"""gated-qwen: the gated attention of Qiu et al. (2025) as a Hugging Face Transformers model.

Importing this package registers `model_type="gated_qwen"` with the Auto classes, so `AutoConfig`,
`AutoModelForCausalLM` & co. read gated_qwen folders, and gives PEFT its default LoRA targets.

The import itself is instant: neither torch nor Transformers is loaded until something needs them (the `gated-qwen`
command answers `--help` without them). The registration runs as soon as it can: when a name of this package is
first used (`gated_qwen.GatedQwenForCausalLM`), when Transformers is imported, or at once if Transformers already is.
`register()` runs it explicitly; it is idempotent.
"""

import importlib
import importlib.abc
import sys

__version__ = "0.1.0"

# Public name -> the module of this package that defines it.
_EXPORTS = {
    "GatedQwenConfig": "configuration_gated",
    "GatedQwenPreTrainedModel": "modeling_gated",
    "GatedQwenModel": "modeling_gated",
    "GatedQwenForCausalLM": "modeling_gated",
    "GatedQwenForSequenceClassification": "modeling_gated",
    "GatedQwenForTokenClassification": "modeling_gated",
    "GatedQwenForQuestionAnswering": "modeling_gated",
}
__all__ = [*_EXPORTS, "register"]

# The modules `register` imports; it can run only while none of them is half-way through its own import.
_NEEDED = {f"{__name__}.{module}" for module in ("configuration_gated", "modeling_gated", "hub", "peft_defaults")}
_importing: set[str] = set()  # modules of this package whose code is running right now
_registered = False


def register() -> None:
    """Registers GatedQwen with Transformers' Auto classes (config, base model, causal LM, sequence/token
    classification, question answering, each also for `trust_remote_code` folders through `auto_map`), PEFT's
    default targets and the package's Hub card for `push_to_hub`. Runs once; later calls do nothing."""
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

    configuration = importlib.import_module(".configuration_gated", __name__)
    modeling = importlib.import_module(".modeling_gated", __name__)
    config_class = configuration.GatedQwenConfig
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    config_class.register_for_auto_class()
    for auto, model in (
        (AutoModel, modeling.GatedQwenModel),
        (AutoModelForCausalLM, modeling.GatedQwenForCausalLM),
        (AutoModelForSequenceClassification, modeling.GatedQwenForSequenceClassification),
        (AutoModelForTokenClassification, modeling.GatedQwenForTokenClassification),
        (AutoModelForQuestionAnswering, modeling.GatedQwenForQuestionAnswering),
    ):
        auto.register(config_class, model, exist_ok=True)
        model.register_for_auto_class(auto.__name__)
    importlib.import_module(".peft_defaults", __name__).register_peft_defaults()  # a no-op without PEFT
    importlib.import_module(".hub", __name__).install_card(modeling.GatedQwenPreTrainedModel)


def _register_when_possible(finished: str | None = None) -> None:
    if not _registered and "transformers" in sys.modules and not (_importing - {finished}) & _NEEDED:
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
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    _register_when_possible()
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if "transformers" in sys.modules:
    register()
else:
    sys.meta_path.insert(0, _RegisterOnImport())
