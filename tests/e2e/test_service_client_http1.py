"""The synchronous client's HTTP/1.1 connection (service.client.http1), against scripted loopback servers.

The client's calls against a live splitkey server are tested with the service
(test_service_attention, test_service_client_upload and the rest).
"""

import socket
import threading
import time
from http.client import BadStatusLine, IncompleteRead, RemoteDisconnected

import numpy as np
import pytest

from service.client import Client, SplitkeyError, UploadError
from service.client.http1 import ONE_WRITE_BYTES, Connection
from service.wire.rules import DEFAULT_LIMITS
from service.wire.safetensors import encode_safetensors


class Scripted:
    """A loopback server: connection i reads one request (head and Content-Length body) per answer in
    ``script[i]`` and writes that answer as it is, then closes."""

    def __init__(self, script: list[list[bytes]]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, args=(script,), daemon=True)
        self.thread.start()

    def _serve(self, script: list[list[bytes]]) -> None:
        for answers in script:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed by the test before the client came for every connection
                return
            with conn, conn.makefile("rb") as reader:
                for answer in answers:
                    head = b""
                    while not head.endswith(b"\r\n\r\n"):
                        line = reader.readline()
                        if not line:
                            return
                        head += line
                    length = [int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
                    self.requests.append(head + (reader.read(length[0]) if length else b""))
                    conn.sendall(answer)

    def fileno(self) -> int:
        return self.sock.fileno()

    def settimeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)
        assert not self.thread.is_alive()


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nserver-timing: total;dur=1.0\r\n\r\nok"


def test_answers_framed_by_length_by_chunks_and_by_the_end_of_the_connection():
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n"
    until_close = b"HTTP/1.0 404 Not Found\r\ncontent-type: text/plain\r\n\r\nno such thing"
    srv = Scripted([[OK, chunked, until_close]])
    conn = Connection("127.0.0.1", srv.port, timeout=10)
    try:
        first = conn.request("GET", "/a", {"Accept": "*/*"})
        assert (first.status, first.body, first.headers["server-timing"]) == (200, b"ok", "total;dur=1.0")
        assert conn.request("GET", "/b", {}).body == b"abcde"  # the same connection, kept
        last = conn.request("GET", "/c", {})
        assert (last.status, last.body) == (404, b"no such thing")
    finally:
        conn.close()
        srv.close()
    assert [r.split(b" ")[1] for r in srv.requests] == [b"/a", b"/b", b"/c"]
    assert b"Host: 127.0.0.1:%d\r\n" % srv.port in srv.requests[0]


def test_a_kept_connection_the_server_closed_is_replaced_and_the_request_sent_again():
    srv = Scripted([[OK], [OK]])  # the first connection closes after one answer
    conn = Connection("127.0.0.1", srv.port, timeout=10)
    try:
        assert conn.request("GET", "/1", {}).body == b"ok"
        srv.thread.join(0.2)
        assert conn.request("POST", "/2", {}, [b"xy"]).body == b"ok"
    finally:
        conn.close()
        srv.close()
    assert srv.requests[-1].endswith(b"Content-Length: 2\r\n\r\nxy")


def test_a_connection_closed_before_any_answer_raises_what_http_client_raises():
    srv = Scripted([[OK, b""]])  # one connection: answers one request, reads the next, closes without an answer
    conn = Connection("127.0.0.1", srv.port, timeout=10)
    try:
        conn.request("GET", "/1", {})
        with pytest.raises((RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
            conn.request("GET", "/2", {}, resend=False)  # not sent again when the caller says so
    finally:
        conn.close()
        srv.close()
    assert [r.split(b" ")[1] for r in srv.requests] == [b"/1", b"/2"]


def test_a_request_timeout_bounds_that_request_alone_and_the_next_has_the_connections_again():
    srv = Scripted([[OK, OK]])  # one connection, kept for both requests
    conn = Connection("127.0.0.1", srv.port, timeout=10)
    try:
        assert conn.request("GET", "/1", {}, timeout=0.5).body == b"ok"
        assert conn._sock is not None and 0 < conn._sock.gettimeout() <= 0.5  # what was left of it
        assert conn.request("GET", "/2", {}).body == b"ok"
        assert conn._sock is not None and conn._sock.gettimeout() == 10
    finally:
        conn.close()
        srv.close()
    silent = socket.create_server(("127.0.0.1", 0))  # its backlog takes the connection; nothing answers
    conn = Connection("127.0.0.1", silent.getsockname()[1], timeout=10)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            conn.request("GET", "/", {}, timeout=0.2)
        assert time.monotonic() - t0 < 2 and conn._sock is None
    finally:
        conn.close()
        silent.close()


@pytest.mark.parametrize("answer, error", [
    (b"SMTP 220 hello\r\n\r\n", BadStatusLine),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", IncompleteRead),
    (b"HTTP/1.1 200 OK\r\ncontent-length: ten\r\n\r\n", BadStatusLine),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", IncompleteRead),
])
def test_an_answer_that_is_not_http_raises_and_the_connection_is_dropped(answer, error):
    srv = Scripted([[answer]])
    conn = Connection("127.0.0.1", srv.port, timeout=10)
    try:
        with pytest.raises(error):
            conn.request("GET", "/", {})
        assert conn._sock is None
    finally:
        conn.close()
        srv.close()


def test_a_header_value_cannot_write_headers_of_its_own():
    conn = Connection("127.0.0.1", 9, timeout=1)
    with pytest.raises(ValueError, match="must not contain CR or LF"):
        conn.request("GET", "/", {"Authorization": "Bearer k\r\nX-Admin: 1"})


class Recording:
    """A connected socket that notes the size of every write."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.writes: list[int] = []

    def sendall(self, data) -> None:
        self.writes.append(memoryview(data).nbytes)
        self.sock.sendall(data)

    def fileno(self) -> int:
        return self.sock.fileno()

    def settimeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("n_k, joined", [(8, True), (ONE_WRITE_BYTES // 64, False)])
def test_a_small_request_leaves_in_one_write_and_a_large_one_as_its_buffers(n_k, joined):
    body = encode_safetensors({"q": np.arange(n_k * 16, dtype=np.float32).reshape(n_k, 1, 16)})
    srv = Scripted([[OK]])
    conn = Connection("127.0.0.1", srv.port, timeout=10)
    try:
        sock, _ = conn._open()
        conn._sock = recording = Recording(sock)
        assert conn.request("POST", "/v1/attention?contexts=a", {"Content-Type": "application/octet-stream"},
                            body).body == b"ok"
    finally:
        conn.close()
        srv.close()
    # Large: the head, then each buffer of the body (safetensors: its length, its header, the tensor).
    assert len(recording.writes) == (1 if joined else 1 + len(body))
    head, _, rest = srv.requests[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/attention?contexts=a HTTP/1.1\r\n")
    assert b"Content-Length: %d" % sum(memoryview(b).nbytes for b in body) in head
    assert rest == b"".join(bytes(b) for b in body)


def test_a_kept_connection_the_server_closed_while_idle_is_replaced_before_anything_is_sent():
    srv = Scripted([[OK], [OK]])  # the first connection closes after one answer
    conn = Connection("127.0.0.1", srv.port, timeout=10)
    try:
        conn.request("GET", "/1", {})
        srv.thread.join(0.2)
        # Seen closed before the request goes out: a new connection even where nothing may be resent.
        assert conn.request("POST", "/2", {}, [b"xy"], resend=False).body == b"ok"
    finally:
        conn.close()
        srv.close()
    assert [r.split(b" ")[1] for r in srv.requests] == [b"/1", b"/2"]


LIMITS = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def test_a_plain_append_whose_answer_is_lost_is_not_sent_again():
    srv = Scripted([[LIMITS, b""]])  # answers the limits, reads the append, closes without an answer
    c = Client(f"http://127.0.0.1:{srv.port}", timeout=10)
    try:
        with pytest.raises(UploadError) as err:
            c.append("ctx_a", np.ones((4, 1, 2), np.float32), np.ones((4, 1, 2), np.float32), retries=3)
    finally:
        c.close()
        srv.close()
    assert (err.value.committed, err.value.unknown) == (0, 4)  # read whole: it may be stored
    assert [r.split(b" ")[1] for r in srv.requests] == [b"/v1/limits", b"/v1/contexts/ctx_a/append"]


def _answer(status: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body


def test_a_server_without_the_limits_route_gets_the_default_limits_once():
    srv = Scripted([[_answer(b"404 Not Found", b'{"detail": "Not Found"}')]])  # a bare 404: no such route
    c = Client(f"http://127.0.0.1:{srv.port}", timeout=10)
    try:
        assert c.limits() == DEFAULT_LIMITS and c.limits() == DEFAULT_LIMITS  # the second from the first
    finally:
        c.close()
        srv.close()
    assert [r.split(b" ")[1] for r in srv.requests] == [b"/v1/limits"]


def test_a_404_with_an_error_code_from_the_limits_route_is_raised_not_taken_for_defaults():
    srv = Scripted([[_answer(b"404 Not Found", b'{"detail": "no", "code": "route_not_found"}')]])
    c = Client(f"http://127.0.0.1:{srv.port}", timeout=10)
    try:
        with pytest.raises(SplitkeyError) as err:
            c.limits()
    finally:
        c.close()
        srv.close()
    assert (err.value.status, err.value.code) == (404, "route_not_found")
