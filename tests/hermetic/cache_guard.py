"""Keeps the test suite's hands off the user's caches, in every Python process the suite starts.

The suite runs with HOME, XDG_CACHE_HOME and the Hugging Face cache variables pointing into a folder made for the
session (tests/conftest.py), which keeps code that finds its caches the usual way out of the user's. What remains is
code that names a user's cache by its literal path: an audit hook (PEP 578) in each test process, and through
`sitecustomize.py` beside this file in each Python process they start, refuses any write under the user's cache
folders (as they were before the session moved them) and records it, with the test that was running, in the session
folder. The session then fails, naming each. What another program writes there is none of the suite's doing and is
never looked at.

Standard library only: it runs at the start of every Python process of the session.
"""

import errno
import json
import os
import threading

VARIABLE = "GATED_QWEN_TESTS_GUARD"  # JSON: {"session": the session's folder, "guarded": [the user's cache folders]}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Audit event -> the positions of its arguments that are written to, and of its dir_fd (None: no dir_fd argument).
_WRITES = {"os.mkdir": ((0,), 2), "os.rename": ((0, 1), 2), "os.remove": ((0,), 1), "os.rmdir": ((0,), 1),
           "os.symlink": ((1,), 2), "os.link": ((1,), 3), "os.truncate": ((0,), None), "os.chmod": ((0,), 2),
           "os.chown": ((0,), 3), "os.utime": ((0,), 3), "shutil.rmtree": ((0,), 1), "shutil.copyfile": ((1,), None),
           "shutil.copytree": ((1,), None), "shutil.move": ((0, 1), None)}
_state = {}
_inside = threading.local()


def guarded_folders(environ) -> list[str]:
    """The user's cache folders as `environ` (the environment before the session moved them) names them."""
    home = environ.get("HOME") or os.path.expanduser("~")
    folders = [environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), os.path.join(home, ".triton")]
    folders += [environ[name] for name in ("HF_HOME", "HF_HUB_CACHE", "HF_XET_CACHE", "HF_ASSETS_CACHE",
                                           "HF_MODULES_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE")
                if environ.get(name)]
    return sorted({os.path.realpath(folder) for folder in folders})


def install(session: str, guarded: list[str]) -> None:
    """Guards this process (once) and, through the environment, every process it starts."""
    os.environ[VARIABLE] = json.dumps({"session": session, "guarded": guarded})
    if _state:
        return
    _state.update(session=os.path.realpath(session), guarded=tuple(guarded),
                  ledger=os.path.join(session, "writes-to-user-caches", f"{os.getpid()}.jsonl"))
    import sys

    sys.addaudithook(_hook)


def install_from_environment() -> None:
    """What `sitecustomize.py` runs: the guard of the session this process was started in, if any."""
    value = os.environ.get(VARIABLE)
    if value:
        settings = json.loads(value)
        install(settings["session"], settings["guarded"])


def recorded_writes(session: str) -> list[dict]:
    """Every write the guard refused in the session's processes: {"test", "event", "path"}."""
    folder = os.path.join(session, "writes-to-user-caches")
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return [json.loads(line) for name in names for line in open(os.path.join(folder, name)).read().splitlines()]


def _absolute(path, dir_fd) -> str | None:
    if isinstance(path, int):
        return None  # a file descriptor: opening it was checked
    path = os.fsdecode(path)
    if dir_fd is not None and not os.path.isabs(path):
        try:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        except OSError:
            return None
    path = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def _guarded(path: str) -> bool:
    if path == _state["session"] or path.startswith(_state["session"] + os.sep):
        return False
    return any(path == folder or path.startswith(folder + os.sep) for folder in _state["guarded"])


def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        if not (flags & _WRITE_FLAGS if isinstance(flags, int) else set(mode or "") & set("wax+")):
            return
        targets, dir_fd = (path,), None
    elif event in _WRITES:
        positions, fd_at = _WRITES[event]
        targets = [args[i] for i in positions]
        dir_fd = args[fd_at] if fd_at is not None else None
    else:
        return
    if getattr(_inside, "active", False):
        return
    _inside.active = True
    try:
        hits = [p for p in (_absolute(t, dir_fd) for t in targets if t is not None) if p and _guarded(p)]
        if not hits:
            return
        test = os.environ.get("PYTEST_CURRENT_TEST", "no test running (collection or session set-up)")
        os.makedirs(os.path.dirname(_state["ledger"]), exist_ok=True)
        with open(_state["ledger"], "a") as ledger:
            for hit in hits:
                ledger.write(json.dumps({"test": test, "event": event, "path": hit}) + "\n")
    finally:
        _inside.active = False
    raise PermissionError(errno.EACCES, "the test suite may not write to the user's cache", hits[0])
