"""Checkpoint conversion between GatedQwen and the formats that exist today.

`convert(src, dst, from_format=...)` imports a checkpoint into GatedQwen, `convert(src, dst, to_format=...)` exports a
GatedQwen checkpoint. Formats:

- `"release"`: the paper's released checkpoints (`QwQZh/gated_attention`), gate rows packed in `q_proj` per kv
  group (see `release.py`); both directions, byte-identical round trip.
- `"qwen3"`: stock Transformers Qwen3 -> GatedQwen, without a gate (exact) or with `add_gate=VARIANT` initialised
  so that the logits do not change (see `qwen3.py` for what is done per variant).
- `"qwen3_5"`: GatedQwen <-> Transformers' Qwen3.5 text model with every layer full attention; the import also
  reads Qwen3-Next checkpoints that are attention-only and dense.
- `"qwen3_moe"`: stock Transformers Qwen3-MoE -> GatedQwen with experts, without a gate or with `add_gate` as for
  `"qwen3"` (see `qwen3_moe.py`).
- `"qwen3_next"`: GatedQwen (G1 sigmoid gate; with experts, a shared expert) <-> Qwen3-Next with every layer full
  attention, dense or mixture-of-experts (see `qwen3_next.py`).

Every conversion streams tensors (one output shard in memory at a time), writes sharded safetensors with an index,
shows progress, builds the result in a temporary folder beside `dst` that is renamed into place only when complete
(and verified), refuses an existing `dst` unless `overwrite=True` and pickled `.bin` weights unless
`allow_pickle=True`. `verify` (default: on for models up to 500M parameters) compares the logits of source and
result on random sequences and raises `VerificationError` beyond the stated tolerance.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .io import (
    Checkpoint,
    ConversionError,
    carry_files,
    check_destination,
    parse_size,
    publish,
    staging_folder,
    write_weights,
)
from .verify import VERIFY_MAX_PARAMETERS, VERIFY_RTOL, VerificationError
from .verify import verify as _verify

FROM_FORMATS = ("release", "qwen3", "qwen3_5", "qwen3_next", "qwen3_moe")
TO_FORMATS = ("release", "qwen3_5", "qwen3_next")


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def _write_gated_config(config, folder: Path) -> None:
    """config.json plus the modeling files, so the folder loads with `trust_remote_code=True` without the package."""
    from transformers.dynamic_module_utils import custom_object_save

    from .. import GatedQwenForCausalLM

    config.architectures = ["GatedQwenForCausalLM"]
    config.save_pretrained(folder)
    custom_object_save(GatedQwenForCausalLM, folder)


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    from_format: str | None = None,
    to_format: str | None = None,
    add_gate: str | dict | None = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    verify: bool | None = None,
    max_shard_size: int | str | None = None,
) -> Path:
    """Converts the checkpoint folder `src` into the new folder `dst` and returns `dst`.

    Exactly one of `from_format` (import into GatedQwen; one of `FROM_FORMATS`) and `to_format` (export a GatedQwen
    checkpoint; one of `TO_FORMATS`). `add_gate`: only with `from_format="qwen3"` (or `"qwen3_moe"`), `"elementwise"`, `"headwise"` or a
    dict / JSON object of gate fields. `max_shard_size` (bytes or e.g. `"2GB"`) defaults to half the size of the
    largest weight file of `src`: peak memory is about one output shard plus the imports (~0.45 GB), which keeps it
    within 1.5x the largest input shard for shards of 0.5 GB or more. Raises `ConversionError` (a `ValueError`) with
    the reason before anything is written, and `VerificationError` if verification fails (nothing is written then
    either).
    """
    if (from_format is None) == (to_format is None):
        raise ConversionError("give exactly one of --from FORMAT (import into gated_qwen) or --to FORMAT (export).")
    if from_format is not None and from_format not in FROM_FORMATS:
        raise ConversionError(f"--from {from_format!r} is not a format; choose one of {', '.join(FROM_FORMATS)}.")
    if to_format is not None and to_format not in TO_FORMATS:
        raise ConversionError(f"--to {to_format!r} is not a format; choose one of {', '.join(TO_FORMATS)}.")
    if add_gate is not None and from_format not in ("qwen3", "qwen3_moe"):
        raise ConversionError(
            "--add-gate applies to `--from qwen3` and `--from qwen3_moe` only (stock checkpoints without a gate)."
        )
    src, dst = Path(src), Path(dst)
    check_destination(src, dst, overwrite)
    ckpt = Checkpoint(src, allow_pickle=allow_pickle)

    if from_format == "release":
        from .release import plan_release_to_gated as planner
    elif from_format == "qwen3":
        from .qwen3 import plan_qwen3_to_gated

        def planner(ckpt):
            return plan_qwen3_to_gated(ckpt, add_gate)
    elif from_format == "qwen3_moe":
        from .qwen3_moe import plan_qwen3_moe_to_gated

        def planner(ckpt):
            return plan_qwen3_moe_to_gated(ckpt, add_gate)
    elif from_format == "qwen3_next":
        from .qwen3_next import plan_qwen3_next_to_gated as planner
    elif from_format == "qwen3_5":
        from .qwen3_5 import plan_qwen3_5_to_gated as planner
    elif to_format == "release":
        from .release import plan_gated_to_release as planner
    elif to_format == "qwen3_next":
        from .qwen3_next import plan_gated_to_qwen3_next as planner
    else:
        from .qwen3_5 import plan_gated_to_qwen3_5 as planner
    out_config, plan = planner(ckpt)

    if from_format is not None:
        src_kind = from_format if from_format in ("release", "qwen3") else ckpt.config["model_type"]
        result_kind = "gated_qwen"
    else:
        result_kind = {"release": "release", "qwen3_5": "qwen3_5_text", "qwen3_next": "qwen3_next"}[to_format]
        src_kind = "gated_qwen"
    if verify is None:
        verify = ckpt.parameter_count <= VERIFY_MAX_PARAMETERS
        if not verify:
            _say(f"not verifying: {ckpt.parameter_count / 1e6:.0f}M parameters is more than the default limit of "
                 f"{VERIFY_MAX_PARAMETERS / 1e6:.0f}M; pass --verify to run it anyway.")
    shard_size = parse_size(max_shard_size) if max_shard_size is not None else max(1, ckpt.largest_file_bytes // 2)

    with staging_folder(dst) as tmp:
        if result_kind == "gated_qwen":
            _write_gated_config(out_config, tmp)
        elif result_kind == "release":
            from .io import write_json

            write_json(tmp / "config.json", out_config)
        else:
            out_config.save_pretrained(tmp)
        write_weights(plan, tmp, shard_size, desc=f"{src_kind} -> {result_kind}")
        carry_files(src, tmp)
        if verify:
            vocab = out_config["vocab_size"] if isinstance(out_config, dict) else out_config.vocab_size
            error = _verify(src, src_kind, tmp, result_kind, vocab, allow_pickle=allow_pickle)
            _say(f"verified: logits agree to {error:.2g} (max |difference| / max(1, max |logit|); tolerance "
                 f"{VERIFY_RTOL:g})")
        publish(tmp, dst)
    if add_gate is not None:
        from .common import A7_NOTE

        _say(A7_NOTE)
    _say(f"wrote {dst} ({result_kind}, {len(plan)} tensors)")
    return dst


def release_to_gated(src, dst, **kwargs) -> Path:
    """The paper's released checkpoint -> GatedQwen (see `convert`)."""
    return convert(src, dst, from_format="release", **kwargs)


def gated_to_release(src, dst, **kwargs) -> Path:
    """GatedQwen -> the paper's release layout, readable by the official code (see `convert`)."""
    return convert(src, dst, to_format="release", **kwargs)


def qwen3_to_gated(src, dst, add_gate: str | dict | None = None, **kwargs) -> Path:
    """Stock Qwen3 -> GatedQwen, optionally with a function-preserving gate (see `convert`, `qwen3.py`)."""
    return convert(src, dst, from_format="qwen3", add_gate=add_gate, **kwargs)


def qwen3_moe_to_gated(src, dst, add_gate: str | dict | None = None, **kwargs) -> Path:
    """Stock Qwen3-MoE -> GatedQwen with experts, optionally with a function-preserving gate (see `convert`)."""
    return convert(src, dst, from_format="qwen3_moe", add_gate=add_gate, **kwargs)


def gated_to_qwen3_next(src, dst, **kwargs) -> Path:
    """GatedQwen (G1 sigmoid gate, a shared expert if it has experts) -> Qwen3-Next, all layers full attention."""
    return convert(src, dst, to_format="qwen3_next", **kwargs)


def qwen3_next_to_gated(src, dst, **kwargs) -> Path:
    """Qwen3-Next checkpoint with only full-attention layers (dense or MoE) -> GatedQwen."""
    return convert(src, dst, from_format="qwen3_next", **kwargs)


def gated_to_qwen3_5(src, dst, **kwargs) -> Path:
    """GatedQwen (G1 sigmoid gate) -> a Transformers Qwen3.5 text checkpoint, all layers full attention."""
    return convert(src, dst, to_format="qwen3_5", **kwargs)


def qwen3_5_to_gated(src, dst, **kwargs) -> Path:
    """Qwen3.5 text / Qwen3-Next checkpoint with only full-attention, dense layers -> GatedQwen."""
    return convert(src, dst, from_format="qwen3_5", **kwargs)


__all__ = [
    "convert", "release_to_gated", "gated_to_release", "qwen3_to_gated", "gated_to_qwen3_5", "qwen3_5_to_gated",
    "qwen3_moe_to_gated", "gated_to_qwen3_next", "qwen3_next_to_gated",
    "ConversionError", "VerificationError", "Checkpoint", "FROM_FORMATS", "TO_FORMATS", "VERIFY_MAX_PARAMETERS",
    "VERIFY_RTOL",
]
