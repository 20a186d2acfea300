"""Reading a request body into one preallocated buffer, within a byte limit.

With a Content-Length the buffer is allocated once at that size (after checking
it against the limit), without writing it, and filled in place, which is what a
bare ASGI app does at its fastest; memory is then spent as bytes arrive, not as
they are declared; a chunked body grows geometrically and is refused (413) as soon
as it passes the limit, before the rest is read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np

from service.errors import BodyTooLarge, InvalidBody

FIRST_CHUNKED_ALLOCATION = 1 << 20


def _too_large(limit: int, got: str) -> BodyTooLarge:
    return BodyTooLarge(f"request body must be at most {limit} bytes, got {got}")


def declared_length(content_length: str | None, limit: int) -> int | None:
    """The Content-Length as an int (None if absent), refused when over the limit."""
    if content_length is None:
        return None
    if not content_length.isdigit():
        raise InvalidBody(f"Content-Length must be a non-negative integer, got {content_length!r}")
    n = int(content_length)
    if n > limit:
        raise _too_large(limit, f"Content-Length {n}")
    return n


async def read_into_buffer(chunks: AsyncIterator[bytes], length: int | None, limit: int) -> memoryview:
    """Read every chunk into one buffer; returns a view of exactly the bytes read."""
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
            raise _too_large(limit, f"more than {limit} bytes (chunked)")
        if pos + n > len(buf):
            buf.extend(bytes(min(max(len(buf), pos + n - len(buf)), limit - len(buf))))
        buf[pos:pos + n] = chunk
        pos += n
    return memoryview(buf)[:pos]
