"""Memory is spent on the bytes a client sends, not on the bytes it declares (docs/SECURITY.md)."""

import socket
import time

import httpx
import numpy as np
import pytest
from server import Server

from service.client import Client

pytestmark = pytest.mark.ray

GIB = 2**30


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_connections_declaring_huge_bodies_cost_what_they_send_and_real_requests_go_on(tmp_path):
    srv = Server(tmp_path, args=("--workers", "1")).start()  # the default 2 GiB body limit
    socks = []
    try:
        with Client(srv.url) as c:  # warm: the first request's imports and allocations are not the attack's
            q = np.ones((1, 2, 8), np.float32)
            c.attention(q, q, q)
        before = rss_bytes(srv.proc.pid)
        for _ in range(16):  # 16 GiB declared, 16 x 64 KiB sent
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"POST /v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                      b"Content-Length: %d\r\n\r\n" % GIB + b"\0" * 65536)
            socks.append(s)
        time.sleep(1.0)
        grown = rss_bytes(srv.proc.pid) - before
        assert grown < 256 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB for 16 GiB declared"
        with Client(srv.url) as c:
            out, _ = c.attention(q, q, q)
            assert out.shape == (1, 2, 8)
        assert httpx.get(srv.url + "/healthz").status_code == 200
    finally:
        for s in socks:
            s.close()
        srv.stop()
