"""The life of `reproduce`'s worker processes (standard library only, so that a spawned worker runs this before it
imports the model stack, which takes seconds).

A worker ignores Ctrl-C (the parent handles it and stops the workers), ends quietly when terminated (SIGTERM, how the
parent stops them), and ends within 0.2 s once its parent is gone (killed), from its first moment on; each time it
removes the scratch folders it registered in `SCRATCH` first; once its parent is gone it prints nothing (a result
it was handing back meets a closed pipe, and the terminal is the user's again). It turns off the import warnings the
command turns off (`import_noise`). A worker writes nothing into the output: it hands its results back to the
parent, which alone writes.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading

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
    from ..import_noise import quiet_import_noise

    quiet_import_noise()
    sys.stderr = _WhileParentLives(sys.stderr, parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM is blocked in this thread and so in every thread started after it, and taken by the watcher below: a
    # Python handler runs only in the main thread, between bytecodes, and the signal may land on any thread, so a
    # worker whose main thread waits in C (on the task queue's lock, which a stopping pool holds) would never end.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def watch() -> None:
        while os.getppid() == parent and signal.sigtimedwait({signal.SIGTERM}, 0.2) is None:
            pass
        end_worker()

    threading.Thread(target=watch, name="gated-qwen-worker-watch", daemon=True).start()
