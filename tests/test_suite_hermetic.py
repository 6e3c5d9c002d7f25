"""The suite's hermeticity check judges the suite alone (tests/conftest.py, tests/hermetic/cache_guard.py).

Each check runs a small suite of its own with this conftest, in a fresh pytest process whose user has a home of the
test's making: another program writing to that user's Hugging Face cache all through the run leaves it green; a test
that writes there by the literal path, itself or through a process it starts, turns it red, is named with what it
wrote, and the write does not happen."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard reads /proc (Linux)")


def suite(tmp_path: Path, tests: dict[str, str]) -> Path:
    """A folder with this suite's conftest and cache guard and the given test files."""
    folder = tmp_path / "suite"
    folder.mkdir()
    shutil.copy(TESTS / "conftest.py", folder)
    shutil.copytree(TESTS / "hermetic", folder / "hermetic", ignore=shutil.ignore_patterns("__pycache__"))
    for name, text in tests.items():
        (folder / name).write_text(textwrap.dedent(text))
    return folder


def run_suite(folder: Path, home: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest on `folder` as a user whose home is `home`, with none of this session's settings."""
    ours = ("HOME", "XDG_CACHE_HOME", "PYTHONPATH", "GATED_QWEN_TESTS_GUARD", "GATED_QWEN_KERNEL_CACHE",
            "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID", "PYTEST_XDIST_WORKER_COUNT")
    env = {k: v for k, v in os.environ.items() if k not in ours and not k.startswith(("HF_", "TRANSFORMERS_"))}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(folder)],
                          cwd=folder, env={**env, "HOME": str(home)}, capture_output=True, text=True, timeout=600)


def test_another_program_writing_to_the_users_cache_during_the_run_leaves_it_green(tmp_path):
    home = tmp_path / "user"
    cache = home / ".cache" / "huggingface" / "modules" / "transformers_modules"
    cache.mkdir(parents=True)
    stop = tmp_path / "stop"
    # Another program of the user's: loads remote code (writes its modules cache) over and over, until told to stop.
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, time
        i = 0
        while not os.path.exists({str(stop)!r}):
            with open(os.path.join({str(cache)!r}, f"module_{{i}}.py"), "w") as f:
                f.write("x = 1")
            i += 1
            time.sleep(0.02)
        """)])
    try:
        folder = suite(tmp_path, {"test_overlap.py": f"""
            import os, time
            from pathlib import Path

            def test_the_user_writes_while_this_test_runs():
                assert Path.home() != Path({str(home)!r}) and os.environ["HF_HOME"] != {str(home / '.cache')!r}
                seen = len(os.listdir({str(cache)!r}))
                deadline = time.monotonic() + 300  # a safety net: the writer writes every 20 ms
                while len(os.listdir({str(cache)!r})) < seen + 3 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert len(os.listdir({str(cache)!r})) >= seen + 3
            """})
        result = run_suite(folder, home)
    finally:
        stop.touch()
        writer.wait(timeout=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout and "user's cache" not in result.stdout


def test_a_test_writing_to_the_users_cache_by_its_literal_path_turns_the_run_red_naming_it(tmp_path):
    home = tmp_path / "user"
    (home / ".cache" / "huggingface" / "hub").mkdir(parents=True)
    token, blob = home / ".cache" / "huggingface" / "token", home / ".cache" / "huggingface" / "hub" / "blob"
    folder = suite(tmp_path, {
        "test_itself.py": f"""
            def test_writes_the_token_and_ignores_the_error():
                try:
                    open({str(token)!r}, "w").write("hf_x")
                except OSError:
                    pass  # careless code swallows the refusal: the run must still fail
            """,
        "test_through_a_process.py": f"""
            import subprocess, sys

            def test_starts_a_process_that_writes_a_blob():
                subprocess.run([sys.executable, "-c", "open({str(blob)!r}, 'w').write('x')"], check=False)

            def test_writes_nothing():
                pass
            """})
    result = run_suite(folder, home, "-n", "2", "--dist", "loadfile")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "3 passed" in result.stdout  # every test passed: only the guard fails the run
    report = result.stdout[result.stdout.index("the test suite tried to write to the user's cache"):]
    assert f"test_itself.py::test_writes_the_token_and_ignores_the_error (call): open {token}" in report
    assert f"test_through_a_process.py::test_starts_a_process_that_writes_a_blob (call): open {blob}" in report
    assert "test_writes_nothing" not in report
    assert not token.exists() and not blob.exists()  # refused, not only reported
