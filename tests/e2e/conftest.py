"""The end-to-end tier: real servers, a real Ray, real clients. Every test here is marked ``e2e``
(select with ``-m e2e``, leave out with ``-m "not e2e"``)."""

from __future__ import annotations

import pathlib

import pytest

HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in pathlib.Path(item.path).parents:
            item.add_marker(pytest.mark.e2e)
