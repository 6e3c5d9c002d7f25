"""`--verify`: run the source and the converted model on a few sequences and compare their logits.

Both run in float32 with eager attention, each through the reference of its format: the class that reads it
(`GatedQwenForCausalLM` / `GatedQwenMoeForCausalLM`, or the stock Transformers class: `Qwen3ForCausalLM`,
`Qwen3MoeForCausalLM`, `Qwen3_5ForCausalLM`, `Qwen3NextForCausalLM`), or the format's own `OwnModel.logits` where no
class reads it (the paper's release: `release.release_logits`, the official forward written from its layout). A source that already produces NaN or infinite logits is reported as
such, not as a conversion difference.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..files.reading import utf8_named
from .errors import ConversionError, VerificationError
from .format_types import FileWriting, Format
from .formats import model_class
from .io import open_checkpoint

VERIFY_MAX_PARAMETERS = 500_000_000  # verify by default up to this size (two float32 copies: about 4 GB)
VERIFY_RTOL = 1e-3  # pass when max |logit difference| <= VERIFY_RTOL * max(1, max |reference logit|)
VERIFY_SHAPE = (2, 16)  # sequences x tokens, random ids (seed 0)


def model_logits(folder: Path, fmt: Format, input_ids: torch.Tensor, allow_pickle: bool = False) -> torch.Tensor:
    """`input_ids: [B, S]` -> float32 logits `[B, S, vocab]` of the checkpoint in `folder`, of format `fmt` (read
    through a UTF-8 name of it: `utf8_named`)."""
    with utf8_named(folder) as named:
        return _logits(Path(named), fmt, input_ids, allow_pickle)


def _logits(folder: Path, fmt: Format, input_ids: torch.Tensor, allow_pickle: bool) -> torch.Tensor:
    if fmt.model is not None:  # a format no Transformers class reads
        return fmt.model.logits(open_checkpoint(fmt, folder, allow_pickle), input_ids)
    if isinstance(fmt.writing, FileWriting):  # the format's own files: `folder` is the file or their folder
        return fmt.writing.logits(Path(folder), input_ids)
    cls = model_class(json.loads((Path(folder) / "config.json").read_text()).get("model_type"))
    model, info = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                      output_loading_info=True, return_dict=True)  # whatever config.json says
    wrong = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if wrong:
        raise VerificationError(f"{cls.__name__} does not load {str(folder)!r} cleanly: {wrong}. Nothing was written.")
    with torch.no_grad():
        return model(input_ids).logits.float()


def verify(src: Path, src_format: Format, result: Path, result_format: Format, vocab_size: int,
           allow_pickle: bool = False) -> float:
    """Compares the logits of `src` and `result` on `VERIFY_SHAPE` random sequences; returns the max difference
    relative to `max(1, max |source logit|)`, or raises VerificationError when it exceeds `VERIFY_RTOL` (and
    ConversionError when the source's own logits are not finite)."""
    input_ids = torch.randint(0, vocab_size, VERIFY_SHAPE, generator=torch.Generator().manual_seed(0))
    reference = model_logits(src, src_format, input_ids, allow_pickle)
    if not torch.isfinite(reference).all():
        raise ConversionError(
            "the source produces non-finite logits (NaN or infinity) on random input, so no conversion can be "
            "compared with it; check the source's weights (or convert with --no-verify to copy them as they are). "
            "Nothing was written."
        )
    converted = model_logits(result, result_format, input_ids)
    scale = max(1.0, reference.abs().max().item())
    error = (converted - reference).abs().max().item() / scale
    if not error <= VERIFY_RTOL:
        raise VerificationError(
            f"verification failed: the converted model's logits differ from the source's by {error:.3g} (max "
            f"|difference| / max(1, max |logit|)) on {VERIFY_SHAPE[0]} random sequences of {VERIFY_SHAPE[1]} "
            f"tokens; the tolerance is {VERIFY_RTOL:g}. Nothing was written."
        )
    return error
