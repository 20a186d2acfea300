"""What an embedded `splitkey serve` exposes: every listening socket, of the service and of
the Ray it starts, is on loopback (docs/SECURITY.md)."""

from __future__ import annotations

import pytest
from server import is_loopback


@pytest.mark.parametrize("is_local", [True, False])
def test_loopback_recognises_ipv4_ipv6_and_mapped_addresses(is_local):
    local, remote = ["127.0.0.1", "::1", "::ffff:127.0.0.1"], ["0.0.0.0", "::", "192.0.2.2", "::ffff:192.0.2.2"]
    assert all(is_loopback(ip) == is_local for ip in (local if is_local else remote))


