"""The app's one error boundary, in process (no Ray started: the lifespan does not run here)."""

import asyncio

import httpx
import ray

from service.app import create_app
from service.settings import ServiceSettings


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
    detail = "the cluster must answer, got RaySystemError"
    r = request(app, "GET", "/v1/boom")
    assert r.status_code == 503 and r.json() == {"detail": detail, "code": "workers_unavailable"}
    r = request(app, "GET", "/v2/models/attention/boom")
    assert r.status_code == 503 and r.json() == {"error": detail, "detail": detail, "code": "workers_unavailable"}


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

    async def slow() -> dict:
        started.set()
        await asyncio.sleep(0.5)
        return {}

    app.add_api_route("/v1/attention/slow", slow)

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
