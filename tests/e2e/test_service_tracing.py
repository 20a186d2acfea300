"""A real ``splitkey serve`` with an OTLP endpoint set (service.tracing): the spans of an attention
request reach an OTLP/HTTP collector (here, a receiver in the test) in the caller's trace, the front
end's and the worker's, each from its own process."""

from __future__ import annotations

import http.server
import threading
import time

import httpx
import pytest

from server import Server

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")  # the otel extra (in the test extra too)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402


class Collector(http.server.BaseHTTPRequestHandler):
    """OTLP/HTTP's traces endpoint: each POST's spans into ``spans``, and the attributes of the resource that
    sent each span (by span id) into ``senders``."""

    spans: list = []
    senders: dict = {}

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        request = ExportTraceServiceRequest.FromString(body)
        for rs in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                Collector.spans += list(ss.spans)
                Collector.senders.update({s.span_id: attributes for s in ss.spans})
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.mark.ray
def test_an_attention_request_reaches_the_collector_as_stage_spans_in_the_callers_trace(tmp_path):
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    srv = Server(tmp_path, args=("--workers", "1"), env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100"}).start()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        one = {"q": [[[1.0, 2.0]]], "k": [[[1.0, 0.0]], [[0.0, 1.0]]], "v": [[[1.0]], [[2.0]]]}
        r = httpx.post(srv.url + "/v1/attention", json=one, timeout=60,
                       headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not {"POST /v1/attention", "worker pass"} <= {s.name for s in
                                                                                         Collector.spans}:
            time.sleep(0.1)
    finally:
        srv.stop()
        collector.shutdown()
    spans = [s for s in Collector.spans if s.trace_id.hex() == trace_id]
    server = next(s for s in spans if s.name == "POST /v1/attention")
    stages = {s.name: s for s in spans if s.parent_span_id == server.span_id}
    assert {"parse", "scatter", "compute", "worker", "merge", "encode"} <= set(stages), sorted(stages)
    # A stage timed by its seconds alone ends when they are added: a few microseconds late (< 1 ms here).
    assert stages["parse"].end_time_unix_nano <= stages["scatter"].start_time_unix_nano + 1_000_000
    assert stages["compute"].end_time_unix_nano <= stages["merge"].start_time_unix_nano + 1_000_000
    assert all(server.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano
               <= server.end_time_unix_nano for s in stages.values())
    # The worker's own span, exported from the worker's process (its environment is the front end's here).
    [worker] = [s for s in spans if s.name == "worker pass"]
    assert worker.parent_span_id == server.span_id
    assert Collector.senders[worker.span_id]["splitkey.process"] == "worker"
    assert Collector.senders[server.span_id]["splitkey.process"] == "frontend"
    # Its clock is the same machine's here: the pass lies within the worker stage's call.
    assert stages["compute"].start_time_unix_nano <= worker.start_time_unix_nano <= worker.end_time_unix_nano \
        <= stages["compute"].end_time_unix_nano
