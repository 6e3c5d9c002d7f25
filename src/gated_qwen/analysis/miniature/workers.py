"""`reproduce`'s worker processes: the pool that runs them (`run_in_workers`) and their life.

A worker ignores Ctrl-C (the parent handles it and stops the workers), ends quietly when terminated (SIGTERM, how the
parent stops them), and ends within 0.2 s once its parent is gone (killed), from its first moment on; each time it
removes the scratch folders it registered in `SCRATCH` first; once its parent is gone it prints nothing (a result
it was handing back meets a closed pipe, and the terminal is the user's again). It turns off the import warnings the
command turns off (`import_noise`). A worker writes nothing into the output: it hands its results back to the
parent, which alone writes.

A lost worker ends the run: a worker that dies while the pool runs (killed by the kernel's out-of-memory killer,
SIGKILL) breaks the pool (`concurrent.futures`' `BrokenProcessPool`, where `multiprocessing.Pool` would start a new
worker and wait for the lost result forever), and `run_in_workers` stops the other workers, removes the scratch the
lost one left and raises `WorkerLost`: one line saying what happened.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

from ...files import clean_stale_scratch
from ...import_noise import quiet_import_noise

SCRATCH: set[str] = set()  # this process's scratch folders (the Trainer's), removed however the worker ends


def end_worker() -> None:
    for folder in list(SCRATCH):
        shutil.rmtree(folder, ignore_errors=True)
    os._exit(1)


class _WhileParentLives:
    """A worker's stderr: written while the parent lives, dropped once it is gone."""

    def __init__(self, stream, parent: int):
        self.stream, self.parent = stream, parent

    def write(self, text: str) -> int:
        return self.stream.write(text) if os.getppid() == self.parent else len(text)

    def flush(self) -> None:
        if os.getppid() == self.parent:
            self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def worker_started(parent: int) -> None:
    """The pool's initializer: see the module docstring (`parent`: the parent's process id)."""
    quiet_import_noise()
    sys.stderr = _WhileParentLives(sys.stderr, parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM may land on any thread, the native ones the imports started (OpenBLAS's) included, and a Python handler
    # runs only in the main thread, between bytecodes, which may be waiting in C (on the task queue's lock, which a
    # stopping pool holds). So the handler does nothing but have Python's C-level handler, whichever thread runs it,
    # write the signal to a wakeup pipe, and the watcher below ends the worker when it reads it.
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, lambda number, frame: None)

    def watch() -> None:
        while os.getppid() == parent:
            if select.select([wake_read], [], [], 0.2)[0] and signal.SIGTERM in os.read(wake_read, 64):
                break
        end_worker()

    threading.Thread(target=watch, name="gated-qwen-worker-watch", daemon=True).start()


class WorkerLost(ChildProcessError):
    """A worker process ended abruptly while the pool ran (killed): the run cannot finish."""


def run_in_workers(task: Callable, items: Iterable, jobs: int) -> Iterator:
    """Yields `task(item)` for each of `items`, in the order they finish, computed in `jobs` spawned worker processes
    (see the module docstring; `task` and the items must pickle). Close the generator (`contextlib.closing`) to stop
    the workers at once when the caller stops early; on an error in a task, Ctrl-C or a lost worker (`WorkerLost`)
    they are stopped before the error propagates."""
    context = multiprocessing.get_context("spawn")  # fork after torch has started threads is unsafe
    executor = ProcessPoolExecutor(jobs, mp_context=context, initializer=worker_started, initargs=(os.getpid(),))
    finished = False
    workers: dict = {}
    try:
        # The workers start (when the tasks are submitted) with Ctrl-C ignored, inherited, so one pressed while they
        # import is the parent's alone.
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
        try:
            futures = [executor.submit(task, item) for item in items]
            workers.update(executor._processes)  # to say how a lost one ended (the pool keeps them private)
        finally:
            if main_thread:
                signal.signal(signal.SIGINT, previous)
        try:
            for future in as_completed(futures):
                yield future.result()
        except BrokenProcessPool:
            _stop(executor, now=True)
            clean_stale_scratch()  # the lost worker's, whose lock ended with it
            raise WorkerLost(_how_it_was_lost(workers.values(), jobs)) from None
        finished = True
    finally:
        _stop(executor, now=not finished)


def _stop(executor, now: bool) -> None:
    """Ends the workers: `now`, whatever they are doing (SIGTERM: each removes its scratch and ends), else once idle;
    returns when they have ended.

    A worker ended while it handed back a result (a trained model, larger than a pipe holds) leaves the pool's
    reader thread waiting for the rest of it, forever: the pipe's last open write end is this process's own copy, so
    no end of file comes, and `shutdown` waits for that thread (a Ctrl-C'd command then never ended). Once the
    workers have ended, that copy is closed: the read ends, the pool counts itself broken, and it shuts down."""
    if now:
        processes = list((getattr(executor, "_processes", None) or {}).values())
        terminate = getattr(executor, "terminate_workers", None)  # Python 3.14; before, the pool's own table
        if terminate is not None:
            terminate()
        for process in processes:
            process.terminate()
        for process in processes:
            process.join()
        results = getattr(executor, "_result_queue", None)
        if results is not None:
            results._writer.close()
    executor.shutdown(wait=True, cancel_futures=True)


def _how_it_was_lost(workers, jobs: int) -> str:
    """The one line of `WorkerLost`: which signal ended the lost worker, and what to do."""
    codes = [process.exitcode for process in workers]
    signals = [-code for code in codes if code is not None and code < 0 and -code != signal.SIGTERM]
    if signals and signals[0] == signal.SIGKILL:
        how = ("was killed by SIGKILL while training (what the kernel's out-of-memory killer sends: likely out of "
               "memory)")
    elif signals:
        how = f"was killed by {signal.Signals(signals[0]).name} while training"
    else:
        how = "ended abruptly while training"
    fewer = f"--jobs {jobs - 1}" if jobs > 2 else "--jobs 1"
    return (f"a worker process {how}; the other workers were stopped and nothing was written. Train fewer runs at "
            f"once ({fewer}) or free some memory, and run it again.")
