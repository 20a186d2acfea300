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
MIB = 2**20


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


def test_bodies_held_at_once_stay_within_the_inflight_budget_and_the_rest_get_429(tmp_path):
    budget = 64 * MIB
    srv = Server(tmp_path, args=("--workers", "1", "--max-body-bytes", str(budget), "--max-inflight-bytes",
                                 str(budget))).start()
    socks = []
    try:
        q = np.ones((1, 2, 8), np.float32)
        with Client(srv.url) as c:
            c.attention(q, q, q)
        before = rss_bytes(srv.proc.pid)
        for _ in range(16):  # each declares 32 MiB and sends 6 MiB: 96 MiB sent in all, over the budget
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.settimeout(30)
            s.sendall(b"POST /v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                      b"Content-Length: %d\r\n\r\n" % (32 * MIB))
            try:
                s.sendall(b"\0" * (6 * MIB))
            except OSError:  # refused and closed before all of it was taken
                pass
            socks.append(s)
        time.sleep(1.0)
        held = gauge(srv, "splitkey_inflight_body_bytes")
        grown = rss_bytes(srv.proc.pid) - before
        assert held <= budget and grown < budget + 96 * MIB, f"{held} bytes held, RSS grew {grown / MIB:.0f} MiB"
        with Client(srv.url) as c:  # the budget's free part still takes a small request
            out, _ = c.attention(q, q, q)
            assert out.shape == (1, 2, 8)
        refused = 0
        for s in socks:
            s.setblocking(False)
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue  # still being read: holds part of the budget
            except ConnectionResetError:
                data = b""
            if data.startswith(b"HTTP/1.1 429"):
                assert b'"code":"overloaded"' in data and b"retry-after" in data.lower()
                refused += 1
        assert refused >= 6, f"{refused} of 16 refused"  # at most 10 x 6 MiB fit in 64 MiB
        assert httpx.get(srv.url + "/healthz").status_code == 200
    finally:
        for s in socks:
            s.close()
        srv.stop()


def gauge(srv: Server, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))
