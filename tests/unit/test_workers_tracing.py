"""A worker's pass spans (workers.tracing) with the OpenTelemetry SDK's in-memory exporter, in process."""

import numpy as np
import pytest

from workers.actor import ShardWorker
from workers.config import WorkerConfig
from workers.options import AttentionOptions
from workers.tasks import ShardQuery, ShardRead, ShardWrite
from workers.tracing import enabled, from_env, pass_spans

pytest.importorskip("opentelemetry.sdk")  # the otel extra (in the test extra too)
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import set_span_in_context  # noqa: E402
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: E402


def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def traceparent_of(span) -> str:
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return carrier["traceparent"]


def worker_with_a_shard(tracer, rng) -> ShardWorker:
    w = ShardWorker(WorkerConfig(channel=False), "w-test", tracer)
    k = rng.standard_normal((32, 2, 8)).astype(np.float32)
    w.create_shard(ShardWrite("ctx", 0, "float32", 32, np.arange(32)), k, k, {"id": "ctx", "version": 1})
    return w


def test_a_traced_query_gets_a_worker_pass_span_under_the_requests_span(rng):
    tracer, exporter = traced()
    worker = worker_with_a_shard(tracer, rng)
    request = tracer.start_span("POST /v1/attention")
    q = rng.standard_normal((1, 4, 8)).astype(np.float32)
    query = ShardQuery(np.array([31]), AttentionOptions(), None, traceparent_of(request))
    worker.partial_resident(q, query, (ShardRead("ctx", 0, 32, 1, fresh=True),), 2)
    request.end()
    [span] = [s for s in exporter.get_finished_spans() if s.name == "worker pass"]
    assert span.context.trace_id == request.context.trace_id and span.parent.span_id == request.context.span_id
    assert span.attributes["splitkey.worker"] == "w-test" and span.attributes["splitkey.batch"] == 1
    assert request.start_time <= span.start_time <= span.end_time <= request.end_time


def test_an_untraced_query_draws_no_span(rng):
    tracer, exporter = traced()
    worker = worker_with_a_shard(tracer, rng)
    q = rng.standard_normal((1, 4, 8)).astype(np.float32)
    worker.partial_resident(q, ShardQuery(np.array([31]), AttentionOptions()), (ShardRead("ctx", 0, 32, 1, fresh=True),), 2)
    assert exporter.get_finished_spans() == ()


def test_requests_that_share_a_pass_each_get_a_span_of_it():
    tracer, exporter = traced()
    a, b = tracer.start_span("a"), tracer.start_span("b")
    pass_spans(tracer, [traceparent_of(a), None, traceparent_of(b), traceparent_of(a)], 10, 20,
               {"splitkey.batch": 4})
    spans = exporter.get_finished_spans()
    assert sorted(s.parent.span_id for s in spans) == sorted([a.context.span_id, b.context.span_id])
    assert {(s.start_time, s.end_time, s.attributes["splitkey.batch"]) for s in spans} == {(10, 20, 4)}


def test_a_worker_asks_the_environment_only_where_its_config_says_the_front_end_traces():
    assert ShardWorker(WorkerConfig(channel=False), "w-off").tracer is None
    assert not enabled({}) and not enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "true"})
    assert enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4318"})
    tracer = from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL":
                       "http/protobuf"}, process="worker")
    assert tracer is not None and tracer.resource.attributes["splitkey.process"] == "worker"
