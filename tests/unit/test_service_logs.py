"""The server's log (service.core.logs): text or JSON lines, and one access-log line per request
written by the middleware (in process: no Ray, the lifespan does not run here)."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
from fastapi import Response

from service.app import create_app
from service.core import logs
from service.core.settings import ServiceSettings


def request(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://splitkey") as c:
            return await c.request(method, path, **kwargs)

    return asyncio.run(go())


def access_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "splitkey.access"]


def test_each_request_has_one_access_line_with_its_route_status_bytes_duration_id_and_stages(caplog):
    app = create_app(ServiceSettings())

    async def timed(body: dict) -> Response:
        return Response(b"0123456789", headers={"Server-Timing": "parse;dur=1.500, compute;dur=20, total;dur=22.25"})

    app.add_api_route("/v1/limits", timed, methods=["POST"])  # a fixed path: its own route label
    with caplog.at_level("INFO", logger="splitkey.access"):
        r = request(app, "POST", "/v1/limits", json={"x": 1}, headers={"X-Request-Id": "rid-7"})
        request(app, "GET", "/made-up/ctx_secret")
    first, second = access_records(caplog)
    fields = first.fields  # type: ignore[attr-defined]
    assert r.status_code == 200
    assert {k: v for k, v in fields.items() if k != "duration_ms"} == {
        "method": "POST", "route": "/v1/limits", "status": 200, "bytes_in": len(b'{"x":1}'), "bytes_out": 10,
        "request_id": "rid-7", "stages_ms": {"parse": 1.5, "compute": 20.0, "total": 22.25}}
    assert 0 < fields["duration_ms"] < 10_000
    assert first.getMessage().startswith("POST /v1/limits 200 in=7 out=10 ")
    assert first.getMessage().endswith("ms id=rid-7 stages=parse=1.5,compute=20,total=22.25")
    # A path with no route is logged as its label, never as the path the client made up.
    assert second.fields["route"] == "unmatched" and second.fields["status"] == 404  # type: ignore[attr-defined]
    assert "ctx_secret" not in second.getMessage()


def test_requests_refused_before_the_app_are_logged_too(caplog, tmp_path):
    key = tmp_path / "key"
    key.write_text("k")
    key.chmod(0o600)
    app = create_app(ServiceSettings(api_key_file=key))
    with caplog.at_level("INFO", logger="splitkey.access"):
        assert request(app, "GET", "/v1/cluster").status_code == 401
    [line] = access_records(caplog)
    assert line.fields["status"] == 401 and line.fields["route"] == "/v1/cluster"  # type: ignore[attr-defined]


def test_above_info_no_access_line_is_made(caplog):
    app = create_app(ServiceSettings())
    with caplog.at_level("WARNING", logger="splitkey.access"):
        request(app, "GET", "/healthz")
    assert access_records(caplog) == []


def test_a_json_line_is_one_object_with_the_records_fields_and_its_traceback():
    formatter = logs.JsonFormatter()
    record = logging.LogRecord("splitkey.access", logging.INFO, __file__, 1, "GET %s", ("/healthz",), None)
    record.fields = {"status": 200, "message": "not overwritten"}
    line = json.loads(formatter.format(record))
    assert line["level"] == "info" and line["logger"] == "splitkey.access" and line["message"] == "GET /healthz"
    assert line["status"] == 200 and line["time"].endswith("+00:00")
    try:
        raise KeyError("boom")
    except KeyError:
        import sys

        record = logging.LogRecord("service.app", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    failed = json.loads(formatter.format(record))
    assert "\n" not in formatter.format(record) and "KeyError: 'boom'" in failed["exception"]


def test_configure_sets_the_format_and_level_of_the_root_logger(capsys):
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    try:
        logs.configure("json", "warning")
        logging.getLogger("service.x").info("hidden")
        logging.getLogger("service.x").warning("shown %d", 1)
        err = capsys.readouterr().err.strip().splitlines()
        assert [json.loads(line)["message"] for line in err] == ["shown 1"]
        logs.configure("text", "debug")
        logging.getLogger("service.x").debug("now shown")
        assert " DEBUG service.x: now shown" in capsys.readouterr().err
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.setLevel(saved[0])
        for handler in saved[1]:
            root.addHandler(handler)


def test_the_access_line_reads_server_timing_as_milliseconds_per_stage(caplog):
    with caplog.at_level("INFO", logger="splitkey.access"):
        for timing in (b"parse;dur=1.234, total;dur=2", b"cache;desc=hit, x;dur=oops, ;dur=3", b""):
            logs.access("POST", "/v1/attention", 200, 1, 2, 0.5, "rid", timing)
    stages = [line.fields["stages_ms"] for line in access_records(caplog)]  # type: ignore[attr-defined]
    assert stages == [{"parse": 1.234, "total": 2.0}, {}, {}]


def test_rays_own_lines_go_through_the_service_handler_at_warning_unless_debug_asks_for_them(caplog):
    import ray  # noqa: F401  (Ray installs its own stderr handler on the "ray" logger at import)

    from service.cluster.connect import route_ray_logs

    ray_log = logging.getLogger("ray")
    saved = (list(ray_log.handlers), ray_log.propagate, ray_log.level)
    try:
        route_ray_logs(verbose=False)
        assert ray_log.handlers == [] and ray_log.propagate and ray_log.level == logging.WARNING
        with caplog.at_level("INFO"):
            logging.getLogger("ray.worker").info("Started a local Ray instance.")
            logging.getLogger("ray.worker").warning("a Ray warning")
        assert [r.getMessage() for r in caplog.records if r.name.startswith("ray")] == ["a Ray warning"]
        route_ray_logs(verbose=True)
        assert ray_log.level == logging.INFO
    finally:
        for handler in saved[0]:
            ray_log.addHandler(handler)
        ray_log.propagate, ray_log.level = saved[1], saved[2]
