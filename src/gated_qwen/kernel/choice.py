"""The measured default: on a CUDA GPU the fused kernel runs a call only where it has been measured faster than SDPA
+ a separate sigmoid gate on that GPU, for that combination (`selfcheck.Combination`: device, dtype, head dim, gate
kind, causal, layout), that length (the longest key sequence rounded up to a power of two) and that pass (forward,
or forward + backward where gradients are needed).

The rule: the kernel wins only when it is faster by more than `MARGIN` (3%); a closer result is a tie and goes to
SDPA + gate, the path PyTorch maintains. A timing that fails (an exception, a non-positive or non-finite time) also
goes to SDPA + gate, and is not written down (it may be a passing shortage of memory).

The choices of a GPU are kept in a small JSON file, `choices-<GPU name>.json` in `cache_folder()` (beside Triton's
cache, or `GATED_QWEN_KERNEL_CACHE`), under the identity of what was measured: the GPU's name and the torch, Triton
and kernel versions (the kernel's version is the SHA-256 of this folder's files). The file is written whole (a
temporary file, then an atomic replace) and read once per device and process; a file of another identity (stale), one
that is not exactly what `_write` writes (corrupt: whatever fails to parse, a number out of range, no identity) or
that is not a regular file (a pipe, a device or a folder: opened without waiting, never read) is ignored with one log
line, never used or merged, and replaced by the next choice measured.

Timing runs the call's own inputs through each path with `TIMER` (CUDA events after a warm-up); the tests inject a
timer of their own and add "cpu" to `MEASURED_DEVICE_TYPES`. Nothing from Transformers.
"""

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import re
import stat
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from .launch import triton
from .selfcheck import LAYOUTS, Combination

logger = logging.getLogger(__name__)

MARGIN = 0.03  # the kernel must be more than 3% faster than SDPA + gate to run
CACHE_VARIABLE = "GATED_QWEN_KERNEL_CACHE"
CACHE_FORMAT = 1
MAX_CACHE_BYTES = 16 * 2**20  # a larger cache file is not one `_write` wrote (a choice takes about 250 bytes)
MAX_COUNT = 2**31  # head dims and length buckets beyond this are not measured choices
MEASURED_DEVICE_TYPES = ("cuda",)  # where the choice is measured; elsewhere the kernel runs only when asked for


@dataclasses.dataclass(frozen=True)
class ChoiceKey:
    """What one measurement decides: a combination, the length bucket of its calls (the longest key sequence rounded
    up to a power of two) and whether gradients are needed (forward + backward timed, else forward)."""

    combo: Combination
    keys: int
    backward: bool

    def describe(self) -> str:
        return f"{self.combo.describe()}, keys <= {self.keys}, {'forward + backward' if self.backward else 'forward'}"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The verdict of one key: whether the kernel runs, the median milliseconds of each path (None where not
    measured), what failed (a failed timing), and whether it came from the cache file."""

    kernel: bool
    kernel_ms: float | None
    sdpa_ms: float | None
    failure: str | None = None
    from_file: bool = False


# The choices of this process (measured, or read from the cache file), and the devices whose file has been read.
CHOICES: dict[ChoiceKey, Choice] = {}
_READ: set[str] = set()
_UNWRITABLE: set[Path] = set()


def measured_on(device: str) -> bool:
    """Whether calls on `device` ("cuda:0", "cpu") run the kernel only where it was measured faster."""
    return device.split(":")[0] in MEASURED_DEVICE_TYPES


def capturing(device: str) -> bool:
    """Whether a CUDA graph is being captured on `device`'s current stream (nothing can be timed then)."""
    return device.startswith("cuda") and torch.cuda.is_current_stream_capturing()


def length_bucket(n: int) -> int:
    """The smallest power of two >= `n` (a loop: `n` may be a symbolic size under torch.compile)."""
    bucket = 1
    while bucket < n:
        bucket *= 2
    return bucket


def kernel_wins(kernel_ms: float, sdpa_ms: float) -> bool:
    """The rule: the kernel runs only when it is faster than SDPA + gate by more than `MARGIN`; a tie goes to SDPA."""
    return kernel_ms < sdpa_ms * (1 - MARGIN)


def cuda_milliseconds(run: Callable[[], object], device: str, path: str, warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds of `run()` on `device`'s current stream, with CUDA events, after `warmup` calls (which pay
    the compilation and Triton's autotuning). `path` ("kernel" or "sdpa") names what runs (for injected timers)."""
    with torch.cuda.device(torch.device(device)):
        for _ in range(warmup):
            run()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        for start, end in events:
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)


TIMER: Callable[[Callable[[], object], str, str], float] = cuda_milliseconds


def measure(key: ChoiceKey, kernel_run: Callable[[], object], sdpa_run: Callable[[], object]) -> Choice:
    """Times both paths of `key` with `TIMER` and applies the rule; records the choice (and writes the cache file)."""
    times = {}
    for path, run in (("kernel", kernel_run), ("sdpa", sdpa_run)):
        try:
            ms = float(TIMER(run, key.combo.device, path))
            if not (math.isfinite(ms) and ms > 0):
                raise ValueError(f"the timer returned {ms} ms")
        except Exception as err:  # a failed timing is a verdict: SDPA + gate, not written down
            message = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
            choice = Choice(False, times.get("kernel"), None, f"timing {path} failed: {type(err).__name__}: {message}")
            CHOICES[key] = choice
            return choice
        times[path] = ms
    CHOICES[key] = choice = Choice(kernel_wins(times["kernel"], times["sdpa"]), times["kernel"], times["sdpa"])
    _write(key.combo.device)
    return choice


def known(key: ChoiceKey) -> Choice | None:
    """The choice of `key` made in this process or read from the cache file, or None (not measured yet)."""
    if key.combo.device not in _READ:
        _read(key.combo.device)
    return CHOICES.get(key)


def known_kernel(key: ChoiceKey) -> bool:
    """Under torch.compile: whether a known choice of `key` is the kernel. The look-up runs eagerly while tracing (so
    the cache file can be read there) and its answer is a constant of the graph, as a self-check verdict is."""
    combo = key.combo
    return _known_kernel(combo.device, combo.dtype, combo.head_dim, combo.gate, combo.causal, combo.layout, key.keys,
                         key.backward)


@torch.compiler.assume_constant_result
def _known_kernel(device, dtype, head_dim, gate, causal, layout, keys, backward) -> bool:
    choice = known(ChoiceKey(Combination(device, dtype, head_dim, gate, causal, layout), keys, backward))
    return choice is not None and choice.kernel


# --------------------------------------------------------------------------------------------------------------------
# The cache file
# --------------------------------------------------------------------------------------------------------------------


def cache_folder() -> Path:
    """`GATED_QWEN_KERNEL_CACHE`, else `gated-qwen-kernel/` beside Triton's cache folder (`~/.triton/`)."""
    if folder := os.environ.get(CACHE_VARIABLE):
        return Path(folder)
    triton_cache = Path(triton.knobs.cache.dir) if triton is not None else Path.home() / ".triton" / "cache"
    return triton_cache.parent / "gated-qwen-kernel"


def _gpu_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device.split(":")[0]


def cache_file(device: str) -> Path:
    """The cache file of `device`'s GPU: `choices-<GPU name>.json` in `cache_folder()`."""
    return cache_folder() / f"choices-{re.sub(r'[^A-Za-z0-9.]+', '-', _gpu_name(device)).strip('-')}.json"


@functools.cache
def kernel_version() -> str:
    """SHA-256 of the kernel's files (this folder's `*.py`, names and contents): any change measures again."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        data = path.read_bytes()
        digest.update(f"{path.name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def identity(device: str) -> dict:
    """What the choices in a cache file were measured with."""
    return {"format": CACHE_FORMAT, "gpu": _gpu_name(device), "torch": torch.__version__,
            "triton": None if triton is None else triton.__version__, "kernel": kernel_version()}


def _entry(key: ChoiceKey, choice: Choice) -> dict:
    combo = key.combo
    return {"dtype": str(combo.dtype).removeprefix("torch."), "head_dim": combo.head_dim, "gate": combo.gate,
            "causal": combo.causal, "layout": combo.layout, "keys": key.keys, "backward": key.backward,
            "path": "kernel" if choice.kernel else "sdpa", "kernel_ms": choice.kernel_ms, "sdpa_ms": choice.sdpa_ms}


def _from_entry(entry, device: str) -> tuple[ChoiceKey, Choice]:
    """An entry of the file -> (key, choice) on `device`; ValueError when it is not exactly one `_entry` writes: each
    field of its type, counts and times in range, a length bucket that is a power of two, the path its times give,
    a dtype by its own name (not an alias)."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "head_dim", "gate", "causal", "layout", "keys",
                                                      "backward", "path", "kernel_ms", "sdpa_ms"}:
        raise ValueError("an entry is not an object of the fields `_entry` writes")
    dtype = getattr(torch, entry["dtype"], None) if isinstance(entry["dtype"], str) else None
    counts, times = (entry["head_dim"], entry["keys"]), (entry["kernel_ms"], entry["sdpa_ms"])
    if (not isinstance(dtype, torch.dtype) or not all(type(n) is int and 0 < n <= MAX_COUNT for n in counts)
            or not all(type(t) is float and math.isfinite(t) and t > 0 for t in times)
            or not isinstance(entry["causal"], bool) or not isinstance(entry["backward"], bool)
            or entry["gate"] not in (None, "elementwise", "headwise") or entry["layout"] not in LAYOUTS):
        raise ValueError("an entry is not a measured choice")
    combo = Combination(device, dtype, entry["head_dim"], entry["gate"], entry["causal"], entry["layout"])
    key = ChoiceKey(combo, entry["keys"], entry["backward"])
    choice = Choice(kernel_wins(*times), *times, from_file=True)
    if _entry(key, choice) != entry or key.keys != length_bucket(key.keys):
        raise ValueError("an entry is not a measured choice")
    return key, choice


def _no_constant(name: str):
    raise ValueError(f"{name}, which `_write` never writes")


def _text(path: Path) -> str | None:
    """The text of the regular file `path`, None when there is none. It is opened without waiting (a pipe's open
    would wait for a writer) and read only when it is a regular file of at most `MAX_CACHE_BYTES`; ValueError else."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError("a folder" if stat.S_ISDIR(mode) else "not a regular file (a pipe, socket or device)")
        with open(fd, "rb", closefd=False) as handle:
            data = handle.read(MAX_CACHE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_CACHE_BYTES:
        raise ValueError(f"more than {MAX_CACHE_BYTES} bytes")
    return data.decode("utf-8")


def _file_choices(device: str, quiet: bool = False) -> dict[ChoiceKey, Choice]:
    """The choices of `device`'s cache file; {} when there is none, or (with one log line unless `quiet`) when it is
    stale, corrupt or not a regular file: only a file of this identity, exactly as `_write` writes it, is used."""
    path = cache_file(device)
    expected = identity(device)
    try:
        text = _text(path)
        if text is None:
            return {}
        content = json.loads(text, parse_constant=_no_constant)
        if not isinstance(content, dict) or set(content) != {"identity", "choices"}:
            raise ValueError("not an object of an identity and its choices")
        found = content["identity"]
        if isinstance(found, dict) and found != expected:
            if not quiet:
                differs = ", ".join(f"{k} {repr(found.get(k))[:60]} (now {v!r})" for k, v in expected.items()
                                    if found.get(k) != v)
                logger.info(f"{path}: ignored, measured with another {differs}; the choices are measured again and "
                            "the file replaced")
            return {}
        if not isinstance(found, dict) or not isinstance(content["choices"], list):
            raise ValueError("no list of choices under an identity")
        return dict(_from_entry(entry, device) for entry in content["choices"])
    except Exception as err:  # whatever the file holds (RecursionError, OverflowError...): ignored, never a crash
        if not quiet:
            reason = " ".join(str(err).split())[:200]
            logger.warning(f"{path}: ignored, not a cache of kernel choices ({type(err).__name__}: {reason}); the "
                           "choices are measured again and the file replaced")
        return {}


def _read(device: str) -> None:
    _READ.add(device)
    for key, choice in _file_choices(device).items():
        CHOICES.setdefault(key, choice)


def _write(device: str) -> None:
    """Writes `device`'s cache file whole: what it holds now (another process may have added choices) and this
    process's measured choices of the devices with the same GPU, through a temporary file and an atomic replace."""
    path = cache_file(device)
    if path in _UNWRITABLE:
        return
    name = _gpu_name(device)
    choices = {dataclasses.replace(key, combo=dataclasses.replace(key.combo, device=device)): choice
               for key, choice in CHOICES.items() if choice.failure is None and _gpu_name(key.combo.device) == name}
    merged = _file_choices(device, quiet=True) | choices
    content = {"identity": identity(device), "choices": [_entry(k, c) for k, c in merged.items()]}
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.",
                                         suffix=".tmp", delete=False) as handle:
            temporary = Path(handle.name)
            json.dump(content, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as err:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
        _UNWRITABLE.add(path)
        logger.warning(f"{path}: could not write the kernel choices ({err}); they are measured again in the next "
                       f"process (set {CACHE_VARIABLE} to a writable folder to keep them)")
