"""The benchmark scripts' smoke runs (``benchmarks/``): each runs a script on tiny sizes and checks
what it writes. Every test here is marked ``slow`` and ``e2e`` (several start a server or Ray)."""

from __future__ import annotations

import pathlib

import pytest

HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in pathlib.Path(item.path).parents:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.e2e)
