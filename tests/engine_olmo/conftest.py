"""Setup of the OLMo-core checks (`make test-olmo`, in `.venv-olmo`: the project's lock, then OLMo-core and what it
needs from requirements/olmo.lock without dependency resolution).

`make test` never collects this folder (`norecursedirs` in pyproject.toml); every test here carries the `olmo`
marker (tests/conftest.py).
"""
