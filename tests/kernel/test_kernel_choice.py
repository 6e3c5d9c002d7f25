"""The measured default (kernel/choice.py): on a CUDA GPU the gated_triton backend runs the fused kernel only where it
was measured faster than SDPA + a separate gate, per combination, length bucket and pass; the choices are kept in a
cache file. No GPU here: the CPU's calls are measured as a GPU's would be (`choice.MEASURED_DEVICE_TYPES` gets
"cpu"), the kernel runs under the Triton interpreter (tests/conftest.py), and an injected timer says which path is
faster; what runs is asserted through the kernel's launches and against the SDPA model's logits and gradients."""

import copy
import json
import logging
import math
import os
import threading

import pytest
import torch

pytest.importorskip("triton", reason="needs the triton extra: pip install 'gated-qwen[triton]'")

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, kernel
from gated_qwen.kernel import attention, choice, parallel
from gated_qwen.kernel.selfcheck import Combination
from tests.helpers import SMALL, randomize_, sizes

if not kernel.triton_available():
    pytest.skip("no CUDA device and TRITON_INTERPRET was not set before import", allow_module_level=True)
if torch.cuda.is_available():
    pytest.skip("simulates a GPU's measured choice on the CPU", allow_module_level=True)

TOL = 2e-5  # fp32: the fused kernel multiplies its fp32 accumulator, sdpa the rounded output


class FakeTimer:
    """`choice.TIMER` with the milliseconds of each path given (a number, or an exception to raise); it runs the path
    once (the real call on the call's inputs) and records what it timed."""

    def __init__(self, kernel=1.0, sdpa=2.0):
        self.ms, self.timed = {"kernel": kernel, "sdpa": sdpa}, []

    def __call__(self, run, device, path):
        self.timed.append(path)
        if isinstance(self.ms[path], Exception):
            raise self.ms[path]
        run()
        return self.ms[path]


class NoTimer:
    def __call__(self, run, device, path):
        raise AssertionError("nothing may be timed here")


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """The CPU measured as a GPU, nothing chosen or checked yet in this "process", the cache in tmp_path, the
    default mode; returns a function that starts a new "process" (forgets what is in memory)."""
    monkeypatch.setattr(choice, "MEASURED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setenv(choice.CACHE_VARIABLE, str(tmp_path / "choices"))
    monkeypatch.delenv(attention.KERNEL_MODE_VARIABLE, raising=False)

    def new_process():
        monkeypatch.setattr(choice, "CHOICES", {})
        monkeypatch.setattr(choice, "_READ", set())
        monkeypatch.setattr(choice, "_UNWRITABLE", set())
        monkeypatch.setattr(attention, "_SAID_CHOICES", set())
        monkeypatch.setattr(attention, "SELF_CHECK_VERDICTS", {})

    new_process()
    return new_process


@pytest.fixture
def launches(monkeypatch):
    """The fused forward's launches (`parallel.forward`), eager or compiled: the timing's and the model's, not the
    self-check's (which runs the kernel on a problem of its own)."""
    calls, checking, original, original_check = [], [], parallel.forward, attention.self_check

    def spy(*args):
        if not checking:
            calls.append(args[0].shape)
        return original(*args)

    def self_check(combo):
        checking.append(combo)
        try:
            return original_check(combo)
        finally:
            checking.pop()

    monkeypatch.setattr(parallel, "forward", spy)
    monkeypatch.setattr(attention, "self_check", self_check)
    return calls


def use_timer(monkeypatch, timer):
    monkeypatch.setattr(choice, "TIMER", timer)
    return timer


def model_pair(seed=0):
    config = GatedQwenConfig(**sizes(SMALL))
    sdpa = randomize_(GatedQwenForCausalLM(config), seed=seed).eval()
    sdpa.set_attn_implementation("sdpa")
    fused = copy.deepcopy(sdpa)
    fused.set_attn_implementation("gated_triton")
    return sdpa, fused


def ids(length=24, seed=1):
    return torch.randint(0, SMALL["vocab_size"], (2, length), generator=torch.Generator().manual_seed(seed))


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def logits_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids).logits
    torch.nn.functional.cross_entropy(logits.transpose(1, 2), input_ids.roll(-1, 1)).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_as_sdpa(sdpa, fused, input_ids):
    """Logits and every parameter's gradient equal the SDPA model's (the timing leaves the model's gradients alone)."""
    (logits_s, grads_s), (logits_f, grads_f) = logits_and_grads(sdpa, input_ids), logits_and_grads(fused, input_ids)
    assert rel_err(logits_f, logits_s) <= TOL
    assert not {n for n in grads_s if rel_err(grads_f[n], grads_s[n]) > TOL}


def choice_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == attention.logger.name and " ms" in r.getMessage()]


def cache_content():
    return json.loads(choice.cache_file("cpu").read_text())


def no_grad_forward(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits


# ------------------------------------------------------------------------------------------------------------------


def test_the_rule_kernel_faster_by_more_than_the_margin_else_sdpa():
    assert choice.MARGIN == 0.03
    assert choice.kernel_wins(0.96, 1.0)
    assert not choice.kernel_wins(0.975, 1.0)  # within noise: a tie goes to SDPA + gate
    assert not choice.kernel_wins(1.0, 1.0)
    assert not choice.kernel_wins(1.5, 1.0)
    assert [choice.length_bucket(n) for n in (1, 2, 3, 24, 32, 33, 4097)] == [1, 2, 4, 32, 32, 64, 8192]


def test_kernel_measured_faster_runs_the_kernel_and_says_both_times(monkeypatch, caplog, measured, launches):
    timer = use_timer(monkeypatch, FakeTimer(kernel=1.0, sdpa=2.0))
    sdpa, fused = model_pair()
    with caplog.at_level(logging.INFO, logger=attention.logger.name):
        assert_same_as_sdpa(sdpa, fused, ids())
        timed_launches = 1  # the timer ran the kernel's path once
        assert len(launches) == timed_launches + 2  # + both layers' forwards
        assert_same_as_sdpa(sdpa, fused, ids(seed=2))  # the choice is kept: no second timing
    assert timer.timed == ["kernel", "sdpa"]
    assert len(launches) == timed_launches + 4
    (line,) = choice_lines(caplog)
    assert "dense" in line and "keys <= 32" in line and "forward + backward" in line
    assert "fused kernel 1 ms, SDPA + gate 2 ms" in line and line.endswith("running the fused kernel")
    ((key, chosen),) = choice.CHOICES.items()
    assert (key.keys, key.backward, chosen.kernel) == (32, True, True)


def test_kernel_measured_slower_runs_sdpa_and_gives_its_logits(monkeypatch, caplog, measured, launches):
    timer = use_timer(monkeypatch, FakeTimer(kernel=2.0, sdpa=1.0))
    sdpa, fused = model_pair()
    with caplog.at_level(logging.INFO, logger=attention.logger.name):
        assert_same_as_sdpa(sdpa, fused, ids())
    assert timer.timed == ["kernel", "sdpa"] and len(launches) == 1  # the timing's launch only
    (line,) = choice_lines(caplog)
    assert "fused kernel 2 ms, SDPA + gate 1 ms" in line and line.endswith("running SDPA + a separate sigmoid gate")


def test_kernel_faster_within_the_margin_is_a_tie_and_runs_sdpa(monkeypatch, measured, launches):
    use_timer(monkeypatch, FakeTimer(kernel=0.98, sdpa=1.0))
    sdpa, fused = model_pair()
    assert rel_err(no_grad_forward(fused, ids()), no_grad_forward(sdpa, ids())) <= TOL
    assert len(launches) == 1
    ((key, chosen),) = choice.CHOICES.items()
    assert not key.backward and not chosen.kernel  # under no_grad the forward alone was timed


@pytest.mark.parametrize("failure", [RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), math.nan])
def test_a_failed_timing_runs_sdpa_warns_once_and_is_not_cached(monkeypatch, caplog, measured, launches, failure):
    use_timer(monkeypatch, FakeTimer(kernel=failure, sdpa=1.0))
    sdpa, fused = model_pair()
    with caplog.at_level(logging.INFO, logger=attention.logger.name):
        for step in range(2):
            assert rel_err(no_grad_forward(fused, ids(seed=step)), no_grad_forward(sdpa, ids(seed=step))) <= TOL
    assert len(launches) == int(failure is math.nan)  # the nan timer ran the kernel once, the raising one not at all
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "timing kernel failed" in warning and "running SDPA" in warning
    assert ("out of memory" in warning) if isinstance(failure, Exception) else ("nan ms" in warning)
    assert not choice.cache_file("cpu").exists()


def test_choices_are_written_whole_and_read_back_by_the_next_run_kernel_faster(monkeypatch, caplog, measured,
                                                                               launches):
    use_timer(monkeypatch, FakeTimer(kernel=1.0, sdpa=2.0))
    sdpa, fused = model_pair()
    no_grad_forward(fused, ids())
    content = cache_content()
    assert content["identity"] == {"format": 1, "gpu": "cpu", "torch": torch.__version__,
                                   "triton": kernel.launch.triton.__version__, "kernel": choice.kernel_version()}
    assert content["choices"] == [{"dtype": "float32", "head_dim": 16, "gate": "elementwise", "causal": True,
                                   "layout": "dense", "keys": 32, "backward": False, "path": "kernel",
                                   "kernel_ms": 1.0, "sdpa_ms": 2.0}]
    assert [p.name for p in choice.cache_folder().iterdir()] == [choice.cache_file("cpu").name]  # no temporary left

    measured()  # the next run: the same choice, read back, nothing timed
    use_timer(monkeypatch, NoTimer())
    launches.clear()
    with caplog.at_level(logging.INFO, logger=attention.logger.name):
        assert rel_err(no_grad_forward(fused, ids()), no_grad_forward(sdpa, ids())) <= TOL
    assert len(launches) == 2
    (line,) = choice_lines(caplog)
    assert f"measured in an earlier run: {choice.cache_file('cpu')}" in line and "running the fused kernel" in line


def test_a_failed_write_leaves_the_file_as_it_was(monkeypatch, caplog, measured, launches):
    use_timer(monkeypatch, FakeTimer(kernel=1.0, sdpa=2.0))
    sdpa, fused = model_pair()
    no_grad_forward(fused, ids(length=24))  # keys <= 32: written
    before = choice.cache_file("cpu").read_bytes()

    def interrupted(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(choice.os, "replace", interrupted)
    with caplog.at_level(logging.WARNING, logger=choice.logger.name):
        no_grad_forward(fused, ids(length=40))  # keys <= 64: measured, not written
        no_grad_forward(fused, ids(length=80))  # keys <= 128: no second warning
    assert choice.cache_file("cpu").read_bytes() == before
    assert [p.name for p in choice.cache_folder().iterdir()] == [choice.cache_file("cpu").name]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "could not write" in warning and "No space left" in warning and choice.CACHE_VARIABLE in warning
    assert len(launches) == 3 * (1 + 2)  # still the kernel, for this process: 3 timings + 3 × both layers


@pytest.mark.parametrize("field, value", [("torch", "2.0.0"), ("gpu", "NVIDIA H100 80GB HBM3")])
def test_a_stale_cache_is_ignored_with_one_line_and_measured_again_kernel_slower(monkeypatch, caplog, measured,
                                                                                 launches, field, value):
    """A file measured under another torch, or another GPU's file (copied, or of a GPU whose name gives the same file
    name), says: kernel; here the kernel is slower."""
    use_timer(monkeypatch, FakeTimer(kernel=1.0, sdpa=2.0))
    sdpa, fused = model_pair()
    no_grad_forward(fused, ids())
    stale = cache_content()
    now, stale["identity"][field] = stale["identity"][field], value
    choice.cache_file("cpu").write_text(json.dumps(stale))

    measured()
    timer = use_timer(monkeypatch, FakeTimer(kernel=2.0, sdpa=1.0))
    launches.clear()
    with caplog.at_level(logging.INFO, logger=choice.logger.name):
        assert rel_err(no_grad_forward(fused, ids()), no_grad_forward(sdpa, ids())) <= TOL
    assert timer.timed == ["kernel", "sdpa"] and len(launches) == 1  # measured again: SDPA
    (line,) = [r.getMessage() for r in caplog.records if r.name == choice.logger.name]
    assert "ignored" in line and f"{field} {value!r} (now {now!r})" in line
    replaced = cache_content()
    assert replaced["identity"] == choice.identity("cpu") and [c["path"] for c in replaced["choices"]] == ["sdpa"]


SDPA_AT_32 = {"dtype": "float32", "head_dim": 16, "gate": "elementwise", "causal": True, "layout": "dense", "keys": 32,
              "backward": False, "path": "sdpa", "kernel_ms": 2.0, "sdpa_ms": 1.0}  # what `ids()` without gradients asks


@pytest.mark.parametrize("content", [b'{"identity": {', b"\xff\xfe\x00", b'{"choices": 3}', b"[]",
                                     b'{"identity": {}, "choices": [{"dtype": "float32"}]}',
                                     b'{"identity": {}, "choices": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
                                     json.dumps({"choices": [SDPA_AT_32]}).encode()],
                         ids=["truncated", "not UTF-8", "no identity, no list", "a list", "a bad entry",
                              "nested 200,000 deep", "no identity"])
def test_a_corrupt_cache_is_ignored_with_one_line_and_measured_again_kernel_faster(monkeypatch, caplog, measured,
                                                                                   launches, content):
    choice.cache_file("cpu").parent.mkdir(parents=True)
    choice.cache_file("cpu").write_bytes(content)
    timer = use_timer(monkeypatch, FakeTimer(kernel=1.0, sdpa=2.0))
    sdpa, fused = model_pair()
    with caplog.at_level(logging.INFO, logger=choice.logger.name):
        assert rel_err(no_grad_forward(fused, ids()), no_grad_forward(sdpa, ids())) <= TOL
    assert timer.timed == ["kernel", "sdpa"] and len(launches) == 3
    lines = [r.getMessage() for r in caplog.records if r.name == choice.logger.name]
    assert len(lines) == 1 and "ignored" in lines[0] and str(choice.cache_file("cpu")) in lines[0]
    assert cache_content()["choices"][0]["path"] == "kernel"  # replaced whole


def choice_key(keys=32):
    """The key of `ids()`'s calls without gradients (`SDPA_AT_32`'s), or of another length bucket."""
    return choice.ChoiceKey(Combination("cpu", torch.float32, 16, "elementwise", True, "dense"), keys, False)


def written_file(monkeypatch, measured) -> str:
    """The text `_write` writes for two choices measured kernel faster (keys <= 32 and <= 1024), checked to be used
    as it is by the next process."""
    use_timer(monkeypatch, FakeTimer(kernel=1.0, sdpa=2.0))
    for keys in (32, 1024):
        choice.measure(choice_key(keys), lambda: None, lambda: None)
    measured()
    assert choice.known(choice_key()) == choice.Choice(True, 1.0, 2.0, from_file=True)
    measured()
    return choice.cache_file("cpu").read_text()


def _edit(**changes):
    """The file with its fields changed: `identity`/`choices` replaced, or added (a field `_write` never writes)."""
    return lambda text: json.dumps(json.loads(text) | changes)


def _replace(old, new):
    def edit(text):
        assert old in text
        return text.replace(old, new, 1)
    return edit


NOT_AS_WRITTEN = {
    "truncated": lambda text: text[: len(text) // 2],
    "not UTF-8": lambda text: text.encode().replace(b"float32", b"float\xff32", 1),
    "not a JSON object": lambda text: f"[{text}]",
    "no identity": lambda text: json.dumps({"choices": json.loads(text)["choices"]}),
    "an identity that is not an object": lambda text: json.dumps({**json.loads(text), "identity": "cpu"}),
    "a field _write never writes": lambda text: json.dumps({**json.loads(text), "measured_by": "me"}),
    "choices not a list": lambda text: json.dumps({**json.loads(text), "choices": {}}),
    "nested 200,000 deep": lambda text: text.replace('"choices": [', '"choices": [' + "[" * 200_000 + "]" * 200_000
                                                     + ", ", 1),
    "an entry without kernel_ms": lambda text: json.dumps({**json.loads(text), "choices": [
        {k: v for k, v in entry.items() if k != "kernel_ms"} for entry in json.loads(text)["choices"]]}),
    "head_dim Infinity": _replace('"head_dim": 16', '"head_dim": Infinity'),
    "head_dim 1e400": _replace('"head_dim": 16', '"head_dim": 1e400'),
    "head_dim 2**64": _replace('"head_dim": 16', f'"head_dim": {2**64}'),
    "head_dim 16.0": _replace('"head_dim": 16', '"head_dim": 16.0'),
    "keys of 5,000 digits": _replace('"keys": 32', '"keys": 3' + "0" * 4999),
    "keys 24 (no bucket)": _replace('"keys": 32', '"keys": 24'),
    "kernel_ms NaN": _replace('"kernel_ms": 1.0', '"kernel_ms": NaN'),
    "kernel_ms -1.0": _replace('"kernel_ms": 1.0', '"kernel_ms": -1.0'),
    "kernel_ms a string": _replace('"kernel_ms": 1.0', '"kernel_ms": "1.0"'),
    "path kernel, measured slower": _replace('"kernel_ms": 1.0', '"kernel_ms": 5.0'),
    "causal 1": _replace('"causal": true', '"causal": 1'),
    "dtype float (an alias)": _replace('"dtype": "float32"', '"dtype": "float"'),
    "layout unknown": _replace('"layout": "dense"', '"layout": "sparse"'),
}


@pytest.mark.parametrize("case", list(NOT_AS_WRITTEN))
def test_a_cache_not_exactly_as_written_is_ignored_with_one_line_never_merged_and_replaced(monkeypatch, caplog,
                                                                                           measured, case):
    """A file that `_write` wrote (used as it is), changed in one way: nothing of it is used (the kernel, which it
    says is faster, is measured slower) or merged into the file that replaces it, and one line names it."""
    damaged = NOT_AS_WRITTEN[case](written_file(monkeypatch, measured))
    choice.cache_file("cpu").write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode())
    use_timer(monkeypatch, FakeTimer(kernel=2.0, sdpa=1.0))
    with caplog.at_level(logging.INFO, logger=choice.logger.name):
        assert choice.known(choice_key()) is None and not choice.CHOICES
        assert choice.measure(choice_key(), lambda: None, lambda: None) == choice.Choice(False, 2.0, 1.0)
    (line,) = [r.getMessage() for r in caplog.records if r.name == choice.logger.name]
    assert line.startswith(f"{choice.cache_file('cpu')}: ignored, not a cache of kernel choices (") and len(line) < 500
    assert cache_content() == {"identity": choice.identity("cpu"), "choices": [SDPA_AT_32]}


@pytest.mark.parametrize("kind", ["a FIFO", "a link to /dev/null", "a folder"])
def test_a_cache_that_is_not_a_regular_file_is_ignored_without_waiting_and_replaced(monkeypatch, caplog, measured,
                                                                                      kind):
    """Opened without waiting and never read: a FIFO's open or read would wait for a writer, and a device's read may
    never end (/dev/zero). A FIFO or a link is replaced by the file written; a folder is left as it is (one more line:
    not written)."""
    path = choice.cache_file("cpu")
    path.parent.mkdir(parents=True)
    {"a FIFO": os.mkfifo, "a link to /dev/null": lambda p: p.symlink_to("/dev/null"), "a folder": os.mkdir}[kind](path)
    answer = []
    with caplog.at_level(logging.INFO, logger=choice.logger.name):
        reading = threading.Thread(target=lambda: answer.append(choice.known(choice_key())), daemon=True)
        reading.start()
        reading.join(timeout=120)  # a safety net: reading takes milliseconds
        waited = reading.is_alive()
        while reading.is_alive():  # a reader blocked on the FIFO gets its end, so that the test ends
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            reading.join(timeout=1)
        assert not waited, f"reading the cache waited on {kind}"
        assert answer == [None]
        use_timer(monkeypatch, FakeTimer(kernel=1.0, sdpa=2.0))
        choice.measure(choice_key(), lambda: None, lambda: None)
    lines = [r.getMessage() for r in caplog.records if r.name == choice.logger.name]
    assert lines[0].startswith(f"{path}: ignored, not a cache of kernel choices (ValueError: ")
    assert ("a folder" if kind == "a folder" else "not a regular file (a pipe, socket or device)") in lines[0]
    if kind == "a folder":
        assert path.is_dir() and len(lines) == 2 and "could not write the kernel choices" in lines[1]
    else:
        assert len(lines) == 1 and not path.is_symlink() and cache_content()["choices"][0]["path"] == "kernel"


def test_a_failed_timing_never_reaches_the_file_even_after_a_later_success(monkeypatch, measured, launches):
    """keys <= 32: the kernel's timing fails (SDPA for this process, nothing written); keys <= 64: measured and
    written, without the failed choice; the next process measures keys <= 32 again."""
    timer = use_timer(monkeypatch, FakeTimer(kernel=RuntimeError("CUDA out of memory"), sdpa=1.0))
    sdpa, fused = model_pair()
    no_grad_forward(fused, ids(length=24))
    assert not choice.cache_file("cpu").exists()
    timer.ms["kernel"] = 0.5
    no_grad_forward(fused, ids(length=40))
    assert {k.keys: c.failure is None for k, c in choice.CHOICES.items()} == {32: False, 64: True}
    assert [(c["keys"], c["path"]) for c in cache_content()["choices"]] == [(64, "kernel")]
    measured()
    timer.timed.clear()
    launches.clear()
    assert rel_err(no_grad_forward(fused, ids(length=24)), no_grad_forward(sdpa, ids(length=24))) <= TOL
    assert timer.timed == ["kernel", "sdpa"] and len(launches) == 1 + 2  # measured again: the kernel, faster
    assert [(c["keys"], c["path"]) for c in cache_content()["choices"]] == [(64, "kernel"), (32, "kernel")]


def test_trust_runs_the_kernel_unmeasured_and_off_never_slower_or_faster(monkeypatch, measured, launches):
    use_timer(monkeypatch, NoTimer())
    sdpa, fused = model_pair()
    monkeypatch.setenv("GATED_QWEN_KERNEL", "trust")
    no_grad_forward(fused, ids())
    assert len(launches) == 2 and not choice.CHOICES and not attention.SELF_CHECK_VERDICTS
    monkeypatch.setenv("GATED_QWEN_KERNEL", "off")
    assert rel_err(no_grad_forward(fused, ids()), no_grad_forward(sdpa, ids())) <= TOL
    assert len(launches) == 2 and not choice.CHOICES
    assert not choice.cache_folder().exists()


def test_each_length_bucket_and_pass_is_measured_once_kernel_faster_only_for_short(monkeypatch, measured, launches):
    """Lengths 20 and 30 share the bucket 32, 40 is in 64; a call with gradients is measured apart."""
    class ByLength(FakeTimer):
        def __call__(self, run, device, path):
            self.ms = {"kernel": 1.0, "sdpa": 2.0} if len(self.timed) < 2 else {"kernel": 2.0, "sdpa": 1.0}
            return super().__call__(run, device, path)

    timer = use_timer(monkeypatch, ByLength())
    sdpa, fused = model_pair()
    for length in (20, 30):
        no_grad_forward(fused, ids(length=length))
    assert len(timer.timed) == 2 and len(launches) == 1 + 2 * 2  # kernel faster at keys <= 32
    no_grad_forward(fused, ids(length=40))
    assert len(timer.timed) == 4 and len(launches) == 5 + 1  # slower at keys <= 64: the timing's launch only
    assert_same_as_sdpa(sdpa, fused, ids(length=20))
    assert len(timer.timed) == 6 and len(launches) == 6 + 1  # slower forward + backward at keys <= 32
    assert {(k.keys, k.backward): c.kernel for k, c in choice.CHOICES.items()} == {
        (32, False): True, (64, False): False, (32, True): False}
    assert len(cache_content()["choices"]) == 3


def test_cpu_calls_are_not_measured_where_the_kernel_is_asked_for(monkeypatch, measured, launches):
    """On a CPU (the interpreter) nothing changes: the self-check alone decides, nothing is timed or written."""
    monkeypatch.setattr(choice, "MEASURED_DEVICE_TYPES", ("cuda",))
    use_timer(monkeypatch, NoTimer())
    _, fused = model_pair()
    no_grad_forward(fused, ids())
    assert len(launches) == 2 and list(attention.SELF_CHECK_VERDICTS.values()) == [None] and not choice.CHOICES
    assert not choice.cache_folder().exists()


def test_while_a_cuda_graph_is_captured_the_kernel_runs_only_where_measured_faster(monkeypatch, measured, launches):
    """Nothing is checked or timed during a capture: a known choice is kept, an unknown combination runs SDPA."""
    use_timer(monkeypatch, NoTimer())
    monkeypatch.setattr(choice, "capturing", lambda device: True)
    sdpa, fused = model_pair()
    assert rel_err(no_grad_forward(fused, ids()), no_grad_forward(sdpa, ids())) <= TOL
    assert not launches and not attention.SELF_CHECK_VERDICTS  # not chosen blind
    monkeypatch.setattr(choice, "capturing", lambda device: False)
    use_timer(monkeypatch, FakeTimer(kernel=1.0, sdpa=2.0))
    no_grad_forward(fused, ids())  # eager: checked, measured faster
    launches.clear()
    monkeypatch.setattr(choice, "capturing", lambda device: True)
    use_timer(monkeypatch, NoTimer())
    no_grad_forward(fused, ids(seed=3))
    assert len(launches) == 2


@pytest.mark.slow  # torch.compile
@pytest.mark.parametrize("before", ["eager faster", "eager slower", "file faster", "nothing"])
def test_compiled_model_keeps_the_measured_choice_faster_or_slower(monkeypatch, measured, launches, before):
    """Under torch.compile(fullgraph=True) nothing is timed: the choice of an eager call (or of the cache file, read
    while tracing) is kept, and without one the compiled model runs SDPA + gate: the kernel is never chosen blind."""
    sdpa, fused = model_pair()
    x = ids()
    if before != "nothing":
        use_timer(monkeypatch, FakeTimer(kernel=1.0, sdpa=2.0) if "faster" in before else FakeTimer(2.0, 1.0))
        no_grad_forward(fused, x)
    if before == "file faster":
        measured()  # a new process: the choice is only in the file
    use_timer(monkeypatch, NoTimer())
    launches.clear()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
        logits = no_grad_forward(compiled, x)
    finally:
        torch._dynamo.reset()
    assert rel_err(logits, no_grad_forward(sdpa, x)) <= TOL
    assert len(launches) == (2 if "faster" in before else 0)
