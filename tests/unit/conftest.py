"""The unit tier: no Ray, no server, no INET socket.

Every test here runs with connect and bind refused for INET sockets and ``ray.init`` refused,
so a test that needs either fails here, naming what it tried, and belongs in tests/e2e (where
its folder marks it). Unix socket pairs stay allowed: asyncio's event loop wakes itself with one.
"""

from __future__ import annotations

import socket
import sys

import pytest

#: The fixtures that start a server (tests/conftest.py).
SERVER_FIXTURES = frozenset({"server", "client"})


class UnitTierViolation(AssertionError):
    """A unit test tried what only an end-to-end test may do."""


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise UnitTierViolation(f"tests/unit must not {what}: move this test to tests/e2e")
    return refused


def _inet_only(name: str):
    original = getattr(socket.socket, name)

    def guarded(self, *args, **kwargs):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise UnitTierViolation(f"tests/unit must not {name} an INET socket: move this test to tests/e2e")
        return original(self, *args, **kwargs)
    return guarded


@pytest.fixture(autouse=True)
def _unit_tier_guard(request, monkeypatch):
    asked = SERVER_FIXTURES & set(request.fixturenames)
    if asked:
        raise UnitTierViolation(f"tests/unit must not start a server (fixtures {sorted(asked)}): move this test "
                                "to tests/e2e")
    for name in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, name, _inet_only(name))
    if "ray" in sys.modules:  # imported by an earlier test's module; importing it here would cost a second
        monkeypatch.setattr(sys.modules["ray"], "init", _refuse("start or join Ray (ray.init)"))
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # imported and started within the test itself
        ray.shutdown()
        raise UnitTierViolation("tests/unit must not start or join Ray: move this test to tests/e2e")
