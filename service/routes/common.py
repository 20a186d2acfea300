"""What every route shares: the app's state, one request's exchange (its body, deadline and
timings: :class:`Exchange`), decoding off the event loop, encoding."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import numpy as np
from fastapi import Request, Response
from starlette.requests import ClientDisconnect

from service.attention import V1_BINARY, JsonAnswerLimit
from service.core.admission import TICKET, Ticket
from service.core.deadline import within
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
R = TypeVar("R", bound=Response)
P = ParamSpec("P")

#: Bodies larger than this are decoded (and their values checked) in a thread, not on the
#: event loop: a pass over a GiB takes ~0.1 s, and other requests keep being read meanwhile.
OFF_LOOP_BYTES = 4 * 2**20


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.splitkey
    return state


#: What a work route answers before the workers have started (503).
NO_WORKERS = "workers must be started before requests are served, got none yet"


def runtime(request: Request) -> Runtime:
    rt = app_state(request).runtime
    if rt is None:
        raise WorkersUnavailable(NO_WORKERS)
    return rt


@dataclass(slots=True)
class Exchange:
    r"""One work request as a route serves it: the app's state and runtime, when it began, its stages
    (``Server-Timing``) and the seconds its client's ``X-Request-Timeout`` gives it (None: none).

    A route :meth:`begin`\ s it (503 before the workers start; 422 for a bad timeout header, before
    the body is read), reads the :meth:`body`, runs its query :meth:`within` the deadline, and
    :meth:`finish`\ es the response.
    """

    request: Request
    state: AppState
    rt: Runtime
    t0: float
    timings: Timings
    client: float | None

    @classmethod
    def begin(cls, request: Request, *, read: bool = True) -> Exchange:
        """``read``: the request runs a query within a deadline, and its ``X-Request-Timeout`` is read
        now; a context write runs to completion (``to_completion``) and has none."""
        state: AppState = request.app.state.splitkey
        if state.runtime is None:
            raise WorkersUnavailable(NO_WORKERS)
        client = timeout_header(request.headers.get(TIMEOUT_HEADER)) if read else None
        return cls(request, state, state.runtime, time.perf_counter(), Timings(), client)

    async def body(self, fmt: Format | None = None, *, limit: int | None = None,
                   before_read: Callable[[int], None] | None = None) -> memoryview:
        """The whole body, within ``limit`` bytes (by default the limit of a ``fmt`` body; checked from
        Content-Length before reading), at the settings' pace (408 when slower), charged to the
        in-flight body budget as it arrives; then the request takes its admission slot (429 if none is
        free): service.core.admission.

        ``before_read`` sees the declared length first, to refuse a body by its headers alone.
        """
        request, state = self.request, self.state
        lim = state.limits
        if limit is None:
            limit = lim.max_json_body_bytes if fmt == "json" else lim.max_body_bytes
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
        ticket.admit()
        return body

    async def within(self, work: Callable[[], Awaitable[T]], limit_s: float | None = None) -> T:
        """``work()``, a read, run within the request's deadline (504 past it): ``--request-timeout``,
        shortened, never lengthened, by the client's ``X-Request-Timeout``, which counts from
        :attr:`t0` (the client's clock ran while its body arrived), and by ``limit_s`` (a deadline
        the body gave: KServe's ``timeout`` parameter). A client whose time ran out before the work
        begins gets 504 at once.

        A client that closed its connection after sending its whole body is not served: a query whose
        client has gone before it starts is not sent to the workers, and one whose client goes while it
        runs is cancelled (the calls the workers have not started are then not run: ``WorkerChannel``'s
        cancel), and one gone as it ends is not encoded; the request is counted 499 as a body cut short is
        (``service.app``). Watched by a task that waits for the ASGI server's ``http.disconnect``.
        """
        limit = self.state.settings.request_timeout_s
        seconds = query_deadline(limit, self.client, self.t0)
        what = f"its {TIMEOUT_HEADER} of {self.client:g} s" if seconds < limit else f"the server's {limit:g} s limit"
        if limit_s is not None and limit_s < seconds:
            seconds, what = limit_s, f"its KServe timeout parameter of {limit_s:g} s"
        if await self.request.is_disconnected():  # a look, not a wait: a message is taken only if one is there
            raise ClientDisconnect()
        me = asyncio.current_task()
        gone: list[bool] = []  # set by the watcher before it cancels this task
        watcher = asyncio.ensure_future(self._watch(me, gone)) if me is not None else None
        try:
            result = await within(work(), seconds, what)
        except asyncio.CancelledError:
            if not gone or me is None:
                raise
            me.uncancel()  # cancelled for its client alone: answered 499, not left cancelled
            raise ClientDisconnect() from None
        finally:
            if watcher is not None:
                watcher.cancel()
        if await self.request.is_disconnected():  # gone as the work ended: its answer is not encoded
            raise ClientDisconnect()
        return result

    async def _watch(self, task: asyncio.Task, gone: list[bool]) -> None:
        """Cancel ``task`` (the query's) once the client has closed its connection. The body was read
        whole: the next ASGI message is ``http.disconnect``, when the client goes or the answer is sent."""
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        gone.append(True)
        task.cancel()

    def finish(self, route: str, response: R) -> R:
        """``response`` with its ``Server-Timing`` (docs/SERVICE.md), the stages into the metrics."""
        timings = self.timings
        timings.add("total", time.perf_counter() - self.t0)
        response.headers["Server-Timing"] = timings.header()
        self.state.metrics.stage_seconds.observe(route, timings.stages)
        return response


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
