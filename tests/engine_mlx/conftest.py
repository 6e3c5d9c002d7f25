"""Setup of the MLX checks (`make test-mlx`, in `.venv-mlx`: the project's lock, mlx with its CPU backend and
mlx-lm from requirements/mlx.lock). mlx's Linux wheels run the code that runs on Apple silicon, on the CPU.

`make test` never collects this folder (`norecursedirs` in pyproject.toml); every test here carries the `mlx`
marker (tests/conftest.py).
"""

