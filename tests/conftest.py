"""Shared fixtures. Test modules import helpers from this folder (``reference``)."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's name: reproducible, different per test."""
    seed = abs(hash(request.node.nodeid)) % (2**32)
    return np.random.default_rng(seed)
