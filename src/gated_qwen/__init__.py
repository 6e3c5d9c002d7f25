"""gated-qwen: the gated attention of Qiu et al. (2025) as a Hugging Face Transformers model.

Importing this package registers `model_type="gated_qwen"` with the Auto classes.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from .configuration_gated import GatedQwenConfig
from .hub import push_card_if_missing
from .modeling_gated import (
    GatedQwenForCausalLM,
    GatedQwenForSequenceClassification,
    GatedQwenModel,
    GatedQwenPreTrainedModel,
)
from .peft_defaults import register_peft_defaults

AutoConfig.register(GatedQwenConfig.model_type, GatedQwenConfig, exist_ok=True)
for _auto, _model in (
    (AutoModel, GatedQwenModel),
    (AutoModelForCausalLM, GatedQwenForCausalLM),
    (AutoModelForSequenceClassification, GatedQwenForSequenceClassification),
):
    _auto.register(GatedQwenConfig, _model, exist_ok=True)
    _model.register_for_auto_class(_auto.__name__)
GatedQwenConfig.register_for_auto_class()
register_peft_defaults()  # LoraConfig(task_type="CAUSAL_LM") without target_modules; a no-op without PEFT
GatedQwenPreTrainedModel.card_pusher = push_card_if_missing  # push_to_hub uploads this package's card

__version__ = "0.1.0"
__all__ = [
    "GatedQwenConfig",
    "GatedQwenPreTrainedModel",
    "GatedQwenModel",
    "GatedQwenForCausalLM",
    "GatedQwenForSequenceClassification",
]
