"""Run by Python at the start of every process the test suite starts (tests/conftest.py puts this folder first on
PYTHONPATH): guards the process like the test processes (cache_guard.py), then runs the `sitecustomize` this file
stands in front of, if the interpreter has one."""

import importlib.machinery
import importlib.util
import os
import sys

import cache_guard

cache_guard.install_from_environment()

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
