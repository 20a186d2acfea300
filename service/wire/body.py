"""Reading a request body into one preallocated buffer, within a byte limit and a pace.

With a Content-Length the buffer is allocated once at that size (after checking
it against the limit), without writing it, and filled in place, which is what a
bare ASGI app does at its fastest; memory is then spent as bytes arrive, not as
they are declared; a chunked body grows geometrically and is refused (413) as soon
as it passes the limit, before the rest is read.

A body must also arrive in time (:class:`Pace`): within a deadline, and at a minimum
average rate once a grace period is over; a slower one is cut with 408 and its
connection closed, so a client that trickles bytes holds nothing for long.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import numpy as np

from service.core.errors import BodyTooLarge, InvalidBody
from service.core.limits import Pace

FIRST_CHUNKED_ALLOCATION = 1 << 20


class ClientClosed(Exception):
    """The client closed the connection before its body had arrived (nobody is left to answer)."""


async def paced(receive: Callable[[], Awaitable[MutableMapping[str, Any]]], pace: Pace,
                clock: Callable[[], float] = time.monotonic) -> AsyncIterator[bytes]:
    """The body's chunks from an ASGI ``receive``, each awaited no longer than ``pace`` allows.

    Raises RequestTimeout when the pace is missed, ClientClosed when the client goes away.
    """
    started, received = clock(), 0
    while True:
        left = pace.deadline(started, received) - clock()
        try:
            if left <= 0:
                raise TimeoutError
            async with asyncio.timeout(left):  # in this task: wait_for would start one per chunk
                message = await receive()
        except TimeoutError:
            raise pace.too_slow(received, clock() - started) from None
        if message["type"] == "http.disconnect":
            raise ClientClosed
        chunk = message.get("body", b"")
        received += len(chunk)
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


def _too_large(limit: int, got: str, what: str) -> BodyTooLarge:
    return BodyTooLarge(f"{what} must be at most {limit} bytes, got {got}")


def declared_length(content_length: str | None, limit: int, what: str = "request body") -> int | None:
    """The Content-Length as an int (None if absent), refused when over the limit (``what`` names it)."""
    if content_length is None:
        return None
    if not content_length.isdigit():
        raise InvalidBody(f"Content-Length must be a non-negative integer, got {content_length!r}")
    n = int(content_length)
    if n > limit:
        raise _too_large(limit, f"Content-Length {n}", what)
    return n


async def read_into_buffer(chunks: AsyncIterator[bytes], length: int | None, limit: int,
                           charge: Callable[[int], None] = lambda n: None, what: str = "request body") -> memoryview:
    """Read every chunk into one buffer; returns a view of exactly the bytes read.

    ``charge(n)`` is told of every chunk before it is kept (it may refuse it by raising).
    """
    if length is not None:
        # np.empty, not bytearray(length): it does not write the buffer, so the pages of a large
        # body are only touched (and count in the process's memory) as its bytes arrive. A
        # client that declares a GiB and sends 16 bytes costs 16 bytes, not a GiB.
        view = np.empty(length, dtype=np.uint8).data  # [length] bytes, untouched
        pos = 0
        async for chunk in chunks:
            n = len(chunk)
            if pos + n > length:
                raise InvalidBody(f"request body must be Content-Length = {length} bytes, got more")
            charge(n)
            view[pos:pos + n] = chunk
            pos += n
        if pos != length:
            raise InvalidBody(f"request body must be Content-Length = {length} bytes, got {pos}")
        return view
    buf = bytearray(FIRST_CHUNKED_ALLOCATION)
    pos = 0
    async for chunk in chunks:
        n = len(chunk)
        if pos + n > limit:
            raise _too_large(limit, f"more than {limit} bytes (chunked)", what)
        charge(n)
        if pos + n > len(buf):
            buf.extend(bytes(min(max(len(buf), pos + n - len(buf)), limit - len(buf))))
        buf[pos:pos + n] = chunk
        pos += n
    return memoryview(buf)[:pos]
