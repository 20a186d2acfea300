"""What every route shares: the app's state, body reading, decoding off the event loop,
encoding, deadlines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

import numpy as np
from fastapi import Request, Response
from starlette.requests import ClientDisconnect

from service.attention import V1_BINARY, JsonAnswerLimit
from service.core import deadline
from service.core.admission import TICKET, Ticket
from service.core.errors import DeadlineExceeded, RequestTimeout, UnsupportedMediaType, WorkersUnavailable
from service.core.metrics import Timings
from service.runtime import AppState, Runtime
from service.wire.body import declared_length, paced, read_into_buffer
from service.wire.json_codec import decode_json_request, json_result
from service.wire.json_text import write_json
from service.wire.negotiation import Format, content_type
from service.wire.request import Decoded
from service.wire.rules import TIMEOUT_HEADER, BodyKind, Limits, refuse_query, timeout_header
from service.wire.safetensors import decode_binary_request, encode_safetensors, to_bytes

T = TypeVar("T")
P = ParamSpec("P")

#: Bodies larger than this are decoded (and their values checked) in a thread, not on the
#: event loop: a pass over a GiB takes ~0.1 s, and other requests keep being read meanwhile.
OFF_LOOP_BYTES = 4 * 2**20


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.splitkey
    return state


def runtime(request: Request) -> Runtime:
    rt = app_state(request).runtime
    if rt is None:
        raise WorkersUnavailable("workers must be started before requests are served, got none yet")
    return rt


def body_limit(limits: Limits, fmt: Format) -> int:
    return limits.max_json_body_bytes if fmt == "json" else limits.max_body_bytes


async def read_body(request: Request, limit: int, route: str,
                    before_read: Callable[[int], None] | None = None) -> memoryview:
    """The whole body, within ``limit`` bytes (checked from Content-Length before reading), at the
    settings' pace (408 when slower), charged to the in-flight body budget as it arrives; then
    the request takes its admission slot (429 if none is free): service.core.admission.

    ``before_read`` sees the declared length first, to refuse a body by its headers alone.
    """
    state = app_state(request)
    ticket: Ticket = request.scope[TICKET]
    encoding = request.headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() != "identity":  # nothing here decompresses
        raise UnsupportedMediaType(f"Content-Encoding must be identity (send the body uncompressed), got {encoding!r}")
    # The HTTP parser takes the body's framing from a final "chunked" and leaves any coding before it
    # (gzip, chunked) undone: such a body would reach the decoders still coded. RFC 9112 answers an
    # unknown transfer coding with 501, but a client's mistake is a 4xx here: 415, as a Content-Encoding.
    coding = request.headers.get("transfer-encoding")
    if coding is not None and [c.strip().lower() for c in coding.split(",")] != ["chunked"]:
        raise UnsupportedMediaType(f"Transfer-Encoding must be chunked or absent (send the body uncompressed), "
                                   f"got {coding!r}")
    lim = state.limits
    what = ("a JSON request body (the JSON limit; safetensors bodies may be larger)"
            if limit == lim.max_json_body_bytes < lim.max_body_bytes else "request body")
    length = declared_length(request.headers.get("content-length"), limit, what)
    if length is not None:
        if before_read is not None:
            before_read(length)
        ticket.expect(length)
    try:
        body = await read_into_buffer(paced(request.receive, state.pace), length, limit, ticket.charge, what)
    except RequestTimeout:
        state.metrics.rejected.labels(reason="slow_body").inc()
        raise
    state.metrics.count_bytes_in(route, len(body))
    ticket.admit()
    return body


def decode_body(fmt: Format, body: memoryview, query: Any, kind: BodyKind, limits: Limits) -> Decoded:
    """The tensors and options of a ``/v1`` body: JSON fields (and no URL query), or safetensors with
    options in the URL query."""
    if fmt == "json":
        refuse_query(query, "a JSON body")
        return decode_json_request(body, limits, kind)
    return decode_binary_request(body, query, kind, limits)


async def off_loop(nbytes: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args)``: in a thread when it works over more than ``OFF_LOOP_BYTES``, else here.

    For binary work (copies, checks of raw arrays); JSON text is parsed and written under the GIL,
    where a thread would not free the loop (``service.wire.json_text``).
    """
    if nbytes > OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def answer_limit(limits: Limits, resp_fmt: Format) -> JsonAnswerLimit | None:
    """The ``out`` elements an answer in ``resp_fmt`` may hold, when lower than any tensor's (JSON text)."""
    return JsonAnswerLimit(limits.max_json_answer_elements, V1_BINARY) if resp_fmt == "json" else None


async def encode_result(resp_fmt: Format, out: np.ndarray, lse: np.ndarray, timings: Timings) -> Response:
    """``out`` and ``lse`` in ``resp_fmt`` (``response_format`` of the request's ``Accept``): JSON written on
    the loop in pieces (``json_text.write_json``: 2**21 numbers take about 1.5 s, other requests served
    between the pieces), safetensors copied in a thread when large."""
    t0 = time.perf_counter()
    if resp_fmt == "json":
        content = await write_json(json_result(out, lse))
    else:
        content = await off_loop(out.nbytes + lse.nbytes, lambda: to_bytes(encode_safetensors({"out": out, "lse": lse})))
    timings.add("encode", time.perf_counter() - t0)
    return Response(content=content, media_type=content_type(resp_fmt))  # the caller adds Server-Timing, with total


def client_timeout(request: Request) -> float | None:
    """The seconds the client's ``X-Request-Timeout`` header gives its query (None: none), checked
    before the body is read (422 naming the header)."""
    return timeout_header(request.headers.get(TIMEOUT_HEADER))


def query_deadline(limit: float, client: float | None, started: float) -> float:
    """Seconds from now the query may still run: ``limit`` (``--request-timeout``), shortened, never
    lengthened, by the client's ``X-Request-Timeout`` (``client``), which counts from ``started``
    (``time.perf_counter()`` when the route began: the client's clock ran while its body arrived).
    A client whose time ran out before the work begins gets 504 at once."""
    if client is None:
        return limit
    left = client - (time.perf_counter() - started)
    if left <= 0:
        raise DeadlineExceeded(f"the request must finish within its {TIMEOUT_HEADER} of {client:g} s, "
                               "got longer before its work began")
    return min(limit, left)


async def client_waits(request: Request) -> None:
    """Raise ``ClientDisconnect`` when the client has closed its connection after sending its whole body:
    the query is then not sent to the workers (checked after parsing) or its answer not encoded (checked
    after the compute), and the request is counted 499 as a body cut short is (``service.app``). A look
    at the connection, not a wait: Starlette's ``is_disconnected`` takes a message only if one is there."""
    if await request.is_disconnected():
        raise ClientDisconnect()


async def with_deadline(work: Awaitable[T], seconds: float) -> T:
    """Run a read (a query) within the request deadline (504 past it).

    In the request's own task (``asyncio.timeout``), not a task of its own as ``asyncio.wait_for``
    makes on Python 3.11: one task and one turn of the event loop less per query. The calls it
    sends the workers carry the seconds left of the same deadline (``service.core.deadline``), so a
    worker does not start work this request has given up on; ``work`` is a coroutine, run in this
    task's context."""
    try:
        with deadline.running(seconds):
            async with asyncio.timeout(seconds):
                return await work
    except TimeoutError:
        raise DeadlineExceeded(f"the request must finish within {seconds} s, got longer") from None


async def to_completion(work: Awaitable[T]) -> T:
    """Run a context write to its end and answer what it did.

    Cancelling it half way would leave replicas out of step, so writes are not cut by the
    request deadline (their size is bounded by the body limit instead), nor by a client that
    goes away, nor by the end of the shutdown's grace period (``service.core.drain``): a write cut
    there used to be answered 503 ``shutting_down`` while it went on to commit, and a client
    retrying it (without ``after``) stored its keys twice. A cancel that arrives here is taken
    back and the write awaited; uvicorn waits for every answer in progress before the
    lifespan stops the workers, so the write ends before they do.
    """
    task = asyncio.ensure_future(work)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task.cancelled() or me is None:  # the write itself was cancelled (the loop is closing)
                raise
            me.uncancel()  # the request's task goes on: its answer is the write's own
