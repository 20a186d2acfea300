"""What an embedded `splitkey serve` exposes: every listening socket, of the service and of
the Ray it starts, is on loopback (docs/SECURITY.md)."""

from __future__ import annotations

import ipaddress

import psutil
import pytest



def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # ::ffff:127.0.0.1, a dual-stack socket bound to IPv4 loopback
    return addr.is_loopback


def listening(root_pid: int) -> list[tuple[int, str, str, int]]:
    """``(pid, process name, ip, port)`` of every listening TCP/UDP socket of ``root_pid`` and its descendants."""
    root = psutil.Process(root_pid)
    out = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN or (c.type == 2 and not c.raddr):  # TCP listen, or an unconnected UDP socket
                out.append((proc.pid, name, c.laddr.ip, c.laddr.port))
    return out


@pytest.mark.parametrize("is_local", [True, False])
def test_loopback_recognises_ipv4_ipv6_and_mapped_addresses(is_local):
    local, remote = ["127.0.0.1", "::1", "::ffff:127.0.0.1"], ["0.0.0.0", "::", "192.0.2.2", "::ffff:192.0.2.2"]
    assert all(is_loopback(ip) == is_local for ip in (local if is_local else remote))


