"""Setup of the MLX checks (`make test-mlx`, in `.venv-mlx`: the project's lock, mlx with its CPU backend and
mlx-lm from requirements/mlx.lock). mlx's Linux wheels run the code that runs on Apple silicon, on the CPU.

`make test` never collects this folder (`norecursedirs` in pyproject.toml); every test here carries the `mlx`
marker.
"""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.mlx)
