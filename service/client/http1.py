"""A small blocking HTTP/1.1 connection: the transport of :class:`service.client.Client`.

The service's answers are plain HTTP/1.1 (uvicorn): a status line, headers, a body with
``Content-Length`` (or chunked). ``http.client`` reads them through the ``email`` package's
header parser and writes a request in several writes; on a decode query that is most of
what the client library costs (benchmarks/results/2026-12-03/NOTES.md, "The hot routes off FastAPI's
dispatch"). This connection writes a small request in one write (a large body as its
buffers, never joined), reads the status line and headers with one buffered reader kept
for the connection's life, and keeps the connection for the next request; a kept
connection the server has closed meanwhile (its keep-alive timeout) is seen closed before
it is reused and replaced, so nothing is sent on it.

Failures raise what ``http.client`` raises for them, so callers and the load generator
classify them as before: ``RemoteDisconnected`` when the server closed the connection
before answering, ``IncompleteRead`` for a body cut short, ``BadStatusLine`` or
``LineTooLong`` for an answer that is not HTTP/1.x, OS errors (``ConnectionRefusedError``,
``ConnectionResetError``, ``BrokenPipeError``, ``TimeoutError``) as they come.

A request's ``timeout`` bounds the whole request, not each socket operation: every read
from the socket waits only for what is left of it (:class:`_Reads`), so an answer that
trickles in byte by byte still ends with ``TimeoutError`` on time.
:func:`request_head` and :func:`parse_head` are shared with the asyncio transport
(``service.client.aio_http``).
"""

from __future__ import annotations

import io
import select
import socket
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.client import BadStatusLine, IncompleteRead, LineTooLong, RemoteDisconnected
from typing import BinaryIO, cast

#: Bytes the status line and headers of an answer may take.
MAX_HEAD_BYTES = 64 * 2**10
#: The reader's buffer: a decode query's whole answer (tens of KiB) in one read from the socket.
READ_BUFFER_BYTES = 2**18
#: A request up to this many bytes (headers and body) leaves in one write: on loopback every write
#: is a segment the server wakes up for. Larger bodies (uploads) go out as their buffers, not joined.
ONE_WRITE_BYTES = 2**20


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Mapping[str, str]  #: lower-case names
    body: bytes


def request_head(method: str, target: str, host: str, headers: Mapping[str, str], size: int) -> bytes:
    """The request line and headers (``Content-Length: size`` for a body, or any POST or PUT)."""
    head = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    for line in head:  # a CR or LF would end the line early and let a value write headers of its own
        if "\r" in line or "\n" in line:
            raise ValueError(f"request line and headers must not contain CR or LF, got {line[:80]!r}")
    if size or method in ("POST", "PUT"):
        head.append(f"Content-Length: {size}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")


def parse_head(lines: Sequence[str]) -> tuple[str, int, dict[str, str]]:
    """``(version, status, headers)`` of an answer's status line and header lines (names lower-cased)."""
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise BadStatusLine(f"the answer must start with an HTTP/1.x status line, got {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return parts[0], int(parts[1]), headers


def keeps_alive(version: str, headers: Mapping[str, str]) -> bool:
    return version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"


class Connection:
    """One keep-alive connection to ``host:port`` (TLS with ``https``), opened on the first request."""

    def __init__(self, host: str, port: int, *, https: bool = False, timeout: float | None = None) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._tls = ssl.create_default_context() if https else None
        self._sock: socket.socket | None = None
        self._raw: _Reads | None = None
        self._reader: BinaryIO | None = None

    def request(self, method: str, target: str, headers: Mapping[str, str], body: Sequence[bytes | memoryview] = (),
                *, resend: bool = True, sent: Callable[[], None] | None = None,
                timeout: float | None = None) -> Answer:
        """Send one request and read its whole answer.

        ``resend``: send once more on a fresh connection when a kept one turns out closed by the
        server (idle too long) before any byte of the answer; otherwise that raises.
        ``sent()`` is called once the body is out, before the answer is read.
        ``timeout``: the seconds this request may take, connecting, sending and reading its whole
        answer included (None: the connection's ``timeout``, which bounds each of them alone).
        """
        size = sum(memoryview(b).nbytes for b in body)
        head = request_head(method, target, f"{self.host}:{self.port}", headers, size)
        data: list[bytes | memoryview] = [head + b"".join(body)] if size <= ONE_WRITE_BYTES else [head, *body]
        for attempt in (0, 1):
            reused = self._sock is not None
            try:
                sock, reader = self._open(timeout)
                for buf in data:
                    sock.sendall(buf)
                if sent is not None:
                    sent()
                answer, keep = self._read(reader)
            except (RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt or not (resend and reused):
                    raise
                continue  # a kept connection the server closed while idle: once more on a new one
            except BaseException:
                self.close()  # in no known state: the next request starts a fresh one
                raise
            finally:
                if self._raw is not None:
                    self._raw.until = None
            if not keep:
                self.close()
            return answer
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = self._raw = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _open(self, timeout: float | None = None) -> tuple[socket.socket, BinaryIO]:
        """The connection (a new one if there is none, or the server closed it), ready for a request
        that may take ``timeout`` seconds in all (None: the connection's timeout for each operation)."""
        until = None if timeout is None else time.monotonic() + timeout
        wait = self.timeout if timeout is None else timeout
        if self._sock is not None and _closed_by_peer(self._sock):
            self.close()  # the server closed it while idle (keep-alive timeout): a new one, nothing resent
        if self._sock is None or self._raw is None or self._reader is None:
            sock = socket.create_connection((self.host, self.port), wait)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
            self._raw = _Reads(sock)
            self._sock, self._reader = sock, cast(BinaryIO, io.BufferedReader(self._raw, READ_BUFFER_BYTES))
        # sendall's timeout bounds its whole send (Python >= 3.5); the reads after it take what is left.
        self._sock.settimeout(wait if until is None else max(until - time.monotonic(), 1e-6))
        self._raw.base, self._raw.until = self.timeout, until
        return self._sock, self._reader

    @staticmethod
    def _read(reader: BinaryIO) -> tuple[Answer, bool]:
        """The answer on ``reader`` and whether the connection may be reused."""
        lines: list[str] = []
        taken = 0
        while True:
            line = reader.readline(MAX_HEAD_BYTES + 1)
            if not line:
                if not lines:
                    raise RemoteDisconnected("the server closed the connection without an answer")
                raise IncompleteRead(b"", None)
            taken += len(line)
            if taken > MAX_HEAD_BYTES:
                raise LineTooLong(f"the answer's status line and headers (over {MAX_HEAD_BYTES} bytes)")
            text = line.decode("latin-1").rstrip("\r\n")
            if not text and lines:
                break
            if text:
                lines.append(text)
        version, status, headers = parse_head(lines)
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = _chunked(reader)
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit():
                raise BadStatusLine(f"the answer's Content-Length must be a byte count, got {length[:40]!r}")
            body = _exactly(reader, int(length))
        else:
            return Answer(status, headers, reader.read()), False  # the body ends with the connection
        return Answer(status, headers, body), keeps_alive(version, headers)


class _Reads(io.RawIOBase):
    """The socket's bytes for the connection's buffered reader. Each read waits at most the
    connection's ``base`` timeout and, while a request with a timeout of its own is read
    (``until``: its ``time.monotonic()`` end), only the time left of it: a slow answer cannot
    outlast its request's timeout however its bytes are spread."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock
        self.base: float | None = None
        self.until: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self.until is not None:
            left = self.until - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            self._sock.settimeout(left if self.base is None else min(left, self.base))
        return self._sock.recv_into(buffer)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether a kept connection, between requests, can no longer carry one: readable now means the
    server closed it (or sent bytes nobody asked for, which leave it in no known state)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _exactly(reader: BinaryIO, n: int) -> bytes:
    data = reader.read(n)
    if len(data) < n:
        raise IncompleteRead(data, n - len(data))
    return data


def _chunked(reader: BinaryIO) -> bytes:
    parts: list[bytes] = []
    while True:
        line = reader.readline(MAX_HEAD_BYTES + 1)
        if not line.endswith(b"\n"):
            raise IncompleteRead(b"".join(parts), None)
        try:
            size = int(line.split(b";")[0].strip(), 16)
        except ValueError:
            raise IncompleteRead(b"".join(parts), None) from None  # not a chunk size: the body is broken
        if size == 0:
            while reader.readline(MAX_HEAD_BYTES + 1) not in (b"\r\n", b"\n", b""):
                pass  # trailers, unused
            return b"".join(parts)
        parts.append(_exactly(reader, size))
        _exactly(reader, 2)
