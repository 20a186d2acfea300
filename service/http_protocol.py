"""uvicorn's HTTP/1.1 protocol with two changes, for requests that never reach the app (so their
answers are written here, as JSON with a request id like every other error, API.md section 7):

* a request it cannot parse (a bad Content-Length, two framings, a broken chunk) is answered
  400 ``invalid_body`` instead of uvicorn's plain-text "Invalid HTTP request received.";
* a request head (request line and headers) over :data:`MAX_HEAD_BYTES` is answered 431
  ``header_too_large`` and the connection closed. uvicorn's fast parser (httptools) has no
  bound of its own: a client could send one header of hundreds of MiB, which the parser
  buffers whole while the event loop spends minutes on it (docs/SECURITY.md).

* a request line and headers that do not arrive within :attr:`JsonErrorsProtocol.head_timeout_s`
  seconds (from the connection's opening, or from a later head's first byte) are answered 408
  ``request_timeout`` and the connection closed: neither a connection that sends nothing nor
  one that trickles its head holds a socket forever (uvicorn bounds only the idle time between
  requests, by its keep-alive timeout).

And one for closing. Every close the server starts (after an answer with ``Connection: close``,
an idle keep-alive connection at the keep-alive timeout or at shutdown, a refusal above) is a
lingering close (:class:`LingeringTransport`): the answer is sent, then a FIN, and what the
client still sends is read and dropped until it closes its side or :data:`LINGER_S` pass. A
plain close with unread bytes (a body the drain's 503 did not read, a request that crossed an
idle connection's close) makes the kernel send a reset, which can destroy the answer before the
client reads it; after a FIN, a client whose request crossed the close reads a clean end with no
answer, and that request never reached the app (docs/SERVICE.md, "Stopping it").

And one for counting. Each connection is counted in :class:`service.core.connections.Connections`
(``configured``) as it opens, idle until a request begins and again once answered (it may then be
closed to make room for a new one); one that finds no room is answered 503
``too_many_connections`` at once and closed.

And one for answers. While an answer waits unsent over the transport's high-water mark (the
client reads it slower than it is written, or not at all), its bytes count against the
in-flight byte budget (``service.core.admission``), and every ``answer_check_s`` seconds at least
``answer_min_rate`` bytes/s of it must have left, else the connection is aborted, which frees
them. uvicorn kept such bytes, and ``close`` waits for them to be read: a client that never
read pinned its answer, up to GiBs, outside every limit, for as long as it kept the socket
open. ``splitkey serve`` sets the check from ``--body-grace`` and ``--min-body-rate``, the
pace asked of request bodies (:meth:`JsonErrorsProtocol.configured`).
"""

from __future__ import annotations

import asyncio
import logging

from service.core import request_id
from service.core.admission import Admission
from service.core.connections import Connections
from service.core.errors import HeadTooLarge, InvalidBody, RequestTimeout, ServiceError, TooManyConnections, render

try:  # uvicorn's fast parser when installed (uvicorn[standard]), else its pure-Python one
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as BaseProtocol
except ImportError:  # pragma: no cover - httptools is installed with the service
    from uvicorn.protocols.http.h11_impl import H11Protocol as BaseProtocol  # type: ignore[assignment]

MALFORMED = ("the request must be valid HTTP/1.1 (a request line, headers, and a body framed by one Content-Length "
             "or by chunked encoding), got a request that could not be parsed")
#: Bytes of a request's line and headers read before it is refused (431). h11, uvicorn's other
#: parser, allows 16 KiB, nginx 4 x 8 KiB by default; an API key, a request id and the service's
#: few headers take well under 1 KiB, so this leaves room for what proxies add.
MAX_HEAD_BYTES = 64 * 2**10
STATUS_LINES = {400: b"HTTP/1.1 400 Bad Request", 408: b"HTTP/1.1 408 Request Timeout",
                431: b"HTTP/1.1 431 Request Header Fields Too Large", 503: b"HTTP/1.1 503 Service Unavailable"}

log = logging.getLogger(__name__)
#: The most seconds a closing connection waits for its client to close its side (nginx lingers 5 s
#: at most between reads): long enough for an answer to reach a client on any network, short
#: enough not to hold shutdown.
LINGER_S = 2.0


class LingeringTransport(asyncio.Transport):
    """``transport`` whose :meth:`close` lingers (module docstring); everything else is passed through."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self.lingering = False  #: closing: the answer and a FIN are sent or on their way, reads are dropped

    def close_now(self) -> None:
        """Close without lingering, once what is buffered is sent (an idle connection: nothing unread)."""
        self.lingering = True
        self._transport.close()

    def close(self) -> None:
        if self.lingering or self._transport.is_closing():
            return
        self.lingering = True
        if not self._transport.can_write_eof():  # pragma: no cover - a TCP transport can
            self._transport.close()
            return
        self._transport.write_eof()  # after what is buffered: the client reads the whole answer, then the end
        self._timer = self._loop.call_later(LINGER_S, self._transport.close)

    def closed(self) -> None:
        """The connection is gone: no more waiting for it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def abort(self) -> None:
        self.closed()
        self._transport.abort()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._transport.write(data)

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def write_eof(self) -> None:
        self._transport.write_eof()

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self._transport.get_extra_info(name, default)

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)


class JsonErrorsProtocol(BaseProtocol):
    transport: LingeringTransport
    #: Bytes read of the head now being received (0 before its first byte); None from the end of
    #: the head to the end of its request.
    _head_bytes: int | None = 0
    _request_ended = False  #: a request ended in the read being parsed
    _refused = False  #: answered here and closing: nothing more of this connection reaches the app
    #: Where waiting answers are counted (None: not counted), how often their progress is
    #: checked, and the bytes/s they must leave at (``configured``).
    admission: Admission | None = None
    answer_check_s: float = 10.0
    answer_min_rate: float = 65536.0
    _waiting = 0  #: bytes of this connection's answer counted as waiting (its buffer at the last look)
    _watch: asyncio.TimerHandle | None = None  #: the next progress check, while writing is paused
    #: Seconds a request's line and headers may take (``configured``: ``--body-timeout``).
    head_timeout_s: float = 120.0
    _head_timer: asyncio.TimerHandle | None = None  #: armed while a head is awaited
    #: Where connections are counted and limited (None: neither), and the Retry-After of a refusal.
    held: Connections | None = None
    retry_after_s: int = 1
    _answering_refusal = False  #: refused for want of room, its answer counted in ``held.refusing``

    @classmethod
    def configured(cls, *, admission: Admission | None, check_s: float, min_rate: float,
                   head_timeout_s: float, connections: Connections | None = None,
                   retry_after_s: int = 1) -> type[JsonErrorsProtocol]:
        """This protocol counting waiting answers in ``admission``, checked every ``check_s`` seconds
        (at least 1) for ``min_rate`` bytes/s (at least one byte), waiting ``head_timeout_s`` for a
        head, and holding connections within ``connections``: uvicorn takes a class."""
        return type(cls.__name__, (cls,), {"admission": admission, "answer_check_s": max(check_s, 1.0),
                                           "answer_min_rate": min_rate, "head_timeout_s": head_timeout_s,
                                           "held": connections, "retry_after_s": retry_after_s})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(LingeringTransport(transport, self.loop))
        if self.held is not None and not self.held.admit(self, self._address(), self._close_idle):
            self._no_room(self.held)
            return
        self._await_head()

    def _address(self) -> str:
        return self.client[0] if self.client else ""

    def _close_idle(self) -> None:
        """Closed to make room for a new connection (``Connections``): it waits for no request."""
        self.transport.close_now()

    def _no_room(self, connections: Connections) -> None:
        """Refuse this new connection: 503 while few refusals are being answered, else a bare close."""
        if not connections.may_answer_refusal():
            self._refused = True
            self.transport.abort()
            return
        self._answering_refusal = True
        limit = connections.limits
        self._refuse(TooManyConnections(
            f"connections must be at most {limit.total} at once, and {limit.per_client} per client address, with "
            f"none idle to close, got one more" if limit.per_client is not None else
            f"connections must be at most {limit.total} at once, with none idle to close, got one more",
            self.retry_after_s))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.held is not None and not self.pipeline and not self.transport.is_closing():
            self.held.idle(self, self._close_idle)

    def _await_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if not self._refused and not self.transport.is_closing():
            self._refuse(RequestTimeout(f"the request line and headers must arrive within {self.head_timeout_s:g} s, "
                                        f"got {self._head_bytes or 0} bytes of them"))

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def pause_writing(self) -> None:
        super().pause_writing()
        self._count_waiting()
        if self._watch is None:
            self._watch = self.loop.call_later(self.answer_check_s, self._check_progress, self._waiting)

    def resume_writing(self) -> None:
        self._stop_watching()
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_watching()
        self._head_arrived()
        self.transport.closed()
        if self.held is not None:
            self.held.gone(self)
            if self._answering_refusal:
                self.held.refusal_sent()
        super().connection_lost(exc)

    def _count_waiting(self) -> None:
        """Count what waits in the buffer now, in place of what was counted before."""
        now = self.transport.get_write_buffer_size()
        if self.admission is not None and now != self._waiting:
            self.admission.answers_waiting(now - self._waiting)
        self._waiting = now

    def _stop_watching(self) -> None:
        """Writing resumed (the buffer is under its low-water mark) or the connection is gone."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self.admission is not None and self._waiting:
            self.admission.answers_waiting(-self._waiting)
        self._waiting = 0

    def _check_progress(self, before: int) -> None:
        """``before`` bytes waited ``answer_check_s`` ago. While paused, the buffer only shrinks (a
        send waits for it to drain before it writes more), so what left is ``before`` minus now."""
        self._watch = None
        self._count_waiting()
        left = before - self._waiting
        if left < max(1.0, self.answer_min_rate * self.answer_check_s):
            log.info("a client read %d bytes of its answer in %g s (%d wait; at least %g bytes/s asked): "
                     "connection aborted", left, self.answer_check_s, self._waiting, self.answer_min_rate)
            if self.admission is not None:
                self.admission.answer_aborted()
            self.transport.abort()  # connection_lost follows: it gives the bytes back
            return
        self._watch = self.loop.call_later(self.answer_check_s, self._check_progress, self._waiting)

    def data_received(self, data: bytes) -> None:
        if self._refused or self.transport.lingering:  # closing: read and dropped (a lingering close)
            return
        if self.held is not None:
            self.held.busy(self)
        if self._head_bytes == 0:  # a head begins (the first since the connection opened is awaited already)
            self._await_head()
        self._request_ended = False
        super().data_received(data)
        if self._head_bytes is None or self._request_ended or self.transport.is_closing():
            # In the body (a head that ended in this read was measured whole: on_headers_complete);
            # or a request ended in this read and the next one's head began in it: that head's
            # first bytes are not counted here (at most one read: still bounded).
            return
        # The head was not complete before this read nor after it: all of it was head. Counted
        # as it comes, so that a head that never ends is refused before the parser holds more.
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(HeadTooLarge(f"the request line and headers must be at most {MAX_HEAD_BYTES} bytes, "
                                      f"got {self._head_bytes} without their end"))

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._head_arrived()
        self._head_bytes = None
        # The whole head, measured as it was sent: a head that ends in the read it began in (up
        # to a read's 256 KiB) is never counted by data_received.
        framing = len(b"GET  HTTP/1.1\r\n\r\n")  # the request line's spaces and version, the blank line
        size = len(self.url) + framing + sum(len(name) + len(value) + len(b": \r\n") for name, value in self.headers)
        if size > MAX_HEAD_BYTES:
            self._refuse(HeadTooLarge(f"the request line and headers must be at most {MAX_HEAD_BYTES} bytes, "
                                      f"got {size}"))
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        super().on_message_complete()
        self._head_bytes, self._request_ended = 0, True

    def send_400_response(self, msg: str) -> None:
        if not self._refused:
            self._refuse(InvalidBody(MALFORMED))

    def _refuse(self, err: ServiceError) -> None:
        """Answer ``err`` and close the connection: the request never reached the app."""
        self._refused = True
        request_id.assign([])
        status, body, headers = render(err, "/")
        headers.pop("Connection", None)
        head = [STATUS_LINES[status], b"content-type: application/json",
                b"content-length: " + str(len(body)).encode(), b"connection: close",
                request_id.HEADER + b": " + request_id.current().encode()]
        head += [k.lower().encode() + b": " + v.encode() for k, v in headers.items()]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.transport.close()
