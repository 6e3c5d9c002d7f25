"""The checks `GatedQwenPreTrainedModel.from_pretrained` adds to Transformers' loading: a gate tensor the checkpoint
lacks, or holds in another shape, is refused rather than started at random, a gate tensor its config does not have
is refused rather than dropped, and so is any other tensor of another shape unless the caller allows it.

This file is copied to the Hugging Face Hub beside `modeling_gated.py`: relative imports only.
"""

from transformers.modeling_utils import PreTrainedModel


def refuse_unexpected_gates(model: PreTrainedModel, info: dict) -> None:
    """Refuses a loaded model whose loading `info` says the checkpoint holds a gate tensor of a layer its config has
    no gate in (the mirror of a missing gate: Transformers would drop it, and the model compute another function than
    the one saved), naming the tensor and the config field."""
    extra = sorted(name for name in info["unexpected_keys"] if ".self_attn.gate." in name)
    if extra:
        config = model.config
        field = "gate_position=None" if config.gate_position is None else f"gate_layers={config.gate_layers}"
        raise ValueError(
            f"the checkpoint holds {extra[0]}" + (f" (and {len(extra) - 1} more gate tensors)" if len(extra) > 1
                                                   else "")
            + f", a gate its config does not have ({field}); refusing to drop it. Load the folder with the config it "
            "was saved with.")


def refuse_unloaded_tensors(model: PreTrainedModel, info: dict, allows_mismatch: bool) -> None:
    """Refuses a loaded model whose loading `info` (`from_pretrained(..., output_loading_info=True)`) says a gate
    tensor was missing or of another shape, or (unless `allows_mismatch`) any tensor of another shape, naming it."""
    mismatched = sorted((key if isinstance(key, tuple) else (key, None, None)) for key in info["mismatched_keys"])
    not_loaded = sorted(name for name in [*info["missing_keys"], *(name for name, *_ in mismatched)]
                        if ".self_attn.gate." in name)
    if not_loaded:
        missing = not_loaded[0] in info["missing_keys"]
        raise ValueError(
            f"the checkpoint has {'no tensor' if missing else 'a tensor of another shape'} for {not_loaded[0]}"
            + (f" (and {len(not_loaded) - 1} more gate tensors)" if len(not_loaded) > 1 else "")
            + f", yet its config has a gate (gate_position={model.config.gate_position!r}); refusing to start "
            "that gate at random. Load the folder with the config it was saved with, or pass gate fields only to "
            "add a gate to a stock Qwen3 folder."
        )
    if mismatched and not allows_mismatch:
        name, stored, expected = mismatched[0]
        shapes = f" has shape {list(stored)}, not the {list(expected)} its config gives" if stored else (
            " has another shape than its config gives")
        raise ValueError(
            f"the checkpoint's {name}{shapes}" + (f" (and {len(mismatched) - 1} more tensors)" if len(mismatched)
                                                  > 1 else "")
            + "; load the folder with the config it was saved with (ignore_mismatched_sizes=True would start "
            "such tensors, other than the gate's, at random).")
