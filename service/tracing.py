"""OpenTelemetry traces of requests, when the ``otel`` extra is installed and an OTLP endpoint is set.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set and
``OTEL_SDK_DISABLED`` is not ``true``: then nothing of OpenTelemetry is imported and the app gets no
middleware (``from_env`` returns None). On, each HTTP request is one trace, or joins the caller's when
it sends a W3C ``traceparent`` (``tracestate`` too): a server span ``METHOD route`` (the metrics' route
label, so span names stay few; its attribute ``splitkey.request_id`` is the ``X-Request-Id``
answered, which the log lines name), with one child span per stage the request went through, as
``service.core.metrics.Timings`` measures them (parse, lookup, scatter, compute, worker, merge,
encode; a context write's place, put, lease, store, commit, note). The ``worker`` stage span is the
longest pass a worker reported for the request (its kernels and local merge), drawn at the end of
``compute``, which holds it. The workers draw their own passes too, in their own processes: the
request's calls carry the server span's ``traceparent`` (``TRACEPARENT``, then
``workers.tasks.ShardQuery.trace``), and each worker exports a ``worker pass`` span under it
(``workers.tracing``), when the ``OTEL_*`` variables reach the worker's process.

The exporter (``workers.tracing.from_env``) is OTLP, configured by the standard ``OTEL_*`` variables;
spans leave in batches from a thread of the SDK (``BatchSpanProcessor``), never on the event loop.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from service.core import request_id
from service.core.metrics import RECORDING, TRACEPARENT
from service.middleware import UNMATCHED, route_label
from workers.tracing import from_env as tracing_from_env

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)

#: Stages that are no span of their own: ``total`` is the server span.
NOT_SPANS = frozenset({"total"})


def from_env(environ: dict[str, str] | None = None) -> Tracer | None:
    """The front end's tracer (``workers.tracing.from_env``: the standard ``OTEL_*`` variables)."""
    return tracing_from_env(environ, process="frontend")


class TracingMiddleware:
    """Pure ASGI: the server span of each HTTP request and its stages' spans (the outermost middleware,
    so its span holds everything the request took)."""

    def __init__(self, app: Any, *, tracer: Tracer, paths: frozenset[str]) -> None:
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        from opentelemetry.trace.status import Status, StatusCode

        self.app, self.tracer, self.paths = app, tracer, paths
        self._extract, self._in_context = extract, set_span_in_context
        self._w3c = TraceContextTextMapPropagator()
        self._server, self._error = SpanKind.SERVER, (Status, StatusCode.ERROR)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k in (b"traceparent", b"tracestate")}
        route = route_label(scope["path"], self.paths)
        name = f"{scope['method']} {route}" if route != UNMATCHED else scope["method"]
        attributes = {"http.request.method": scope["method"], "http.route": route, "url.path": scope["path"]}
        span = self.tracer.start_span(name, context=self._extract(carrier), kind=self._server, attributes=attributes)
        # perf_counter seconds -> the wall clock's nanoseconds, for the stages' intervals
        offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)
        stages: list[tuple[str, float, float]] = []
        token = RECORDING.set(stages)
        ours: dict[str, str] = {}
        self._w3c.inject(ours, context=self._in_context(span))  # the workers draw their passes under it
        parent_token = TRACEPARENT.set(ours.get("traceparent"))
        status = {"code": 0}

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            RECORDING.reset(token)
            TRACEPARENT.reset(parent_token)
            parent = self._in_context(span)
            for stage, start, end in stages:
                if stage not in NOT_SPANS:
                    self.tracer.start_span(stage, context=parent, start_time=offset_ns + int(start * 1e9)).end(
                        end_time=offset_ns + int(end * 1e9))
            span.set_attribute("splitkey.request_id", request_id.current())  # the X-Request-Id answered, as logged
            if status["code"]:
                span.set_attribute("http.response.status_code", status["code"])
            if status["code"] >= 500 or not status["code"]:
                status_class, error = self._error
                span.set_status(status_class(error))
            span.end()
