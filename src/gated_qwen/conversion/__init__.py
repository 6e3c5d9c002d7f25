"""Checkpoint conversion between GatedQwen and the formats that exist today.

`convert(src, dst, from_format=...)` imports a checkpoint into GatedQwen, `convert(src, dst, to_format=...)` exports a
GatedQwen checkpoint. Formats:

- `"release"`: the paper's released checkpoints (`QwQZh/gated_attention`), gate rows packed in `q_proj` per kv
  group (see `release.py`); both directions, byte-identical round trip.
- `"qwen3"`: stock Transformers Qwen3 -> GatedQwen, without a gate (exact) or with `add_gate=VARIANT` initialised
  so that the logits do not change (`qwen3.added_gate_init` says what is done per variant).
- `"qwen3_5"`: GatedQwen <-> Transformers' Qwen3.5 text model with every layer full attention; the import also
  reads Qwen3-Next checkpoints that are attention-only and dense.
- `"qwen3_moe"`: stock Transformers Qwen3-MoE -> GatedQwen-MoE (model_type `gated_qwen_moe`), without a gate or with
  `add_gate` as for `"qwen3"` (see `qwen3.py`).
- `"qwen3_next"`: GatedQwen (G1 sigmoid gate), or GatedQwen-MoE with a shared expert, <-> Qwen3-Next with every layer
  full attention, dense or mixture-of-experts (see `qwen3_5.py`).

The formats are a registry (`formats.py`) from which `FROM_FORMATS`, `TO_FORMATS` and the command line's choices
come; each format is described once (`rules.py`: its config translation and per-tensor rules) in its module, and the
same description is what `from_pretrained` reads such a folder with (`loading.py`). Its refusals reach the caller as
`ConversionError`s that name the format flag. Every conversion streams tensors (one output shard in memory at a time), writes sharded safetensors with an
index, shows progress, and writes `dst` through `gated_qwen.outputs` (refused when it is, contains or lies inside
`src`; built in a staging folder beside it and renamed into place only when complete; an existing `dst` replaced
only with `overwrite=True`). Pickled `.bin` weights are read only with `allow_pickle=True`. Whatever `verify` says,
the conversion checks the structure (`structure.py`): the source matches its config, and the result holds every
parameter of the model its written config describes, once, with the right shape, and nothing else. `verify`
(default: on for models up to 500M parameters) compares the logits of source and result on random sequences on top
and raises `VerificationError` beyond the stated tolerance.

Importing this package is light (no torch); `convert` imports the model stack when it runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..outputs import CONFIG_VALUE_ERRORS, OutputError, clean_stale, output_folder, say
from .errors import CheckpointFormatError, ConversionError, VerificationError
from .formats import FORMATS, FROM_FORMATS, TO_FORMATS
from .verify import VERIFY_MAX_PARAMETERS, VERIFY_RTOL


def _write_config(config, folder: Path, kind: str) -> None:
    """config.json (for GatedQwen / GatedQwen-MoE plus the modeling files, so the folder loads with
    `trust_remote_code=True` without the package)."""
    if kind == "release":
        from ..outputs import write_json

        write_json(folder / "config.json", config)
    elif kind in ("gated_qwen", "gated_qwen_moe"):
        from transformers.dynamic_module_utils import custom_object_save

        from .formats import model_class

        causal_lm = model_class(kind)
        config.architectures = [causal_lm.__name__]
        config.save_pretrained(folder)
        custom_object_save(causal_lm, folder)
    else:
        config.save_pretrained(folder)


@contextmanager
def _refusals_as_conversion_errors(flag: str) -> Iterator[None]:
    """The destination's refusals (`gated_qwen.outputs`) and the formats' (named with the format `flag`) raised as
    the ConversionError that `convert` promises."""
    try:
        yield
    except OutputError as error:
        raise ConversionError(str(error)) from None
    except CheckpointFormatError as error:
        raise ConversionError(f"{flag}: {error}") from None


def _plan(name: str, export: bool, ckpt, add_gate, export_options: dict):
    """`(config to write, plan)` of format `name`'s import or export, with a config.json whose values the config
    classes refuse reported as such."""
    from huggingface_hub.errors import StrictDataclassError

    from .formats import description
    from .plans import gated_config, plan_import
    from .qwen3 import parse_gate, source_dtype

    fmt = description(name)
    try:
        if export:
            return fmt.export(ckpt, **export_options)
        reads = FORMATS[name].reads
        if ckpt.config.get("model_type") not in reads:
            raise ConversionError(f"SRC has model_type={ckpt.config.get('model_type')!r}; `--from {name}` reads "
                                  f"model_type {' or '.join(repr(t) for t in reads)}.")
        config = gated_config(fmt.config_fields(ckpt.config, parse_gate(add_gate) if add_gate is not None else None))
        config.dtype = source_dtype(ckpt.config)
        if fmt.check is not None:
            fmt.check(ckpt.config, config, {tensor: info.shape for tensor, info in ckpt.tensors.items()})
        return config, plan_import(fmt, ckpt, config)
    except (ConversionError, CheckpointFormatError):
        raise
    except (StrictDataclassError, *CONFIG_VALUE_ERRORS) as error:  # a value of the wrong type meets Transformers'
        # config classes' handling with any of these (see CONFIG_VALUE_ERRORS)
        direction = f"a {name} checkpoint" if not export else "a gated_qwen checkpoint"
        raise ConversionError(
            f"SRC's config.json is not a valid config of {direction}: {' '.join(str(error).split())}"
        ) from None


# The exports that serving engines read with their own models and whose o_proj bias they drop (see qwen3_5.py).
O_PROJ_BIAS_FORMATS = ("qwen3_5", "qwen3_next")


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
    allow_o_proj_bias: bool = False,
    carry_code: bool = False,
) -> Path:
    """Converts the checkpoint folder `src` into the new folder `dst` and returns `dst`.

    Exactly one of `from_format` (import into GatedQwen; one of `FROM_FORMATS`) and `to_format` (export a GatedQwen
    checkpoint; one of `TO_FORMATS`). `add_gate`: only with `from_format="qwen3"` (or `"qwen3_moe"`), `"elementwise"`,
    `"headwise"` or a dict / JSON object of gate fields. `max_shard_size` (bytes or e.g. `"2GB"`) defaults to half
    the size of the largest weight file of `src`: peak memory is about one output shard plus the imports (~0.45 GB),
    which keeps it within 1.5x the largest input shard for shards of 0.5 GB or more. SRC's tokenizer, generation and
    licence files are carried into `dst`, and its own `*.py` code only with `carry_code` (said when done).
    `allow_o_proj_bias`: with `to_format="qwen3_5"` or `"qwen3_next"`, export a model with Qwen3's
    `attention_bias` (an o_proj bias, which stock Transformers computes and vLLM's models drop) instead of
    refusing it. Raises `ConversionError` (a `ValueError`) with the reason, and `VerificationError` if
    verification fails; nothing is written then.
    """
    if (from_format is None) == (to_format is None):
        raise ConversionError("give exactly one of --from FORMAT (import into gated_qwen) or --to FORMAT (export).")
    export = to_format is not None
    name, choices = (to_format, TO_FORMATS) if export else (from_format, FROM_FORMATS)
    if name not in choices:
        raise ConversionError(f"{'--to' if export else '--from'} {name!r} is not a format; choose one of "
                              f"{', '.join(choices)}.")
    if add_gate is not None and (export or not FORMATS[name].takes_gate):
        gated = " and ".join(f"`--from {f}`" for f in FROM_FORMATS if FORMATS[f].takes_gate)
        raise ConversionError(f"--add-gate applies to {gated} only (stock checkpoints without a gate).")
    if allow_o_proj_bias and to_format not in O_PROJ_BIAS_FORMATS:
        raise ConversionError(f"--allow-o-proj-bias applies to {' and '.join(f'--to {f}' for f in O_PROJ_BIAS_FORMATS)} "
                              "only.")
    export_options = {"allow_o_proj_bias": True} if allow_o_proj_bias else {}
    from .io import Checkpoint, carry_files, files_to_carry, parse_size, write_weights
    from .structure import check_plan, check_source, check_written

    shard_size = parse_size(max_shard_size) if max_shard_size is not None else None
    src, dst = Path(src), Path(dst)
    flag = f"{'--to' if export else '--from'} {name}"
    with _refusals_as_conversion_errors(flag), output_folder(dst, inputs=[src], overwrite=overwrite, label="DST") as tmp:
        ckpt = Checkpoint(src, allow_pickle=allow_pickle)
        carried, code_left = files_to_carry(src, carry_code)  # refused now, not after the slow part
        out_config, plan = _plan(name, export, ckpt, add_gate, export_options)
        src_kind = "release" if name == "release" and not export else ckpt.config["model_type"]
        result_kind = FORMATS[name].writes if export else out_config.model_type  # gated_qwen or gated_qwen_moe
        check_source(ckpt, src_kind)
        if verify is None:
            verify = ckpt.parameter_count <= VERIFY_MAX_PARAMETERS
            if not verify:
                say(f"not verifying: {ckpt.parameter_count / 1e6:.0f}M parameters is more than the default limit of "
                    f"{VERIFY_MAX_PARAMETERS / 1e6:.0f}M; pass --verify to run it anyway (the structure is checked "
                    "either way).")
        _write_config(out_config, tmp, result_kind)
        check_plan(plan, result_kind, tmp)
        write_weights(plan, tmp, shard_size or max(1, ckpt.largest_file_bytes // 2),
                      desc=f"{src_kind} -> {result_kind}")
        check_written(tmp, plan)
        copied = carry_files(carried, tmp)
        if verify:
            vocab = out_config["vocab_size"] if isinstance(out_config, dict) else out_config.vocab_size
            from .verify import verify as run_verification

            error = run_verification(src, src_kind, tmp, result_kind, vocab, allow_pickle=allow_pickle)
            say(f"verified: logits agree to {error:.2g} (max |difference| / max(1, max |logit|); tolerance "
                f"{VERIFY_RTOL:g})")
    if add_gate is not None:
        from .qwen3 import A7_NOTE

        say(A7_NOTE)
    code = [name for name in copied if name.endswith(".py")]
    if code:
        say(f"carried SRC's code files {code} (--carry-code): Transformers runs them when DST is loaded with "
            "trust_remote_code=True.")
    elif code_left:
        say(f"not carried: SRC's code files {code_left} (someone else's code; pass --carry-code to carry them).")
    say(f"wrote {dst} ({result_kind}, {len(plan)} tensors)")
    return dst


def clean(path: str | os.PathLike) -> list[str]:
    """Removes the staging folders that killed runs left for the output `path` (beside it) and for the outputs
    inside the folder `path`, when their process has ended; returns what was done, one line each."""
    return clean_stale(path, inside=True)


def __getattr__(name: str):
    if name == "Checkpoint":  # the model stack, imported on first use
        from .io import Checkpoint

        return Checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "convert", "clean", "CheckpointFormatError", "ConversionError", "VerificationError", "Checkpoint", "FORMATS",
    "FROM_FORMATS", "TO_FORMATS", "VERIFY_MAX_PARAMETERS", "VERIFY_RTOL",
]
