"""The FastAPI application: built from settings; its lifespan owns Ray and the workers.

Routes are thin (``service/routes/``): they read a body, decode it into a typed
request (``service.wire``), call a service object of the :class:`Runtime`, and
encode. Every error reaches the client through one place, :func:`service.core.errors.render`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import ray
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute, Match

from service.core import VERSION, request_id
from service.core.admission import Admission
from service.attention import AttentionService
from service.batch import BatchService
from service.cluster.connect import connect, disconnect, start_reaper
from service.cluster.orchestrator import Orchestrator
from service.cluster.pool import WorkerPool
from service.contexts.directory import Directory
from service.contexts.orphans import Orphans
from service.contexts.repair import Repairer
from service.contexts.service import ContextService
from service.core.drain import Drain
from service.core.errors import (
    InvalidOption,
    MethodNotAllowed,
    RouteNotFound,
    ServiceError,
    WorkersUnavailable,
    render,
)
from service.hot_routes import Handler, HotRoutes
from service.core.metrics import Metrics
from service.metrics_listener import metrics_listener
from service.middleware import FRONTEND, ServiceMiddleware
from service.routes import attention, batch, contexts, kserve, ops
from service import tracing
from service.tracing import TracingMiddleware
from service.runtime import AppState, Runtime
from service.core.settings import ServiceSettings
from service.wire.body import ClientClosed
from service.wire.rules import show

log = logging.getLogger(__name__)

#: What /metrics counts for a request whose client disconnected before its answer.
CLIENT_CLOSED = 499
#: The methods a 405's ``Allow`` may name, in the order it names them.
HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """:func:`_lifespan`, a start-up that fails kept as one line in ``AppState.startup_error``.

    What fails once Ray is up (the workers do not fit the cluster, ``--device gpu`` without
    one, an unusable ``--persist-dir``, the gRPC port taken) is the operator's to fix, and
    ``splitkey serve`` says it in one line (service.cli); anything else is logged with its
    traceback as well.
    """
    state: AppState = app.state.splitkey
    running = False
    try:
        async with metrics_listener(state), _lifespan(app):
            running = True
            yield
    except Exception as exc:
        if running:
            raise
        known = isinstance(exc, (ServiceError, OSError, ValueError, RuntimeError))
        state.startup_error = exc.detail if isinstance(exc, ServiceError) else (str(exc) or type(exc).__name__)
        if not known:
            log.exception("start-up failed")
        raise


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Ray, then the gRPC port (if asked for), then the worker pool and the services over it.

    The HTTP port was bound before all of it (service.cli.listen); the gRPC port is bound
    before the workers start, so that no worker's channel (an ephemeral port) can take it,
    but after ``ray.init``, which forks Ray's processes: gRPC's threads must not be running
    across those forks. Until the runtime is set, gRPC answers UNAVAILABLE, not ready.
    """
    state: AppState = app.state.splitkey
    settings = state.settings
    uvicorn_handlers = state.drain.saved_handlers()  # ray.init replaces them (service.core.drain)
    with state.drain.kept():  # a signal while Ray starts stops the server once it has (Drain.install)
        started = connect(settings)
    reaper = start_reaper(started)  # the embedded Ray follows this process even after a SIGKILL
    state.drain.install(uvicorn_handlers)
    grpc_server = None
    try:
        if settings.grpc_port is not None:
            from service import grpc_server as grpc_module  # grpcio only when asked for

            grpc_server, state.grpc_port = await grpc_module.start(state, settings.host, settings.grpc_port)
        detached = settings.ray_address is not None
        pool = await WorkerPool.start(settings, detached=detached)
        try:
            directory = await Directory.connect(settings, [s.name for s in pool.slots], detached=detached)
            orphans = Orphans(pool, directory)
            await orphans.sweep()  # before ready: contexts no holder has a record of leave the workers' memory
            healer = _serve(state, pool, directory, orphans)
            try:
                yield
            finally:
                if grpc_server is not None:  # in-flight gRPC calls finish while the workers are still there
                    await grpc_server.stop(grace=5.0)
                    grpc_server = None
                healer.cancel()
                # Its cleanup (a lease released on the directory) runs now, while Ray is still there:
                # left for later it ran after the disconnect, where a Ray call starts ray.init() and
                # the process hung instead of exiting.
                await asyncio.wait({healer}, timeout=HEALER_STOP_S)
                directory.close()  # a write the second signal left behind meets ShuttingDown, not Ray
                state.runtime = None
        finally:
            pool.shutdown()
    finally:
        if grpc_server is not None:  # the pool failed to start
            await grpc_server.stop(grace=None)
        disconnect(started)
        if reaper is not None:
            reaper.close()


#: How long shutdown waits for the repair loop's cancelled round to clean up.
HEALER_STOP_S = 10.0


def _serve(state: AppState, pool: WorkerPool, directory: Directory, orphans: Orphans) -> asyncio.Task:
    """The services over ``pool`` set as ``state.runtime``; the repairer's task."""
    settings = state.settings
    context_service = ContextService(settings, pool, directory)
    orchestrator = Orchestrator(pool, fanin=settings.merge_fanin, remote_merge_bytes=settings.remote_merge_bytes)
    repair = Repairer(pool, directory, context_service, orphans)
    attention_service = AttentionService(settings, pool, orchestrator, context_service)
    state.runtime = Runtime(pool=pool, attention=attention_service, contexts=context_service, repair=repair,
                            batch=BatchService(settings, pool, attention_service, context_service))
    state.metrics.workers.labels(state="alive").set(pool.size)
    log.info("splitkey workers up: %d %s workers; this front end is %s", pool.size, pool.device, FRONTEND)
    return asyncio.create_task(repair.run_forever(settings.heal_interval_s))


def _respond(err: ServiceError, request: Request) -> Response:
    status, body, headers = render(err, request.url.path)
    return Response(content=body, status_code=status, media_type="application/json", headers=headers)


def _fixed_paths(routes: Iterable[BaseRoute]) -> frozenset[str]:
    """The paths of ``routes`` without parameters (each its own route label in the metrics)."""
    return frozenset(p for p in (getattr(r, "path", "") for r in routes) if p and "{" not in p)


def create_app(settings: ServiceSettings | None = None, *, request_id_header: bool = True) -> FastAPI:
    """The app for ``settings``; ``request_id_header=False`` behind a proxy that sets ``X-Request-Id``
    itself (Ray Serve's passes its id in and writes it back on the response: service.serve)."""
    settings = settings or ServiceSettings()
    metrics = Metrics()
    app = FastAPI(
        title="splitkey",
        version=VERSION,
        summary="Exact split-key attention over HTTP.",
        description="See README.md and docs/API.md. Errors are JSON {detail, code}.",
        lifespan=lifespan,
        redirect_slashes=False,  # a path with a stray "/" is a 404 with a body, not a bare 307 to follow
        # The routes of docs/API.md section 6.1 only: /docs and /openapi.json, not FastAPI's ReDoc
        # page nor Swagger's OAuth2 redirect page (no OAuth2 here).
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
    )
    drain = Drain(settings.shutdown_grace_s)
    app.state.splitkey = AppState(settings=settings, limits=settings.limits(), pace=settings.pace(), metrics=metrics,
                                  drain=drain)

    async def _service_error(request: Request, exc: ServiceError) -> Response:
        return _respond(exc, request)

    async def _ray_error(request: Request, exc: ray.exceptions.RayError) -> Response:
        # A worker or actor failure no layer below turned into a service error: the
        # cluster is at fault, not the client, so 503 rather than 500.
        log.warning("request %s: Ray error reached the route: %s", request_id.current(), exc)
        return _respond(WorkersUnavailable("the cluster did not answer (a worker or Ray failed: the server's log "
                                           "names the error under this request's id); send it again"), request)

    async def _client_closed(request: Request, exc: Exception) -> Response:
        # The client went away mid-request: not the service's fault, nobody to answer. Status
        # 499 (nginx's "client closed request") is what /metrics counts; the log says it at INFO.
        log.info("request %s: client closed the connection during %s %s", request_id.current(), request.method,
                 request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    async def _no_route(request: Request, exc: StarletteHTTPException) -> Response:
        # The router's own answers, for a path or a method no route takes: in the service's words,
        # with a code, as every other error (docs/API.md section 7).
        path = show(request.url.path)
        if exc.status_code == 404:
            return _respond(RouteNotFound(f"path must be one of the service's routes (docs/API.md section 6.1), "
                                          f"got {path}"), request)
        if exc.status_code == 405:
            # Starlette's Allow names the methods of the first route matching the path; several may
            # (GET and DELETE of /v1/contexts/{id} are two routes): every method some route takes here.
            methods = [m for m in HTTP_METHODS
                       if any(route.matches({**request.scope, "method": m})[0] == Match.FULL
                              for route in request.app.router.routes)]
            allow = ", ".join(methods) or (exc.headers or {}).get("Allow", "")
            return _respond(MethodNotAllowed(f"method must be one of {allow} for {path}, got {show(request.method)}",
                                             allow), request)
        return await http_exception_handler(request, exc)

    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": ["body"], "msg": "invalid"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
        return _respond(InvalidOption(f"{where or 'request'} must be valid: {first.get('msg')}"), request)

    # The one table from exceptions to answers: FastAPI's routes and the hot routes (service.hot_routes) use it.
    handlers: dict[type[Exception], Handler] = {
        ServiceError: _service_error,
        ray.exceptions.RayError: _ray_error,
        ClientDisconnect: _client_closed,
        ClientClosed: _client_closed,
        RequestValidationError: _validation,
        StarletteHTTPException: _no_route,
    }
    for exc_class, handler in handlers.items():
        app.add_exception_handler(exc_class, handler)

    routers = (ops.router, attention.router, batch.router, contexts.router, kserve.router)
    for router in routers:
        app.include_router(router)
    admission = Admission(max_inflight=settings.max_inflight, max_inflight_bytes=settings.max_inflight_bytes,
                          retry_after_s=settings.retry_after_s, metrics=metrics)
    app.state.splitkey.admission = admission
    # Added first, so it runs inside ServiceMiddleware (the last added is the outermost).
    app.add_middleware(HotRoutes, routes={("POST", attention.ROUTE): attention.attention,
                                          ("POST", batch.ROUTE): batch.attention_batch,
                                          ("POST", kserve.ROUTE): kserve.infer,
                                          ("POST", kserve.VERSIONED_INFER): kserve.infer},
                       handlers=handlers)
    paths = _fixed_paths([*app.routes, *(r for router in routers for r in router.routes)])
    app.add_middleware(ServiceMiddleware, api_key=settings.api_key(), admission=admission, drain=drain,
                       metrics=metrics, request_id_header=request_id_header, paths=paths)
    if (tracer := tracing.from_env()) is not None:  # an OTLP endpoint set and the otel extra installed
        app.add_middleware(TracingMiddleware, tracer=tracer, paths=paths)
    return app
