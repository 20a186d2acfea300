"""A small HTTP/1.1 client on asyncio streams: the transport of ``service.client.AsyncClient``.

The service's answers are plain HTTP/1.1 (uvicorn): a status line, headers, a body with
``Content-Length`` (or chunked). A general-purpose client (httpx) spends about 3 ms of
Python per call on this machine (docs/BENCHMARKS.md, "Engine calls"); this one writes the
request in one buffer list and reads exactly the answer, keeping connections alive for
the next call. One pool per client, at most ``max_connections`` at once (callers wait for
a free one), each used by one request at a time.

An idle connection the server has closed (its keep-alive timeout, 30 s for ``splitkey
serve``) is seen closed before it is reused and dropped; one found closed only once the
request is out, before any byte of the answer arrived, is replaced and the request sent
once more, as the synchronous client does, when the caller allows it (``resend``: not
for a request that the server may have applied and must not apply twice), and the pool's
other idle connections, as old as it, are dropped with it. Any other failure is
:class:`TransportError`. A connection that comes back after :meth:`HttpPool.aclose` is
closed, not kept.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections.abc import Mapping, Sequence
from http.client import BadStatusLine

from service.client.http1 import MAX_HEAD_BYTES, Answer, keeps_alive, parse_head, request_head


class TransportError(ConnectionError):
    """The connection failed or the answer was not HTTP/1.1 as expected; no answer was read."""


class _Stale(Exception):
    """A reused connection was closed by the server before the answer began."""


class HttpPool:
    def __init__(self, host: str, port: int, *, https: bool = False, max_connections: int = 16) -> None:
        if type(max_connections) is not int or max_connections < 1:
            raise ValueError(f"max_connections must be an int >= 1, got {max_connections!r}")
        self.host, self.port = host, port
        self.ssl = ssl_module.create_default_context() if https else None
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def request(self, method: str, target: str, headers: Mapping[str, str],
                      body: Sequence[bytes | memoryview] = (), *, resend: bool = True) -> Answer:
        """Send one request and read its whole answer (``body`` as buffers, sent unjoined).

        ``resend``: send it once more on a new connection when a reused one turns out closed
        by the server after the request went out and before any byte of the answer (the
        server may have read it: False for a request that must not be applied twice).
        """
        if self._closed:
            raise TransportError("the client is closed")
        size = sum(memoryview(b).nbytes for b in body)
        data = [request_head(method, target, f"{self.host}:{self.port}", headers, size), *body]
        async with self._slots:
            for attempt in (0, 1):
                kept = self._take_idle()
                reused = kept is not None
                reader, writer = kept if kept is not None else await self._connect()
                try:
                    answer, keep = await self._exchange(reader, writer, data)
                except _Stale:
                    writer.close()
                    self._drop_idle()  # as old as this one: the server has likely closed them too
                    if attempt == 0 and reused and resend:
                        continue  # a kept connection the server closed: once more on a new one
                    raise TransportError("the server closed the connection before answering") from None
                except BaseException:
                    writer.close()
                    raise
                if keep and not self._closed:
                    self._idle.append((reader, writer))
                else:
                    writer.close()  # not reusable, or the client was closed while this request ran
                return answer
        raise AssertionError("unreachable")  # pragma: no cover

    def _take_idle(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The most recently used idle connection still open (None if none); closed ones are dropped."""
        while self._idle:
            reader, writer = self._idle.pop()
            if reader.at_eof() or reader.exception() is not None or writer.is_closing():
                writer.close()  # the server closed it while it was idle
                continue
            return reader, writer
        return None

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=MAX_HEAD_BYTES)
        except OSError as exc:
            raise TransportError(f"could not connect to {self.host}:{self.port}: {exc}") from exc

    @staticmethod
    async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        data: list[bytes | memoryview]) -> tuple[Answer, bool]:
        """Write the request, read the answer; ``(answer, whether the connection may be reused)``."""
        begun = False  # whether any byte of the answer arrived
        try:
            writer.writelines(data)
            await writer.drain()
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    raise _Stale() from None
                raise TransportError("the answer ended inside its headers") from None
            begun = True
            try:
                version, status, headers = parse_head(head.decode("latin-1").split("\r\n"))
            except BadStatusLine as exc:
                raise TransportError(str(exc)) from None
            if headers.get("transfer-encoding", "").lower() == "chunked":
                body = await _chunked(reader)
            elif "content-length" in headers:
                body = await reader.readexactly(int(headers["content-length"]))
            else:
                body = await reader.read()
                return Answer(status, headers, body), False
            return Answer(status, headers, body), keeps_alive(version, headers)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            if isinstance(exc, TransportError):
                raise
            if not begun and isinstance(exc, (ConnectionResetError, BrokenPipeError)):
                raise _Stale() from None
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()
        for _, writer in idle:
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # the empty trailer
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
