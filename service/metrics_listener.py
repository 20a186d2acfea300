"""``--metrics-port``: ``GET /metrics`` on a listener of its own, without the API key.

Prometheus usually scrapes a port that only the cluster's network reaches, with no credentials;
the API port keeps its key. The listener binds ``--metrics-host`` (loopback unless told
otherwise) and answers one request per connection: ``GET`` or ``HEAD /metrics`` with the same
text as the API's ``/metrics`` (service.routes.ops.render_metrics), anything else 404 or 405.
It runs on the server's event loop and starts before Ray, so a scrape sees the front end
while it starts; one sent while ``ray.init`` holds the loop (``service.app``, a few seconds) is
answered when it returns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from service.routes.ops import METRICS_TYPE, render_metrics
from service.runtime import AppState

log = logging.getLogger(__name__)

#: How long a scraper has to send its request line and headers.
HEAD_TIMEOUT_S = 10.0
#: The most bytes of request line and headers read (a scrape sends a few hundred).
HEAD_LIMIT = 16384


def _answer(status: str, body: bytes, content_type: str, *, head: bool = False, allow: str | None = None) -> bytes:
    headers = [f"HTTP/1.1 {status}", f"Content-Type: {content_type}", f"Content-Length: {len(body)}",
               "Connection: close", *([f"Allow: {allow}"] if allow else [])]
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + (b"" if head else body)


async def answer(state: AppState, head: bytes) -> bytes:
    """The whole response to a request whose line and headers are ``head``."""
    method, _, rest = head.partition(b" ")
    target = rest.partition(b" ")[0].partition(b"?")[0]
    if target != b"/metrics":
        return _answer("404 Not Found", b"path must be /metrics\n", "text/plain; charset=utf-8")
    if method not in (b"GET", b"HEAD"):
        return _answer("405 Method Not Allowed", b"method must be GET or HEAD\n", "text/plain; charset=utf-8",
                       allow="GET, HEAD")
    return _answer("200 OK", await render_metrics(state), METRICS_TYPE, head=method == b"HEAD")


async def start(state: AppState, host: str, port: int) -> asyncio.Server:
    """The listener, serving; its socket is not inherited by processes started later (Ray's)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            writer.write(await answer(state, head))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass  # the scraper went away or sent no request: nobody to answer
        finally:
            writer.close()

    return await asyncio.start_server(handle, host.strip("[]"), port, limit=HEAD_LIMIT)


@asynccontextmanager
async def metrics_listener(state: AppState) -> AsyncIterator[None]:
    """The listener for ``--metrics-port`` while the app runs (nothing when it is unset)."""
    settings = state.settings
    if settings.metrics_port is None:
        yield
        return
    server = await start(state, settings.metrics_host, settings.metrics_port)
    host, port = server.sockets[0].getsockname()[:2]
    log.info("splitkey metrics on http://%s:%d/metrics (no API key)", f"[{host}]" if ":" in host else host, port)
    try:
        yield
    finally:
        server.close()
