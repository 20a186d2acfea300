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


def benchmark_package_module(name: str) -> ModuleType:
    """``benchmarks.<name>``, a module the scripts import (not a script): imported as they import it,
    with the repository root on ``sys.path`` as the scripts put it there."""
    root = str(BENCH.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"benchmarks.{name}")
