"""Slow clients cannot starve the service (docs/SECURITY.md): connections that trickle their
bodies hold no admission slot, real requests keep their latency, and the tricklers are cut
with 408 once the grace period is spent."""

from __future__ import annotations

import json
import math
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from server import Server, read_response

from service.client import Client

pytestmark = pytest.mark.ray

TRICKLERS = 72  # more than the 64 admission slots of the default --max-inflight
GRACE_S = 6.0
SAMPLES = 300
MIN_SAMPLES = 50  # the loaded median is over at least this many requests


class Tricklers:
    """``n`` connections that send a request head declaring a 1 MiB body, then one byte a second."""

    def __init__(self, port: int, n: int) -> None:
        self.socks = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/attention HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                      b"Content-Length: 1048576\r\n\r\n")
            self.socks.append(s)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()

    def _trickle(self) -> None:
        while not self.stop.wait(1.0):
            for s in self.socks:
                try:
                    s.sendall(b"\0")
                except OSError:  # the server closed it (408): what the test waits for
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()


def closed(s: socket.socket) -> bool:
    """Whether the server closed ``s``: end of stream, or a reset (the trickler wrote after the close)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def latencies(url: str, n: int, budget_s: float = math.inf) -> np.ndarray:
    """Seconds per small decode request over inline keys, ``n`` in a row on one connection, or as
    many as ``budget_s`` allows (at least ``MIN_SAMPLES``)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 64), dtype=np.float32)
    k = rng.standard_normal((256, 2, 64), dtype=np.float32)
    out: list[float] = []
    with Client(url) as c:
        c.attention(q, k, k)
        end = time.monotonic() + budget_s
        while len(out) < n and (len(out) < MIN_SAMPLES or time.monotonic() < end):
            t0 = time.perf_counter()
            c.attention(q, k, k)
            out.append(time.perf_counter() - t0)
    return np.array(out)


def test_trickling_connections_neither_hold_slots_nor_slow_real_requests_and_are_cut_with_408(tmp_path):
    srv = Server(tmp_path, args=("--workers", "1", "--body-grace", str(GRACE_S), "--min-body-rate", "1024")).start()
    tricklers = None
    try:
        idle = latencies(srv.url, SAMPLES)
        t0 = time.monotonic()
        tricklers = Tricklers(srv.port, TRICKLERS)
        # Bounded in time, not only in count: on a slow machine 300 requests outlast the grace.
        loaded = latencies(srv.url, SAMPLES, budget_s=GRACE_S / 2)
        assert time.monotonic() - t0 < GRACE_S, "the measurement must end while every trickler is still sending"
        # The median, not the p99: CI runs other test modules on the same two cores, and their bursts
        # put a few 4x outliers into any p99 of ~100 samples (seen: 83 ms loaded against 21 ms idle).
        # A trickler that held an admission slot or the event loop would show in every request: the
        # median moves, and the slowest request waits for a slot (seconds, up to the grace), which
        # the bound on the slowest catches.
        shown = f"with {TRICKLERS} tricklers: p50 {np.median(loaded) * 1e3:.2f} ms, max {loaded.max() * 1e3:.1f} ms; " \
                f"idle: p50 {np.median(idle) * 1e3:.2f} ms, max {idle.max() * 1e3:.1f} ms"
        assert np.median(loaded) <= 2 * np.median(idle), shown
        assert loaded.max() < 1.0, shown

        for s in tricklers.socks:  # each is answered 408 and closed once its grace is spent
            s.settimeout(GRACE_S + 10)
            head, _, body = read_response(s).partition("\r\n\r\n")
            assert head.startswith("HTTP/1.1 408"), head
            assert "connection: close" in head.lower()
            assert json.loads(body)["code"] == "request_timeout"
            assert closed(s)
        elapsed = time.monotonic() - t0
        assert GRACE_S <= elapsed < GRACE_S + 10

        metrics = httpx.get(srv.url + "/metrics").text
        assert f'splitkey_rejected_requests_total{{reason="slow_body"}} {TRICKLERS}.0' in metrics
        assert 'splitkey_requests_total{code="429"' not in metrics
        assert httpx.get(srv.url + "/healthz").status_code == 200
    finally:
        if tricklers is not None:
            tricklers.close()
        srv.stop()
