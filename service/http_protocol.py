"""uvicorn's HTTP/1.1 protocol with two changes, for requests that never reach the app (so their
answers are written here, as JSON with a request id like every other error, API.md section 7):

* a request it cannot parse (a bad Content-Length, two framings, a broken chunk) is answered
  400 ``invalid_body`` instead of uvicorn's plain-text "Invalid HTTP request received.";
* a request head (request line and headers) over :data:`MAX_HEAD_BYTES` is answered 431
  ``header_too_large`` and the connection closed. uvicorn's fast parser (httptools) has no
  bound of its own: a client could send one header of hundreds of MiB, which the parser
  buffers whole while the event loop spends minutes on it (docs/SECURITY.md).

And one for answers: a connection whose answer waits, unread, over the transport's high-water
mark for :attr:`JsonErrorsProtocol.send_stall_s` seconds is aborted, which frees the answer's
bytes (uvicorn would keep them, and ``close`` waits for them to be read: a client that never
reads pinned its answer, up to GiBs, for as long as it kept the socket open).
"""

from __future__ import annotations

import asyncio
import logging

from service import request_id
from service.errors import HeadTooLarge, InvalidBody, ServiceError, render

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
STATUS_LINES = {400: b"HTTP/1.1 400 Bad Request", 431: b"HTTP/1.1 431 Request Header Fields Too Large"}

log = logging.getLogger(__name__)


class JsonErrorsProtocol(BaseProtocol):
    transport: asyncio.Transport
    #: Bytes read of the head now being received (0 before its first byte); None from the end of
    #: the head to the end of its request.
    _head_bytes: int | None = 0
    _request_ended = False  #: a request ended in the read being parsed
    _refused = False  #: answered here and closing: nothing more of this connection reaches the app
    #: Seconds an answer may wait unread over the write buffer's high-water mark before the connection
    #: is aborted (``splitkey serve`` sets it to ``--body-timeout``: :meth:`with_stall`).
    send_stall_s: float = 120.0
    _stall: asyncio.TimerHandle | None = None  #: armed while writing is paused

    @classmethod
    def with_stall(cls, seconds: float) -> type[JsonErrorsProtocol]:
        """This protocol with ``send_stall_s`` set (uvicorn takes a class, not an instance)."""
        return type(cls.__name__, (cls,), {"send_stall_s": seconds})

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.send_stall_s, self._stalled)

    def resume_writing(self) -> None:
        self._unstall()
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._unstall()
        super().connection_lost(exc)

    def _unstall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        """The client read nothing for ``send_stall_s``: drop what waits for it (connection_lost then
        ends the request, which gives back its admission ticket: service.middleware)."""
        self._stall = None
        log.info("a client read too little of its answer for %g s (%d bytes wait): connection aborted",
                 self.send_stall_s, self.transport.get_write_buffer_size())
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
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
