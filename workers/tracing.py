"""OpenTelemetry for the processes of the service: the tracer the standard ``OTEL_*`` variables ask for,
and the spans of a worker's passes.

**On or off.** :func:`from_env` gives a tracer exporting over OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set and ``OTEL_SDK_DISABLED`` is not ``true``, and the
``otel`` extra is installed; otherwise None, and nothing of OpenTelemetry is imported. The front end
asks for its own (``service.tracing``) and tells each worker in its config whether to ask
(``workers.config.WorkerConfig.tracing``): a worker process reads the same variables where it runs (a
local cluster's workers inherit the front end's environment; a KubeRay worker pod needs them in its
spec). The exporter is configured by the standard variables (endpoint, headers,
``OTEL_EXPORTER_OTLP_PROTOCOL``: ``grpc``, the default, or ``http/protobuf``), the resource by
``OTEL_SERVICE_NAME`` (default ``splitkey``) and ``OTEL_RESOURCE_ATTRIBUTES``, plus
``splitkey.process``: ``frontend`` or ``worker``; spans leave in batches from a thread of the SDK.

**A worker's passes.** A traced request's calls carry its W3C ``traceparent``
(``workers.tasks.ShardQuery.trace``, the front end's server span). A worker with a tracer draws one
span ``worker pass`` per traced request for each pass over keys it ran for it, a child of that
server span, from the pass's start to its end on the worker's clock: requests that shared a pass
(a batch) each get a span of the same interval, with ``splitkey.batch`` saying how many shared it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)

#: The variables that name where traces go; one of them set turns tracing on.
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
#: The longest ``traceparent`` a call may carry (W3C's is 55 characters; a longer one is not traced).
MAX_TRACEPARENT = 128


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the variables ask for traces (an endpoint set, the SDK not disabled); imports nothing."""
    env = os.environ if environ is None else environ
    return any(env.get(name) for name in ENDPOINT_VARS) and env.get("OTEL_SDK_DISABLED", "").lower() != "true"


def from_env(environ: Mapping[str, str] | None = None, *, process: str = "frontend") -> Tracer | None:
    """The tracer the standard ``OTEL_*`` variables ask for, exporting over OTLP; None (and nothing
    imported) when they do not (:func:`enabled`); None with a warning when they do but the ``otel``
    extra is not installed. ``process`` names this process's part (``splitkey.process``)."""
    env = os.environ if environ is None else environ
    if not enabled(env):
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        if env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")) == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    except ImportError as exc:
        log.warning("tracing is off: an OTLP endpoint is set but the otel extra is not installed "
                    "(pip install 'splitkey[otel]'): %s", exc)
        return None
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", "splitkey"), "splitkey.process": process})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    log.info("tracing %s to %s", process, next(env[name] for name in reversed(ENDPOINT_VARS) if env.get(name)))
    return provider.get_tracer("splitkey")


def pass_spans(tracer: Tracer, traces: Iterable[str | None], start_ns: int, end_ns: int,
               attributes: Mapping[str, Any]) -> None:
    """One ``worker pass`` span, ``start_ns`` to ``end_ns`` (wall clock), under each distinct traceparent
    of ``traces`` (None: that request is not traced); ``splitkey.batch`` is how many requests shared it."""
    parents = [t for t in dict.fromkeys(traces) if t is not None]
    if not parents:
        return
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()
    for traceparent in parents:
        parent = propagator.extract({"traceparent": traceparent})
        span = tracer.start_span("worker pass", context=parent, start_time=start_ns, attributes=dict(attributes))
        span.end(end_time=end_ns)
