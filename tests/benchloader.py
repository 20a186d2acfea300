"""Loading a script of benchmarks/ as a module, for the benchmark smoke tests."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@contextmanager
def benchmark_module(filename: str) -> Iterator[ModuleType]:
    """``benchmarks/<filename>`` imported under a private name, removed again on exit."""
    name = "benchmarks_" + filename.removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, BENCH / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
