"""Test-only faults: a proxy in front of a real service that changes its attention answers, or
drops answers on the way back.

Never part of the shipped server: the load test and the Locust file must notice
that answers are wrong, and the only honest way to show it is a server that lies;
a client must tell a request the server did but whose answer it never got, and the
honest way to show that is a connection that loses it.
"""

from __future__ import annotations

import http.client
import http.server
import json
import struct
import threading
import urllib.parse
from typing import Self

import numpy as np

from service.wire.safetensors import decode_safetensors, encode_safetensors


class WrongAnswers(http.server.ThreadingHTTPServer):
    """A proxy in front of the service that changes its attention answers: a test-only fault."""

    def __init__(self, target_port: int, change) -> None:
        self.target_port, self.change = target_port, change
        super().__init__(("127.0.0.1", 0), Forward)
        self.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> Self:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class LostAnswers(WrongAnswers):
    """A proxy that forwards every request to the service but drops the answers
    ``lose(method, path, status)`` picks (``status``: the service's answer): the service did the
    work, and the client sees its connection close with no answer. ``lose.hold(method, path)``,
    where ``lose`` has it, is called with each request's body read, before it goes on."""

    def __init__(self, target_port: int, lose) -> None:
        super().__init__(target_port, lambda out, lse: (out, lse))
        self.lose = lose


class RefuseFirst(WrongAnswers):
    """A proxy that answers the first ``times`` requests of ``method path`` itself with ``status`` (and
    ``Retry-After: 1`` for 429), as a rate-limiting or restarting proxy in front of the service would,
    and forwards everything else; ``refused`` counts the answers it gave."""

    def __init__(self, target_port: int, method: str, path: str, status: int, times: int) -> None:
        super().__init__(target_port, lambda out, lse: (out, lse))
        self.match, self.status, self.times, self.refused = (method, path), status, times, 0

    def refuse(self, method: str, path: str) -> int | None:
        if (method, path) != self.match or self.refused >= self.times:
            return None
        self.refused += 1
        return self.status


class LoseAppendAfter:
    """A ``lose`` for :class:`LostAnswers`: drops the answer to the first ``POST .../append`` whose
    ``after`` is ``after`` (chosen by its query, not by when it arrives: with several chunks in
    flight another one may come first), and keeps each append's ``(after, status)`` in ``appends``
    so that a test can count what the client sent and what the service answered.

    With ``first``, the append of ``after`` goes on to the service only once an append of
    ``first`` was answered: the order in which a pipelined upload's chunks reach the server is
    the test's to choose.
    """

    def __init__(self, after: int, first: int | None = None) -> None:
        self.after, self.first = after, first
        self.appends: list[tuple[int, int]] = []
        self.lost = False
        self.first_answered = threading.Event()

    @staticmethod
    def append_after(method: str, path: str) -> int | None:
        """The ``after`` of an append request, None for any other request."""
        url = urllib.parse.urlsplit(path)
        if method != "POST" or not url.path.endswith("/append"):
            return None
        return int(urllib.parse.parse_qs(url.query)["after"][0])

    def hold(self, method: str, path: str) -> None:
        if self.first is not None and not self.lost and self.append_after(method, path) == self.after:
            if not self.first_answered.wait(30):
                raise TimeoutError(f"no append after={self.first} came within 30 s")

    def __call__(self, method: str, path: str, status: int) -> bool:
        after = self.append_after(method, path)
        if after is None:
            return False
        self.appends.append((after, status))
        if after == self.first:
            self.first_answered.set()
        if after == self.after and not self.lost:
            self.lost = True
            return True
        return False


class Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        refuse = getattr(self.server, "refuse", None)
        status = refuse(self.command, self.path) if refuse is not None else None
        if status is not None:
            data = json.dumps({"detail": "refused by the test's proxy", "code": "test_proxy"}).encode()
            self.send_response(status)
            if status == 429:
                self.send_header("Retry-After", "1")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        lose = getattr(self.server, "lose", None)
        if hasattr(lose, "hold"):
            lose.hold(self.command, self.path)
        conn = http.client.HTTPConnection("127.0.0.1", self.server.target_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
        conn.request(self.command, self.path, body=body or None, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        if lose is not None and lose(self.command, self.path, resp.status):
            self.close_connection = True  # the answer never leaves: the client's connection closes
            conn.close()
            return
        if self.path.startswith("/v1/attention") and resp.status == 200:
            t = decode_safetensors(data, {"out", "lse"})
            out, lse = self.server.change(np.array(t["out"]), np.array(t["lse"]))
            data = b"".join(bytes(b) for b in encode_safetensors({"out": out, "lse": lse}))
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

    do_GET = do_POST = do_DELETE = forward


def flip_data_byte(path):
    """Flip one bit of the k tensor's bytes, past the header: a well-formed file with one wrong value."""
    b = bytearray(path.read_bytes())
    n = struct.unpack("<Q", b[:8])[0]
    b[8 + n + json.loads(b[8:8 + n])["k"]["data_offsets"][0] + 2] ^= 0x40
    path.write_bytes(bytes(b))
