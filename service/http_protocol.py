"""uvicorn's HTTP/1.1 protocol with one change: a request it cannot parse (a bad Content-Length,
two framings, a broken chunk) is answered like every other error, 400 ``invalid_body`` as JSON
with a request id, instead of uvicorn's plain-text "Invalid HTTP request received." (API.md
section 7). Such a request never reaches the app, so its answer is written here."""

from __future__ import annotations

import asyncio

from service import request_id
from service.errors import InvalidBody, render

try:  # uvicorn's fast parser when installed (uvicorn[standard]), else its pure-Python one
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as BaseProtocol
except ImportError:  # pragma: no cover - httptools is installed with the service
    from uvicorn.protocols.http.h11_impl import H11Protocol as BaseProtocol  # type: ignore[assignment]

MALFORMED = ("the request must be valid HTTP/1.1 (a request line, headers, and a body framed by one Content-Length "
             "or by chunked encoding), got a request that could not be parsed")


class JsonErrorsProtocol(BaseProtocol):
    transport: asyncio.Transport

    def send_400_response(self, msg: str) -> None:
        request_id.assign([])
        _, body, headers = render(InvalidBody(MALFORMED), "/")
        head = [b"HTTP/1.1 400 Bad Request", b"content-type: application/json",
                b"content-length: " + str(len(body)).encode(), b"connection: close",
                request_id.HEADER + b": " + request_id.current().encode()]
        head += [k.lower().encode() + b": " + v.encode() for k, v in headers.items()]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.transport.close()
