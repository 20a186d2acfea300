"""Traces of requests (service.tracing) with the OpenTelemetry SDK's in-memory exporter, in process."""

import asyncio
import subprocess
import sys
import time

import httpx
import pytest

from service.app import create_app
from service.core.metrics import TRACEPARENT, Timings
from service.core.settings import ServiceSettings
from service.tracing import TracingMiddleware, from_env

pytest.importorskip("opentelemetry.sdk")  # the otel extra (in the test extra too)
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

STAGES = ("parse", "lookup", "scatter", "compute", "worker", "merge", "encode")


def traced_app():
    """The app with a route that goes through an attention request's stages as the real one times them,
    traced into memory; returns (app, exporter)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(ServiceSettings())

    async def staged() -> dict:
        timings = Timings()
        for stage in ("parse", "lookup", "scatter"):
            with timings.measure(stage):
                await asyncio.sleep(0.002)
        t0 = time.perf_counter()

        async def compute() -> None:  # in a task of its own, as the orchestrator's gathered calls are
            await asyncio.sleep(0.004)

        await asyncio.gather(compute(), compute())
        timings.add("compute", time.perf_counter() - t0)
        timings.add("worker", 0.003)
        for stage in ("merge", "encode"):
            with timings.measure(stage):
                await asyncio.sleep(0.001)
        timings.add("total", 0.02)
        return {"ok": True, "traceparent": TRACEPARENT.get()}

    app.add_api_route("/v1/attention/staged", staged, methods=["POST"])
    app.add_middleware(TracingMiddleware, tracer=provider.get_tracer("test"),
                       paths=frozenset({"/v1/attention/staged", "/healthz"}))
    return app, exporter


def request(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://splitkey") as c:
            return await c.request(method, path, **kwargs)

    return asyncio.run(go())


def test_a_request_is_one_trace_with_a_span_per_stage_inside_its_server_span_in_order():
    app, exporter = traced_app()
    assert request(app, "POST", "/v1/attention/staged").status_code == 200
    spans = exporter.get_finished_spans()
    server = next(s for s in spans if s.name == "POST /v1/attention/staged")
    stages = [s for s in spans if s is not server]
    assert [s.name for s in stages] == list(STAGES)  # no "total": the server span is the total
    assert {s.context.trace_id for s in spans} == {server.context.trace_id} and server.parent is None
    assert all(s.parent.span_id == server.context.span_id for s in stages)
    assert all(server.start_time <= s.start_time <= s.end_time <= server.end_time for s in stages)
    by_name = {s.name: s for s in stages}
    assert by_name["parse"].end_time <= by_name["lookup"].start_time <= by_name["lookup"].end_time \
        <= by_name["scatter"].start_time
    compute, worker = by_name["compute"], by_name["worker"]
    assert compute.end_time - compute.start_time >= 4e6  # ns
    assert abs(worker.end_time - worker.start_time - 3e6) < 1e5 and worker.start_time >= compute.start_time
    assert server.attributes["http.route"] == "/v1/attention/staged"
    assert server.attributes["http.response.status_code"] == 200
    r = request(app, "POST", "/v1/attention/staged", headers={"X-Request-Id": "client-chose-9"})
    last = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/attention/staged"][-1]
    assert last.attributes["splitkey.request_id"] == r.headers["x-request-id"] == "client-chose-9"


def test_an_incoming_traceparent_is_joined_and_tracestate_kept():
    app, exporter = traced_app()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = request(app, "POST", "/v1/attention/staged",
                headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "vendor=x"})
    assert r.status_code == 200
    spans = exporter.get_finished_spans()
    assert {format(s.context.trace_id, "032x") for s in spans} == {trace_id}
    server = next(s for s in spans if s.name.startswith("POST"))
    assert format(server.parent.span_id, "016x") == parent_id and server.parent.is_remote
    assert server.context.trace_state.get("vendor") == "x"


def test_a_path_with_no_route_is_named_by_its_method_alone():
    app, exporter = traced_app()
    assert request(app, "GET", "/no/such/path/1234").status_code == 404
    (span,) = exporter.get_finished_spans()
    assert span.name == "GET" and span.attributes["http.route"] == "unmatched"


def test_without_an_otlp_endpoint_tracing_is_off_and_imports_nothing_of_opentelemetry():
    assert from_env({}) is None and from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317",
                                               "OTEL_SDK_DISABLED": "true"}) is None
    code = ("import sys, os; os.environ.pop('OTEL_EXPORTER_OTLP_ENDPOINT', None); "
            "from service.tracing import from_env; from service.middleware import ServiceMiddleware; "
            "assert from_env() is None; print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_without_tracing_the_app_has_no_tracing_middleware_and_stages_record_no_intervals():
    app = create_app(ServiceSettings())
    assert all(m.cls is not TracingMiddleware for m in app.user_middleware)
    timings = Timings()
    timings.add("parse", 0.001)
    assert timings.spans is None


def test_with_an_otlp_endpoint_the_app_is_traced_over_otlp():
    tracer = from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL":
                       "http/protobuf", "OTEL_SERVICE_NAME": "splitkey-test"})
    assert tracer is not None and tracer.resource.attributes["service.name"] == "splitkey-test"


def test_the_workers_are_sent_the_requests_server_span_as_their_parent():
    app, exporter = traced_app()
    r = request(app, "POST", "/v1/attention/staged")
    server = next(s for s in exporter.get_finished_spans() if s.name == "POST /v1/attention/staged")
    version, trace_id, span_id, _ = r.json()["traceparent"].split("-")
    assert (version, trace_id, span_id) == ("00", f"{server.context.trace_id:032x}", f"{server.context.span_id:016x}")
    assert TRACEPARENT.get() is None  # only while the request runs


def test_a_traced_query_draws_each_workers_pass_under_its_request(rng):
    """A request over inline keys on two in-process workers (real ShardWorker objects behind the seam): each
    worker that ran a pass for it exports a span of it under the request's span."""
    import numpy as np
    from faulty_pool import started

    from service.attention import AttentionService
    from service.cluster.orchestrator import Orchestrator
    from service.wire.request import AttentionRequest, InlineKV
    from workers.options import AttentionOptions
    from workers.problem import KVDims

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    async def main():
        pool, _, contexts = await started(2, min_shard_keys=16, tracer=tracer)
        try:
            settings = contexts.settings
            service = AttentionService(settings, pool, Orchestrator(pool, fanin=settings.merge_fanin,
                                                                    remote_merge_bytes=settings.remote_merge_bytes),
                                       contexts)
            k, v = (rng.standard_normal((256, 2, 8)).astype(np.float32) for _ in range(2))
            q = rng.standard_normal((1, 4, 8)).astype(np.float32)
            req = AttentionRequest(q=q, q_pos=None, kv=InlineKV(k, v, None, KVDims(256, 2, 8, 8)),
                                   options=AttentionOptions(), contexts=(), n_q=1, h_q=4, d=8)
            span = tracer.start_span("POST /v1/attention")
            token = TRACEPARENT.set(f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-01")
            try:
                await service.attention(req, Timings())
            finally:
                TRACEPARENT.reset(token)
                span.end()
            return span
        finally:
            pool.shutdown()

    request_span = asyncio.run(main())
    passes = [s for s in exporter.get_finished_spans() if s.name == "worker pass"]
    assert sorted(s.attributes["splitkey.worker"] for s in passes) == ["splitkey-worker-0", "splitkey-worker-1"]
    assert all(s.parent.span_id == request_span.context.span_id and s.context.trace_id == request_span.context.trace_id
               for s in passes)
