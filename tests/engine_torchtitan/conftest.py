"""Setup of the torchtitan checks (`make test-torchtitan`, in `.venv-torchtitan`: the project's lock, then torchtitan,
flash-linear-attention and what its qwen3_5 model imports from requirements/torchtitan.lock without dependency
resolution).

`make test` never collects this folder (`norecursedirs` in pyproject.toml); every test here carries the `torchtitan`
marker (tests/conftest.py).
"""
