"""`gated-qwen reproduce`'s worker processes end with their parent, quietly: Ctrl-C (SIGINT to the whole process
group, as a terminal sends it) prints one line and no worker traceback, and a parent killed with SIGKILL takes its
workers with it, so nothing re-creates the staging folder that `--clean` removed. Real processes, real signals."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # three processes import the model stack, then train a few runs


class Run:
    """`gated-qwen reproduce --preset smoke --jobs 2` (or `jobs`) in a session of its own, its stderr collected as it
    comes; runs of 4,000 steps, so that a worker left alone goes on training for many seconds (the tests that signal a run
    train the main models only: with the other families' 6-step runs at the end, a test once caught both workers'
    scratch folders during the last runs and signalled a command that had just ended)."""

    def __init__(self, tmp_path: Path, jobs: int = 2, out: str = "out", steps: int = 4_000, main_models_only=False,
                 scratch: str | None = "scratch"):
        # The workers' temporary folders (the Trainer's) go to TMPDIR=tmp_path/scratch, or with scratch=None to the
        # default TMPDIR, where other processes' lie too.
        env = {name: value for name, value in os.environ.items() if name != "TMPDIR"}
        self.shared = scratch is None
        if self.shared:
            self.scratch = Path(tempfile.gettempdir())
        else:
            self.scratch = env["TMPDIR"] = tmp_path / scratch
            self.scratch.mkdir(exist_ok=True)
        self.out = tmp_path / out
        # A process started with Ctrl-C ignored (a shell's background job, nohup: how a test run may be started)
        # passes that on, and Python keeps it ignored: the command would then never see the test's Ctrl-C and would
        # run to its end (status 0, or minutes past the test's wait with long runs). It starts as from a terminal.
        ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gated_qwen.cli", "reproduce", "--preset", "smoke", "--steps", str(steps),
                 "--jobs", str(jobs), "--out", str(self.out), *(["--families", "main"] if main_models_only else [])],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                env={name: str(value) for name, value in env.items()})
        finally:
            if ignored:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.err = b""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while chunk := os.read(self.process.stderr.fileno(), 4096):
            self.err += chunk

    def trainer_scratch(self) -> list[str]:
        """The Trainer scratch folders of the workers (other libraries' caches may stay: they are meant to); in the
        default TMPDIR, those of this run's own process (`--jobs 1`) by their owner record."""
        found = sorted(self.scratch.glob("gated-qwen-trainer-*"))
        if self.shared:
            found = [folder for folder in found if owner_pid(folder) == self.process.pid]
        return [folder.name for folder in found]

    def workers(self) -> list[int]:
        pid = self.process.pid
        children = []
        for task in os.listdir(f"/proc/{pid}/task"):
            children += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        return [c for c in children if b"multiprocessing.spawn" in Path(f"/proc/{c}/cmdline").read_bytes()]

    def wait_for_training(self, scratch_folders: int = 2) -> list[int]:
        """Waits until both workers train (each has made its Trainer scratch folder: `scratch_folders` of them in
        TMPDIR), returns their ids."""
        deadline = time.monotonic() + 400
        while len(self.trainer_scratch()) < scratch_folders:
            assert self.process.poll() is None, self.err.decode()[-2000:]
            assert time.monotonic() < deadline, self.err.decode()[-2000:]
            time.sleep(0.2)
        workers = self.workers()
        assert len(workers) == (2 if scratch_folders == 2 else 0)
        return workers

    def frozen_while_training(self) -> list[int]:
        """Both workers stopped (SIGSTOP) in the middle of a run, so the command cannot end before the test acts,
        however long its runs are; returns their ids. (A run removes its scratch folder when it ends: both folders
        still there once the workers are stopped means both are mid-run.)"""
        while True:
            workers = self.wait_for_training()
            for worker in workers:
                os.kill(worker, signal.SIGSTOP)
            while not all(state(worker) in ("T", None, "Z") for worker in workers):
                time.sleep(0.05)
            if len(self.trainer_scratch()) == 2 and self.process.poll() is None:
                return workers
            for worker in workers:  # a run ended in between: let them go on, and catch the next ones
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGCONT)

    def finish(self) -> str:
        """Waits for the parent and its stderr (which the workers share: closed when the last of them ends)."""
        self.process.wait(timeout=120)
        self.reader.join(timeout=60)
        return self.err.decode()


def owner_pid(folder: Path) -> int | None:
    """The process in a scratch folder's owner record (None if it has none yet, or it is not readable)."""
    try:
        return json.loads((folder / "owner.json").read_text()).get("pid")
    except (OSError, ValueError):
        return None


def state(pid: int) -> str | None:
    """The process's state letter (R running, S sleeping, T stopped, Z zombie, ...), None once it is reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def signals(pid: int, field: str) -> set[int]:
    """The signals of a `/proc/PID/status` mask (`SigIgn`: ignored, `ShdPnd`: sent to the process, pending)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            mask = int(line.split()[1], 16)
            return {number for number in range(1, 65) if mask >> (number - 1) & 1}
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def alive(pids: list[int]) -> list[int]:
    """Those of `pids` that still run (a zombie, ended and waiting to be reaped, does not)."""
    return [pid for pid in pids if state(pid) not in (None, "Z")]


def wait_until_gone(pids: list[int], seconds: float = 10) -> list[int]:
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def end(run: Run) -> None:
    """Kills whatever is left of `run` (a failed test leaves no training processes behind)."""
    workers = run.workers() if run.process.poll() is None else []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.process.pid, signal.SIGKILL)
    for worker in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
    run.process.wait(timeout=60)


@pytest.fixture
def run(tmp_path):
    """A `Run` of the main models, ended at the end."""
    run = Run(tmp_path, main_models_only=True)
    yield run
    end(run)


def test_ctrl_c_prints_one_line_and_stops_the_workers(run, tmp_path):
    """Ctrl-C in the middle of the runs. The workers are held (stopped) mid-run until the parent has asked each to
    end (its SIGTERM pending on them), so the signal always meets a training command, however long its runs."""
    workers = run.frozen_while_training()
    assert signal.SIGINT in signals(run.process.pid, "SigCgt")  # the command handles Ctrl-C
    for worker in workers:  # Ctrl-C is the parent's to handle: a worker ignores it
        assert signal.SIGINT in signals(worker, "SigIgn")
    os.killpg(run.process.pid, signal.SIGINT)  # what a terminal sends to the whole foreground group
    deadline = time.monotonic() + 300  # against a hang only
    while not all(signal.SIGTERM in signals(worker, "ShdPnd") for worker in workers):
        assert run.process.poll() is None and time.monotonic() < deadline, run.err.decode()[-2000:]
        time.sleep(0.05)
    for worker in workers:
        os.kill(worker, signal.SIGCONT)
    err = run.finish()
    assert run.process.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[-1] == "gated-qwen: interrupted; nothing was written."
    assert [line for line in lines if not line.startswith("reproduce:")] == [lines[-1]]  # the rest: its progress bar
    assert wait_until_gone(workers) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scratch"] and run.trainer_scratch() == []


def test_killing_the_parent_ends_the_workers_and_nothing_comes_back_after_clean(run, tmp_path):
    from gated_qwen.cli import main

    workers = run.wait_for_training()
    os.kill(run.process.pid, signal.SIGKILL)
    run.process.wait(timeout=60)
    assert wait_until_gone(workers, seconds=3) == []  # a run takes far longer: they stopped in the middle
    assert "Traceback" not in run.finish()
    (staging,) = tmp_path.glob(".out.writing-*")
    assert main(["convert", "--clean", str(run.out)]) == 0
    assert not staging.exists()
    time.sleep(2)  # a worker that lived on would save its model into the staging folder again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scratch"] and run.trainer_scratch() == []


def test_a_worker_killed_as_by_the_oom_killer_ends_the_run_in_one_line(run, tmp_path):
    """SIGKILL to one worker mid-training (what the out-of-memory killer sends): the command ends at once with one
    line naming what happened and a non-zero status, the other worker stopped, nothing written, its staging folder
    and every Trainer scratch folder removed (the killed worker's too)."""
    workers = run.wait_for_training()
    os.kill(workers[0], signal.SIGKILL)
    err = run.finish()  # a pool that replaced the worker and waited for its result forever would time out here
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert run.process.returncode == 2, err[-2000:]
    assert "Traceback" not in err and [line for line in lines if not line.startswith("reproduce:")] == [lines[-1]]
    assert lines[-1].startswith("gated-qwen: error: a worker process was killed by SIGKILL while training"), err
    assert "likely out of memory" in lines[-1] and "nothing was written" in lines[-1]
    assert wait_until_gone(workers) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scratch"] and run.trainer_scratch() == []


def killed_mid_training(run: Run) -> Path:
    """Kills `run` (`--jobs 1`) with SIGKILL once it trains; returns the Trainer scratch folder it left."""
    try:
        run.wait_for_training(scratch_folders=1)
        (left,) = run.trainer_scratch()
        os.kill(run.process.pid, signal.SIGKILL)
        run.process.wait(timeout=60)
        assert run.trainer_scratch() == [left]  # what a killed process leaves: its owner record, unlocked
        assert (run.scratch / left / "owner.json").is_file()
    finally:
        end(run)
    return run.scratch / left


def clean_command(tmpdir: Path, path: Path) -> subprocess.CompletedProcess:
    """`gated-qwen convert --clean PATH` in a fresh process whose TMPDIR is `tmpdir`."""
    return subprocess.run([sys.executable, "-m", "gated_qwen.cli", "convert", "--clean", str(path)],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "TMPDIR": str(tmpdir)})


def test_the_scratch_of_a_killed_run_is_removed_wherever_it_was_made_and_a_live_runs_is_not(tmp_path):
    """`--jobs 1`, the command SIGKILLed mid-training: its Trainer scratch folder (owned like a staging folder, its
    lock released with the process), owner record and all, is removed by `--clean` and by the next run, whatever
    TMPDIR each has (the default TMPDIR, shared with other processes, or another); `--clean` leaves a live run's
    alone."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    left = killed_mid_training(Run(tmp_path, jobs=1, out="first", main_models_only=True, scratch=None))
    clean = clean_command(elsewhere, tmp_path / "first")
    assert clean.returncode == 0 and f"removed the scratch folder {left} " in clean.stdout, clean.stderr
    assert not left.exists() and not left.is_symlink()

    left = killed_mid_training(Run(tmp_path, jobs=1, out="second", main_models_only=True))
    live = Run(tmp_path, jobs=1, out="third", steps=20_000, main_models_only=True, scratch=None)  # minutes long
    try:
        deadline = time.monotonic() + 400
        while left.exists() or not live.trainer_scratch():  # the next run removes it, then trains
            assert live.process.poll() is None and time.monotonic() < deadline, live.err.decode()[-2000:]
            time.sleep(0.2)
        (mine,) = live.trainer_scratch()
        clean = clean_command(left.parent, tmp_path / "first")
        assert clean.returncode == 0 and f"left {live.scratch / mine} alone" in clean.stdout, clean.stderr
        assert live.trainer_scratch() == [mine] and live.process.poll() is None
    finally:
        end(live)


def waits_on_a_lock(lock) -> None:  # a spawned worker whose main thread then waits in C, as on the pool's task queue
    from gated_qwen.analysis.miniature.workers import worker_started

    worker_started(os.getppid())
    lock.acquire()


def test_a_worker_waiting_in_c_ends_on_sigterm_whichever_thread_it_lands_on(tmp_path):
    """A stopping pool holds its task queue's lock and terminates the workers, whose main thread may be waiting for
    that lock: SIGTERM sent to another of the worker's threads (Linux picks the thread the id names) must end it too
    (a handler in Python would wait for the main thread forever; the suite once hung there)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    lock = context.Lock()
    lock.acquire()
    worker = context.Process(target=waits_on_a_lock, args=(lock,))
    worker.start()
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(f"/proc/{worker.pid}/task")) < 2 or not waiting_in_c(worker.pid):
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.1)
        (other,) = [int(t) for t in os.listdir(f"/proc/{worker.pid}/task") if int(t) != worker.pid][:1]
        os.kill(other, signal.SIGTERM)
        worker.join(timeout=10)
        assert worker.exitcode == 1  # ended by the worker's own handler, quietly
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()


def waiting_in_c(pid: int) -> bool:
    return Path(f"/proc/{pid}/wchan").read_text() in ("futex_wait_queue", "futex_do_wait", "futex_wait")


def big_result(item: int) -> bytes:
    """A result many times larger than a pipe holds (64 KiB): a worker hands it back in many writes."""
    return bytes(64 * 2**20)


STOP_EARLY = """
import sys
from contextlib import closing

from tests.analysis.test_workers import big_result

from gated_qwen.analysis.miniature.workers import run_in_workers

with closing(run_in_workers(big_result, range(4), 2)) as results:
    next(results)  # the first result, while the other worker hands back its own; then the caller stops early
print("stopped")
"""


def test_stopping_while_a_worker_hands_back_a_result_ends(tmp_path):
    """Workers stopped while one of them is in the middle of handing back a large result (a trained model): the pool
    ends. (The pool's reader once waited for the rest of that result forever, and `shutdown` with it; a Ctrl-C'd
    command never ended.)"""
    done = subprocess.run([sys.executable, "-c", STOP_EARLY], cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=300, check=False)  # the timeout: against a hang
    assert done.returncode == 0 and done.stdout == "stopped\n", done.stderr[-2000:]


def test_reproduce_in_worker_processes_gives_the_in_process_results(tmp_path, monkeypatch):
    """The same results and saved models from worker processes as in-process, also under a TMPDIR long enough that
    a Unix socket in it (how tensors pickled as they are cross between processes) would not fit."""
    from safetensors.torch import load_file

    from gated_qwen.analysis.miniature.presets import PLANS, Family, Plan, customised
    from gated_qwen.analysis.miniature.runs import run_all

    long_tmp = tmp_path / ("t" * (100 - len(str(tmp_path))))
    long_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(long_tmp))
    preset = customised(PLANS["smoke"].main, steps=3, seeds=(2,), high_lr_variants=("g1-headwise",))
    plan = Plan((Family("main", preset, ("g1-headwise",)),))
    inline = list(run_all(plan, models_dir=tmp_path / "inline", jobs=1, progress=False).values())
    spawned = list(run_all(plan, models_dir=tmp_path / "spawned", jobs=2, progress=False).values())
    for model in ("g1-headwise-lr0.01-seed2", "g1-headwise-lr0.04-seed2"):
        a, b = (load_file(tmp_path / kind / model / "model.safetensors") for kind in ("inline", "spawned"))
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    for a, b in zip(inline, spawned):
        for name, maps in a["tensors"]["attention_maps"].items():
            torch.testing.assert_close(b["tensors"]["attention_maps"][name], maps, rtol=1e-4, atol=1e-6)
    assert [(r["variant"], r["learning_rate"], r["seed"]) for r in spawned] == [
        (r["variant"], r["learning_rate"], r["seed"]) for r in inline] == [("g1-headwise", 1e-2, 2),
                                                                          ("g1-headwise", 4e-2, 2)]
    for a, b in zip(inline, spawned):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert b["analysis"]["summary"]["gate_mean"] == pytest.approx(a["analysis"]["summary"]["gate_mean"], rel=1e-5)
