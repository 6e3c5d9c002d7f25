"""Setup of the Megatron-core checks (`make test-megatron`, in `.venv-megatron`: the project's lock and
megatron-core from requirements/megatron.lock). Megatron-core runs in processes of its own
(megatron_cpu.py: its CPU patches, gloo tensor parallelism).

`make test` never collects this folder (`norecursedirs` in pyproject.toml); every test here carries the `megatron`
marker (tests/conftest.py).
"""
