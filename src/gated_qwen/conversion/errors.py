"""The conversion's errors. The command line prints each as one line: `ConversionError` exits with 2 (refused), `VerificationError` with 1."""

import importlib


class CheckpointFormatError(ValueError):
    """A config.json or tensor of another format that GatedQwen cannot read as a model it computes, whether
    `from_pretrained` or `gated-qwen convert` reads it; the message says why and what would work."""


class ConversionError(ValueError):
    """A checkpoint, a flag or a destination that cannot be converted as asked; the message says why."""


class VerificationError(ConversionError):
    """The converted model's logits differ from the source's beyond the stated tolerance."""

    exit_code = 1


def import_extra(module: str, refusal: str):
    """The optional package `module`, or a `ConversionError(refusal)` where it is not installed. A folder of that name
    on `sys.path` (an implicit namespace package, with no `__file__`) is not the package."""
    try:
        imported = importlib.import_module(module)
    except ImportError:
        imported = None
    if getattr(imported, "__file__", None) is None:
        raise ConversionError(refusal)
    return imported
