"""The app's one error boundary, in process (no Ray started: the lifespan does not run here)."""

import asyncio

import httpx
import pytest
import ray

from service.app import create_app
from service.middleware import ServiceMiddleware
from service.core.settings import ServiceSettings


def request(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://splitkey") as c:
            return await c.request(method, path, **kwargs)

    return asyncio.run(go())


def test_a_ray_error_reaching_a_route_is_503_with_the_protocol_key_on_kserve_routes():
    app = create_app(ServiceSettings())

    async def failing() -> None:
        raise ray.exceptions.RaySystemError("worker gone")

    app.add_api_route("/v1/boom", failing)
    app.add_api_route("/v2/models/attention/boom", failing)
    detail = ("the cluster did not answer (a worker or Ray failed: the server's log names the error under this "
              "request's id); send it again")
    r = request(app, "GET", "/v1/boom")
    rid = r.headers["x-request-id"]
    assert r.status_code == 503 and r.json() == {"detail": detail, "code": "workers_unavailable", "request_id": rid}
    r = request(app, "GET", "/v2/models/attention/boom")
    rid = r.headers["x-request-id"]
    assert r.status_code == 503 and r.json() == {"error": detail, "detail": detail, "code": "workers_unavailable",
                                                 "request_id": rid}


def test_a_fault_of_the_service_is_500_naming_the_request_id_and_the_log_has_the_traceback(caplog):
    app = create_app(ServiceSettings())

    async def buggy() -> None:
        raise KeyError("/work/main/service/secret.py pid=1234")

    app.add_api_route("/v1/attention/buggy", buggy)
    with caplog.at_level("ERROR", logger="service.middleware"):
        r = request(app, "GET", "/v1/attention/buggy", headers={"X-Request-Id": "client-chose-7"})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.headers["x-request-id"] == "client-chose-7"
    assert r.json() == {"detail": "the service failed on this request; the server log has the details under request "
                                  "id client-chose-7", "code": "internal_error", "request_id": "client-chose-7"}
    assert "client-chose-7" in caplog.text and "Traceback" in caplog.text and "secret.py" in caplog.text


def test_every_response_carries_a_request_id_fresh_per_request():
    app = create_app(ServiceSettings())
    ids = {request(app, "GET", "/healthz").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3 and all(len(i) == 16 for i in ids)


def test_requests_before_the_workers_start_are_503_and_probes_say_not_ready():
    app = create_app(ServiceSettings())
    r = request(app, "POST", "/v1/attention", json={"q": [[[1.0]]], "k": [[[1.0]]], "v": [[[1.0]]]})
    assert r.status_code == 503 and r.json()["code"] == "workers_unavailable"
    r = request(app, "POST", "/v2/models/attention/infer", json={"inputs": []})
    assert r.status_code == 503 and r.json()["error"] == r.json()["detail"]
    assert request(app, "GET", "/readyz").status_code == 503
    assert request(app, "GET", "/healthz").json() == {"status": "ok"}


def test_admission_control_answers_429_with_a_retry_after_of_at_least_a_second():
    app = create_app(ServiceSettings(max_inflight=1, retry_after_s=1))
    started = asyncio.Event()

    async def slow() -> dict:  # a route without a body is admitted as it comes
        started.set()
        await asyncio.sleep(0.5)
        return {}

    app.add_api_route("/v1/attention/slow", slow)
    # The middleware knows the app's routes from create_app (a path without one is a 404 that
    # takes no slot): tell it of this one, before the first request builds the middleware stack.
    [mw] = [m for m in app.user_middleware if m.cls is ServiceMiddleware]
    mw.kwargs["paths"] = mw.kwargs["paths"] | {"/v1/attention/slow"}

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://splitkey") as c:
            first = asyncio.create_task(c.get("/v1/attention/slow"))
            await started.wait()
            second = await c.get("/v2/models/attention/ready")
            return await first, second

    first, second = asyncio.run(go())
    assert first.status_code == 200
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert second.json()["code"] == "overloaded" and second.json()["error"] == second.json()["detail"]


def test_requests_to_paths_without_a_route_share_one_metrics_label():
    app = create_app(ServiceSettings())
    for i in range(3):
        assert request(app, "GET", f"/made-up-{i}").status_code == 404
    request(app, "GET", "/healthz")
    text = request(app, "GET", "/metrics").text
    assert 'splitkey_requests_total{code="404",route="unmatched"} 3.0' in text
    assert 'route="/healthz"' in text and "made-up" not in text


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("PATCH", "/v1/contexts/ctx_a", "DELETE, GET"),  # two routes on one path: both named
    ("PUT", "/v1/contexts", "GET, POST"),
    ("DELETE", "/v1/contexts", "GET, POST"),
    ("GET", "/v1/attention", "POST"),
    ("HEAD", "/v1/contexts", "GET, POST"),  # no route takes HEAD: a 405 names what they take
])
def test_method_not_allowed_names_every_method_the_path_takes(method, path, allow):
    app = create_app(ServiceSettings())
    r = request(app, method, path)
    assert r.status_code == 405 and r.headers["allow"] == allow, r.text
    if method != "HEAD":  # a HEAD answer has no body
        assert r.json()["code"] == "method_not_allowed" and f"method must be one of {allow} for" in r.json()["detail"]


@pytest.mark.parametrize("path", ["/v1/contexts/", "/healthz/", "/v1/limits/"])
def test_a_trailing_slash_is_a_404_with_a_body_not_a_redirect(path):
    app = create_app(ServiceSettings())
    r = request(app, "GET", path)
    assert r.status_code == 404 and r.json()["code"] == "route_not_found" and path in r.json()["detail"], r.text


def test_only_the_documented_description_routes_answer_not_fastapis_other_pages():
    """API.md section 6.1: /docs and /openapi.json; any other path is 404 (an outside probe found
    FastAPI's /redoc and /docs/oauth2-redirect answering 200)."""
    app = create_app(ServiceSettings())
    assert request(app, "GET", "/docs").status_code == 200 and request(app, "GET", "/openapi.json").status_code == 200
    for path in ("/redoc", "/docs/oauth2-redirect"):
        r = request(app, "GET", path)
        assert r.status_code == 404 and r.json()["code"] == "route_not_found", (path, r.text)


@pytest.mark.parametrize("path", ["/v2/models/attention/zzz", "/v2/models/other", "/v2/models/other/infer",
                                  "/v2/models/attention/versions/2/infer", "/v1/contexts/a/b", "/v1/contexts/a/append/x"])
def test_paths_without_a_route_under_models_and_contexts_count_as_unmatched(path):
    app = create_app(ServiceSettings())
    assert request(app, "GET", path).status_code in (404, 405)
    text = request(app, "GET", "/metrics").text
    assert 'route="unmatched"' in text and 'route="/v2/models/attention' not in text and "{id}" not in text


@pytest.mark.parametrize("path, label", [
    ("/v2/models/attention/infer", "/v2/models/attention/infer"),
    ("/v2/models/attention/versions/1/infer", "/v2/models/attention/infer"),
    ("/v2/models/attention/versions/1/ready", "/v2/models/attention"),
    ("/v2/models/attention", "/v2/models/attention"),
    ("/v1/contexts/ctx_1", "/v1/contexts/{id}"),
    ("/v1/contexts/ctx_1/append", "/v1/contexts/{id}/append"),
    ("/healthz", "/healthz"),
])
def test_route_labels_name_the_route_with_ids_and_versions_folded(path, label):
    app = create_app(ServiceSettings())
    request(app, "POST" if path.endswith("/infer") else "GET", path)
    text = request(app, "GET", "/metrics").text
    assert f'route="{label}"' in text and 'route="unmatched"' not in text


def test_the_schema_declares_401_behind_the_key_and_503_on_the_readiness_probes():
    """Every operation of /openapi.json but the four open health probes answers 401 without the key, and
    says so; the readiness probes answer 503 while not ready (an outside walkthrough found both missing)."""
    from service.middleware import OPEN_PATHS

    spec = create_app(ServiceSettings()).openapi()
    operations = [(path, method, op) for path, ops in spec["paths"].items() for method, op in ops.items()]
    assert len(operations) >= 17
    for path, method, op in operations:
        assert ("401" in op["responses"]) is (path not in OPEN_PATHS), (method, path)
    for path in ("/readyz", "/v2/health/ready", "/v2/models/attention/ready", "/v2/models/attention/versions/1/ready"):
        assert "503" in spec["paths"][path]["get"]["responses"], path
    for path, method, op in operations:  # a body that arrives too slowly is cut with 408 on every route with one
        assert ("408" in op["responses"]) is (method == "post"), (method, path)
    for path in ("/v2/models/attention/versions/1", "/v2/models/attention/versions/1/infer"):  # live routes, described
        assert path in spec["paths"], path
