"""The life of `reproduce`'s worker processes (standard library only, so that a spawned worker runs this before it
imports the model stack, which takes seconds).

A worker ignores Ctrl-C (the parent handles it and stops the workers), ends quietly when terminated (SIGTERM, how the
parent stops them), and ends within 0.2 s once its parent is gone (killed), from its first moment on; each time it
removes the scratch folders it registered in `SCRATCH` first. A worker writes nothing into the output: it hands its
results back to the parent, which alone writes.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

SCRATCH: set[str] = set()  # this process's scratch folders (the Trainer's), removed however the worker ends


def end_worker(*_) -> None:
    for folder in list(SCRATCH):
        shutil.rmtree(folder, ignore_errors=True)
    os._exit(1)


def worker_started(parent: int) -> None:
    """The pool's initializer: see the module docstring (`parent`: the parent's process id)."""
    from ..cli import quiet_import_noise  # the standard library only, too

    quiet_import_noise()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, end_worker)

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        end_worker()

    threading.Thread(target=watch_parent, name="gated-qwen-parent-watch", daemon=True).start()
