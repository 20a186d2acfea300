"""The hot routes' direct dispatch (service.hot_routes), in process: the same answers as FastAPI's.

The endpoints themselves, with live workers, are tested end to end (test_service_attention,
test_service_batch, test_service_kserve), all through this dispatch.
"""

import asyncio

import httpx
import pytest
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.app import create_app
from service.core.errors import ContextNotFound, ServiceError
from service.hot_routes import HotRoutes
from service.routes import attention, batch, kserve
from service.core.settings import ServiceSettings


def send(app, method: str, path: str, *, root_path: str = "", **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://splitkey") as c:
            return await c.request(method, path, **kwargs)

    return asyncio.run(go())


def hot_table(app) -> dict:
    (mw,) = [m for m in app.user_middleware if m.cls is HotRoutes]
    return mw.kwargs["routes"]


def without_hot_routes(app):
    """The same app with the direct dispatch emptied: every request through FastAPI's routing."""
    hot_table(app).clear()
    return app


def test_every_hot_route_is_the_endpoint_fastapi_declares_for_it():
    app = create_app(ServiceSettings())
    declared = {(method, r.path): r.endpoint for router in (attention.router, batch.router, kserve.router)
                for r in router.routes if isinstance(r, APIRoute) for method in r.methods}
    table = hot_table(app)
    assert {path for _, path in table} == {"/v1/attention", "/v1/attention/batch", "/v2/models/attention/infer",
                                           "/v2/models/attention/versions/1/infer"}
    for key, endpoint in table.items():
        assert declared[key] is endpoint


@pytest.mark.parametrize("path, body", [
    ("/v1/attention", {"json": {"q": [[[1.0]]], "k": [[[1.0]]], "v": [[[1.0]]]}}),
    ("/v1/attention/batch", {"json": {"items": []}}),
    ("/v2/models/attention/infer", {"json": {"inputs": []}}),
    ("/v1/attention", {"content": b"\x00" * 8, "headers": {"content-type": "application/octet-stream"}}),
])
def test_a_hot_route_answers_what_fastapi_answers(path, body):
    # Before the workers start every work route is 503: the answer comes through the handler table.
    hot, plain = send(create_app(ServiceSettings()), "POST", path, **body), \
        send(without_hot_routes(create_app(ServiceSettings())), "POST", path, **body)
    assert hot.status_code == plain.status_code == 503
    strip = {"x-request-id", "x-splitkey-frontend"}
    assert {k: v for k, v in hot.headers.items() if k not in strip} == \
           {k: v for k, v in plain.headers.items() if k not in strip}
    hot_body, plain_body = hot.json(), plain.json()
    assert hot_body.pop("request_id") == hot.headers["x-request-id"]
    assert plain_body.pop("request_id") == plain.headers["x-request-id"]
    assert hot_body == plain_body


def test_other_methods_and_paths_near_a_hot_route_go_to_fastapi():
    app = create_app(ServiceSettings())
    for method, path in (("GET", "/v1/attention"), ("PUT", "/v1/attention/batch")):
        r = send(app, method, path)
        assert r.status_code == 405 and r.json()["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
    r = send(app, "POST", "/v1/attention/", json={})
    assert r.status_code == 404 and r.json()["code"] == "route_not_found"  # the router's (no slash redirect: create_app)


def dispatch(endpoint, handlers=None) -> HotRoutes:
    async def fallback(scope, receive, send_message) -> None:
        await JSONResponse({"from": "fallback"})(scope, receive, send_message)

    return HotRoutes(fallback, routes={("POST", "/x"): endpoint}, handlers=handlers or {})


def test_an_exception_is_answered_by_the_handler_of_its_nearest_registered_class():
    async def missing(request: Request) -> Response:
        raise ContextNotFound("context 'c' must exist, got none")

    async def by_service_error(request: Request, exc: Exception) -> Response:
        return JSONResponse({"handler": "ServiceError", "type": type(exc).__name__}, status_code=418)

    async def by_exception(request: Request, exc: Exception) -> Response:
        return JSONResponse({"handler": "Exception"}, status_code=500)

    app = dispatch(missing, {Exception: by_exception, ServiceError: by_service_error})
    r = send(app, "POST", "/x")
    assert r.status_code == 418 and r.json() == {"handler": "ServiceError", "type": "ContextNotFound"}
    assert send(app, "POST", "/y").json() == {"from": "fallback"}


def test_an_exception_without_a_handler_propagates():
    async def buggy(request: Request) -> Response:
        raise KeyError("bug")

    with pytest.raises(KeyError, match="bug"):
        send(dispatch(buggy), "POST", "/x")


def test_the_route_is_matched_below_the_root_path_a_proxy_mounts_the_app_at():
    async def ok(request: Request) -> Response:
        return JSONResponse({"path": request.url.path})

    app = dispatch(ok)
    assert send(app, "POST", "/prefix/x", root_path="/prefix").json() == {"path": "/prefix/x"}
    assert send(app, "POST", "/prefixx", root_path="/prefix").json() == {"from": "fallback"}
