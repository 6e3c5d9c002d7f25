"""`--verify`: run the source and the converted model on a few sequences and compare their logits.

Both run in float32 with eager attention, each through its own reference implementation: the stock Transformers
class of its format (`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, `Qwen3_5ForCausalLM`, `Qwen3NextForCausalLM`),
`GatedQwenForCausalLM` / `GatedQwenMoeForCausalLM`, or for the paper's release format `release.release_logits` (the
official forward, written from its layout). A source that already produces NaN or infinite logits is reported as
such, not as a conversion difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConversionError, VerificationError

if TYPE_CHECKING:
    import torch

VERIFY_MAX_PARAMETERS = 500_000_000  # verify by default up to this size (two float32 copies: about 4 GB)
VERIFY_RTOL = 1e-3  # pass when max |logit difference| <= VERIFY_RTOL * max(1, max |reference logit|)
VERIFY_SHAPE = (2, 16)  # sequences x tokens, random ids (seed 0)


def model_logits(folder: Path, kind: str, input_ids: torch.Tensor, allow_pickle: bool = False) -> torch.Tensor:
    """`input_ids: [B, S]` -> float32 logits `[B, S, vocab]` of the checkpoint in `folder` read as `kind`."""
    import torch

    if kind == "release":
        from .io import Checkpoint
        from .release import release_logits

        return release_logits(Checkpoint(folder, allow_pickle=allow_pickle), input_ids)
    from .formats import model_class

    cls = model_class(kind)
    model, info = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                      output_loading_info=True, return_dict=True)  # whatever config.json says
    wrong = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if wrong:
        raise VerificationError(f"{cls.__name__} does not load {str(folder)!r} cleanly: {wrong}. Nothing was written.")
    with torch.no_grad():
        return model(input_ids).logits.float()


def verify(src: Path, src_kind: str, result: Path, result_kind: str, vocab_size: int,
           allow_pickle: bool = False) -> float:
    """Compares the logits of `src` and `result` on `VERIFY_SHAPE` random sequences; returns the max difference
    relative to `max(1, max |source logit|)`, or raises VerificationError when it exceeds `VERIFY_RTOL` (and
    ConversionError when the source's own logits are not finite)."""
    import torch

    input_ids = torch.randint(0, vocab_size, VERIFY_SHAPE, generator=torch.Generator().manual_seed(0))
    reference = model_logits(src, src_kind, input_ids, allow_pickle)
    if not torch.isfinite(reference).all():
        raise ConversionError(
            "the source produces non-finite logits (NaN or infinity) on random input, so no conversion can be "
            "compared with it; check the source's weights (or convert with --no-verify to copy them as they are). "
            "Nothing was written."
        )
    converted = model_logits(result, result_kind, input_ids)
    scale = max(1.0, reference.abs().max().item())
    error = (converted - reference).abs().max().item() / scale
    if not error <= VERIFY_RTOL:
        raise VerificationError(
            f"verification failed: the converted model's logits differ from the source's by {error:.3g} (max "
            f"|difference| / max(1, max |logit|)) on {VERIFY_SHAPE[0]} random sequences of {VERIFY_SHAPE[1]} "
            f"tokens; the tolerance is {VERIFY_RTOL:g}. Nothing was written."
        )
    return error
