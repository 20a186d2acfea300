"""A bare ASGI app that reads a request body into one preallocated buffer: the ingest ceiling.

``benchmarks/service.py`` serves it with the same uvicorn (and the same defaults:
uvloop, httptools) as ``splitkey serve`` and posts the same bodies with curl, so
the service's parse stage can be compared with the fastest a Python ASGI app
reads a body here::

    .venv/bin/python -m uvicorn --app-dir benchmarks bare_asgi:app --port 8100 --log-level warning
    curl -s --data-binary @body.bin -H 'Content-Type: application/octet-stream' http://127.0.0.1:8100/

Like ``service/body.py`` it allocates one buffer of Content-Length bytes per
request (``bytearray``) and copies each chunk into it. Every request is answered
200 with ``{"bytes": N}``; ``Server-Timing: alloc;dur=MS, read;dur=MS`` holds the
allocation and the time from the first ``receive`` to the last body chunk. No
parsing, no validation, no copies beyond the one into the buffer.
"""

from __future__ import annotations

import json
import time
from typing import Any


def content_length(scope: dict) -> int | None:
    """The request's Content-Length header as an int, or None."""
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            return int(value)
    return None


async def read_body(receive: Any, view: memoryview | None) -> int:
    """Copy every body chunk into ``view`` (None: a chunked body, appended to a growing buffer); bytes read.

    Bytes past the end of ``view`` are counted, not kept.
    """
    if view is None:
        grown = bytearray()
        more = True
        while more:
            message = await receive()
            grown += message.get("body", b"")
            more = message.get("more_body", False)
        return len(grown)
    length = len(view)
    pos = 0
    more = True
    while more:
        message = await receive()
        chunk = message.get("body", b"")
        n = min(len(chunk), length - pos)
        view[pos:pos + n] = chunk[:n] if n < len(chunk) else chunk
        pos += len(chunk)
        more = message.get("more_body", False)
    return pos


async def lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def app(scope: dict, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    length = content_length(scope)
    t0 = time.perf_counter()
    view = None if length is None else memoryview(bytearray(length))  # as service/body.py: one buffer per request
    t1 = time.perf_counter()
    n = await read_body(receive, view)
    t2 = time.perf_counter()
    body = json.dumps({"bytes": n}).encode()
    timing = f"alloc;dur={(t1 - t0) * 1000:.3f}, read;dur={(t2 - t1) * 1000:.3f}"
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"server-timing", timing.encode())]})
    await send({"type": "http.response.body", "body": body})
