"""Checkpoint conversion between GatedQwen and the formats that exist today.

`convert(src, dst, from_format=...)` imports a checkpoint into GatedQwen, `convert(src, dst, to_format=...)` exports
a GatedQwen checkpoint. The formats are one `Format` object each (`format_types.py`), in its own module under
`formats/`, which carries everything about it (detection, config translation and tensor rules, export and its
options, the models that read and check it); `formats.FORMATS` registers it with one line, and `FROM_FORMATS`,
`TO_FORMATS`, the export options and the command line's choices and help come from there (`gated-qwen convert --help`
lists them with what each is). The same object is what `from_pretrained` reads such a folder with (`loading.py`). Its
refusals reach the caller as `ConversionError`s that name the format flag. Every conversion streams tensors (one
output shard in memory at a time), writes sharded safetensors with an index, shows progress, and writes `dst` through
`gated_qwen.files` (refused when it is, contains or lies inside `src`; built in a staging folder beside it and
renamed into place only when complete; an existing `dst` replaced only with `overwrite=True`). Pickled `.bin` weights
are read only with `allow_pickle=True`. Whatever `verify` says, the conversion checks the structure (`structure.py`):
the source matches its config, and the result holds every parameter of the model its written config describes, once,
with the right shape, and nothing else. `verify` (default: on for models up to 500M parameters) compares the logits
of source and result on random sequences on top and raises `VerificationError` beyond the stated tolerance.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from transformers.dynamic_module_utils import custom_object_save

from ..files import (
    CONFIG_VALUE_ERRORS,
    OutputError,
    clean_stale,
    clean_stale_scratch,
    output_file,
    output_folder,
    say,
    write_json,
)
from ..files.memory import available_memory
from . import plans
from .errors import CheckpointFormatError, ConversionError, VerificationError
from .format_types import FileWriting, Format
from .formats import FORMATS, FROM_FORMATS, GATED, TO_FORMATS, export_options, model_class, taking
from .io import Checkpoint, carry_files, files_to_carry, open_checkpoint, own_code, parse_size, write_weights
from .plans import gated_config
from .shared import A7_NOTE, parse_gate, source_dtype
from .structure import check_plan, check_source, check_written
from .verify import VERIFY_MAX_PARAMETERS, VERIFY_RTOL, verify


@dataclass(frozen=True)
class _Request:
    """What `convert` is asked: the format, the direction (`export`: `--to`), the gate to add and the export's
    options."""

    fmt: Format
    export: bool
    add_gate: str | dict | None
    options: dict

    @property
    def flag(self) -> str:
        """The command line's name of the format and direction, which refusals start with."""
        return f"{'--to' if self.export else '--from'} {self.fmt.name}"

    @property
    def source(self) -> Format:
        return GATED if self.export else self.fmt

    @property
    def result(self) -> Format:
        return self.fmt if self.export else GATED


def _request(from_format, to_format, add_gate, options: dict) -> _Request:
    """The request that `convert`'s arguments make (`options`: the export options given, by name), or the
    ConversionError that says what is wrong with them."""
    if (from_format is None) == (to_format is None):
        raise ConversionError("give exactly one of --from FORMAT (import into gated_qwen) or --to FORMAT (export).")
    export = to_format is not None
    name, choices = (to_format, TO_FORMATS) if export else (from_format, FROM_FORMATS)
    if name not in choices:
        raise ConversionError(f"{'--to' if export else '--from'} {name!r} is not a format; choose one of "
                              f"{', '.join(choices)}.")
    fmt = FORMATS[name]
    if add_gate is not None and (export or not fmt.reading.takes_gate):
        gated = " and ".join(f"`--from {f}`" for f in FROM_FORMATS if FORMATS[f].reading.takes_gate)
        raise ConversionError(f"--add-gate applies to {gated} only (stock checkpoints without a gate).")
    options = {option: value for option, value in options.items() if value is not None and value is not False}
    known = export_options()
    for option in options:
        if option not in known:
            raise ConversionError(f"convert() has no option {option!r}; the export options are "
                                  f"{', '.join(known) or 'none'}.")
        if not export or all(option != taken.name for taken in fmt.export_options):
            takers = " and ".join(f"--to {f}" for f in taking(option))
            raise ConversionError(f"{known[option].flag} applies to {takers} only.")
    return _Request(fmt, export, add_gate, options)


def _write_config(config, folder: Path, result: Format) -> None:
    """config.json of the result: a dict as it is (a format no Transformers class reads), a config object with
    `save_pretrained`, and for a gated_qwen result also the modeling files, so the folder loads with
    `trust_remote_code=True` without the package."""
    if isinstance(config, dict):
        write_json(folder / "config.json", config)
        return
    if result is GATED:
        causal_lm = model_class(config.model_type)
        config.architectures = [causal_lm.__name__]
        config.save_pretrained(folder)
        custom_object_save(causal_lm, folder)
        return
    config.save_pretrained(folder)


@contextmanager
def _refusals_as_conversion_errors(flag: str) -> Iterator[None]:
    """The destination's refusals (`gated_qwen.files`) and the formats' (named with the format `flag`) raised as
    the ConversionError that `convert` promises."""
    try:
        yield
    except OutputError as error:
        raise ConversionError(str(error)) from None
    except CheckpointFormatError as error:
        raise ConversionError(f"{flag}: {error}") from None


def _import_plan(fmt: Format, ckpt, add_gate):
    """`(GatedQwen config, plan)` of reading `ckpt` in format `fmt`, with `add_gate` where the format takes one."""
    reading = fmt.reading
    if ckpt.config.get("model_type") not in reading.reads:
        raise ConversionError(f"SRC has model_type={ckpt.config.get('model_type')!r}; `--from {fmt.name}` reads "
                              f"model_type {' or '.join(repr(t) for t in reading.reads)}.")
    config = gated_config(reading.config_fields(ckpt.config, parse_gate(add_gate) if add_gate is not None else None))
    config.dtype = source_dtype(ckpt.config)
    if reading.check is not None:
        reading.check(ckpt.config, config, {tensor: info.shape for tensor, info in ckpt.tensors.items()})
    if reading.plan is not None:
        return config, reading.plan(ckpt, config)
    return config, plans.plan_import(fmt, ckpt, config)  # looked up at the call (tests replace it)


def _plan(request: _Request, ckpt):
    """`(config to write, plan)` of the request, with a config.json whose values the config classes refuse
    reported as such."""
    try:
        if request.export:
            return request.fmt.writing.plan(ckpt, **request.options)
        return _import_plan(request.fmt, ckpt, request.add_gate)
    except (ConversionError, CheckpointFormatError):
        raise
    except (StrictDataclassError, *CONFIG_VALUE_ERRORS) as error:  # a value of the wrong type meets Transformers'
        # config classes' handling with any of these (see CONFIG_VALUE_ERRORS)
        direction = "a gated_qwen checkpoint" if request.export else f"a {request.fmt.name} checkpoint"
        raise ConversionError(
            f"SRC's config.json is not a valid config of {direction}: {' '.join(str(error).split())}"
        ) from None


def _verify_by_default(ckpt) -> bool:
    """`--verify`'s default: on up to `VERIFY_MAX_PARAMETERS`, said when it is off."""
    if ckpt.parameter_count <= VERIFY_MAX_PARAMETERS:
        return True
    say(f"not verifying: {ckpt.parameter_count / 1e6:.0f}M parameters is more than the default limit of "
        f"{VERIFY_MAX_PARAMETERS / 1e6:.0f}M; pass --verify to run it anyway (the structure is checked either way).")
    return False


def _check_memory(request: _Request, ckpt, plan: dict | None, verify: bool | None) -> None:
    """Refuses, from the sizes alone and before any tensor is read, a conversion that would not fit in the memory
    this process may use (the machine's, its cgroup's, `ulimit -v`), naming SRC's largest tensor. A plan streams:
    the largest output tensor and the source tensor read for it; an
    export without a plan (`--to onnx`) builds the whole float32 model from the float32 weights; `verify` (on by
    default up to `VERIFY_MAX_PARAMETERS`) builds the source's and the result's float32 models."""
    available = available_memory("cpu")
    if available is None:
        return
    name, largest = ckpt.largest_tensor
    if plan is None:
        needed, held = 8 * ckpt.parameter_count, "the whole model in float32 and its weights as read"
    else:
        biggest = max((p.nbytes for p in plan.values()), default=0)
        needed, held = biggest + largest.nbytes, "the largest output tensor and the tensor read for it"
    if (ckpt.parameter_count <= VERIFY_MAX_PARAMETERS if verify is None else verify) and plan is not None:
        needed, held = max(needed, 8 * ckpt.parameter_count), held + "; --verify: both models in float32"
    if needed > available[0]:
        raise ConversionError(
            f"{request.flag} needs about {needed / 2**30:.1f} GiB of memory ({held}; SRC's largest tensor: {name} "
            f"{list(largest.shape)} {str(largest.dtype).removeprefix('torch.')}), more than the "
            f"{available[0] / 2**30:.1f} GiB available ({available[1]}); convert it on a machine with more memory.")


def _kinds(request: _Request, ckpt, config) -> tuple[str, str]:
    """What the source and the result hold, for the progress bar and the report: the format's name on the foreign
    side, the model_type on the gated_qwen side (gated_qwen or gated_qwen_moe)."""
    if request.export:
        return ckpt.config.get("model_type"), request.fmt.name
    return request.fmt.name, config.model_type


def _write(request: _Request, ckpt, config, plan, folder: Path, shard_size: int | None) -> None:
    """Writes config.json and the weights of `plan` into `folder`, each checked against the other."""
    _write_config(config, folder, request.result)
    files = request.fmt.writing.files if request.export else None
    for name, text in (files(config) if files else {}).items():
        (folder / name).write_text(text)
    check_plan(plan, request.result, folder)
    write_weights(plan, folder, shard_size or max(1, ckpt.largest_file_bytes // 2),
                  desc=" -> ".join(_kinds(request, ckpt, config)))
    check_written(folder, plan)


def _verify(request: _Request, src: Path, ckpt, folder: Path, config, allow_pickle: bool) -> None:
    """`--verify`, which reads SRC again by its name: SRC must still be the files the conversion read, before and
    after (a failure to read a SRC that changed is said as such)."""
    vocab = config["vocab_size"] if isinstance(config, dict) else config.vocab_size
    try:
        error = verify(src, request.source, folder, request.result, vocab, allow_pickle=allow_pickle)
    except Exception:
        ckpt.check_unchanged()
        raise
    ckpt.check_unchanged()
    say(f"verified: logits agree to {error:.2g} (max |difference| / max(1, max |logit|); tolerance {VERIFY_RTOL:g})")


def _report(request: _Request, dst: Path, result_kind: str, plan: dict, copied: list[str], code_left: list[str]):
    if request.add_gate is not None:
        say(A7_NOTE)
    code = [name for name in copied if name.endswith(".py")]
    if code:
        say(f"carried SRC's code files {code} (--carry-code): Transformers runs them when DST is loaded with "
            "trust_remote_code=True.")
    elif code_left:
        say(f"not carried: SRC's code files {code_left} (someone else's code; pass --carry-code to carry them).")
    say(f"wrote {dst} ({result_kind}, {len(plan)} tensors)")


def _write_file(request: _Request, src, dst, *, overwrite: bool, allow_pickle: bool, verify: bool | None,
                folder_options: dict[str, bool]) -> Path:
    """An export that is not a folder of safetensors (`FileWriting`): one file (e.g. GGUF) or a folder of the
    format's own files (e.g. ONNX, with SRC's tokenizer and generation files carried beside them), written whole or
    not at all, the source's structure checked first and `--verify` against the format's own reader; none of a
    safetensors folder's options."""
    folder = request.fmt.writing.folder
    given = [flag for flag, used in folder_options.items() if used]
    if given:
        writes = "its own files, not safetensors" if folder else "one file"
        raise ConversionError(f"{' and '.join(given)} apply to safetensors folder outputs; {request.flag} writes "
                              f"{writes}.")
    src, dst = Path(src), Path(dst)
    output = output_folder if folder else output_file
    with _refusals_as_conversion_errors(request.flag), output(dst, inputs=[src], overwrite=overwrite,
                                                               label="DST") as tmp:
        ckpt = Checkpoint(src, allow_pickle=allow_pickle)
        carried = files_to_carry(src)[0] if folder else {}
        check_source(ckpt, request.source)
        _check_memory(request, ckpt, None if folder else {}, verify)
        verify = _verify_by_default(ckpt) if verify is None else verify
        vocab_size, report = request.fmt.writing.write(ckpt, tmp, **request.options)
        carry_files(carried, tmp)
        if verify:
            _verify(request, src, ckpt, tmp, {"vocab_size": vocab_size}, allow_pickle)
    code_left = sorted(own_code(src))
    if code_left:
        say(f"not carried: SRC's code files {code_left} (someone else's code, which {request.flag}'s output does "
            "not run).")
    say(f"wrote {dst} ({report})")
    return dst


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
    carry_code: bool = False,
    **export_options,
) -> Path:
    """Converts the checkpoint folder `src` into the new folder `dst` and returns `dst`.

    Exactly one of `from_format` (import into GatedQwen; one of `FROM_FORMATS`) and `to_format` (export a GatedQwen
    checkpoint; one of `TO_FORMATS`). `add_gate`: only with `from_format="qwen3"` (or `"qwen3_moe"`), `"elementwise"`,
    `"headwise"` or a dict / JSON object of gate fields. `max_shard_size` (bytes or e.g. `"2GB"`) defaults to half
    the size of the largest weight file of `src`; the tensors are written one at a time, so peak memory is about the
    largest tensor plus the imports (~0.45 GB). SRC's tokenizer, generation and
    licence files are carried into `dst`, and its own `*.py` code only with `carry_code` (said when done).
    `export_options`: the options of the format exported to (`FORMATS[to_format].export_options`, which
    `gated-qwen convert --help` lists), e.g. `allow_o_proj_bias=True` with `to_format="qwen3_5"`. Raises `ConversionError` (a `ValueError`) with the reason, and `VerificationError` if
    verification fails; nothing is written then.
    """
    request = _request(from_format, to_format, add_gate, export_options)
    if request.export and isinstance(request.fmt.writing, FileWriting):
        return _write_file(request, src, dst, overwrite=overwrite, allow_pickle=allow_pickle, verify=verify,
                           folder_options={"--max-shard-size": max_shard_size is not None, "--carry-code": carry_code})

    shard_size = parse_size(max_shard_size) if max_shard_size is not None else None
    src, dst = Path(src), Path(dst)
    with _refusals_as_conversion_errors(request.flag), output_folder(dst, inputs=[src], overwrite=overwrite,
                                                                      label="DST") as tmp:
        ckpt = open_checkpoint(request.source, src, allow_pickle)
        carried, code_left = files_to_carry(src, carry_code)  # refused now, not after the slow part
        config, plan = _plan(request, ckpt)
        check_source(ckpt, request.source, None if request.export else config)
        _check_memory(request, ckpt, plan, verify)
        verify = _verify_by_default(ckpt) if verify is None else verify
        _write(request, ckpt, config, plan, tmp, shard_size)
        copied = carry_files(carried, tmp)
        if verify:
            _verify(request, src, ckpt, tmp, config, allow_pickle)
    _report(request, dst, _kinds(request, ckpt, config)[1], plan, copied, code_left)
    return dst


def clean(path: str | os.PathLike) -> list[str]:
    """Removes the staging folders that killed runs left for the output `path` (beside it) and for the outputs
    inside the folder `path`, and the scratch folders they left in TMPDIR (the Trainer's of `reproduce`), when their
    process has ended; returns what was done, one line each."""
    return clean_stale(path, inside=True) + clean_stale_scratch()


__all__ = [
    "convert", "clean", "CheckpointFormatError", "ConversionError", "VerificationError", "Checkpoint", "FORMATS",
    "FROM_FORMATS", "TO_FORMATS", "VERIFY_MAX_PARAMETERS", "VERIFY_RTOL",
]
