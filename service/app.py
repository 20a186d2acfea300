"""The FastAPI application: built from settings, its lifespan owns Ray and the workers.

Routes are thin (``service/routes/``): they parse, call a service object held in
``app.state.splitkey`` (:class:`Runtime`), and encode. Nothing here is global: two
apps with different settings can live in one process (tests do that for the
settings that need no Ray).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from service.attention import AttentionService
from service.contexts import ContextService, Directory
from service.errors import ApiError, error_body
from service.metrics import Metrics
from service.middleware import ServiceMiddleware
from service.orchestrator import Orchestrator
from service.pool import WorkerPool
from service.settings import ServiceSettings

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """What the lifespan builds and the routes use."""

    settings: ServiceSettings
    metrics: Metrics
    pool: WorkerPool | None = None
    attention: AttentionService | None = None
    contexts: ContextService | None = None


def init_ray(settings: ServiceSettings) -> bool:
    """Start an embedded Ray (loopback, no dashboard) or join a cluster; True if we started it."""
    if ray.is_initialized():
        return False
    if settings.ray_address is None:
        # address="local" always starts a new instance: without it ray.init() connects to
        # whatever /tmp/ray/ray_current_cluster or RAY_ADDRESS names (a user's `ray start`
        # cluster, or a dead one a killed process left behind), and embedded would not be.
        ray.init(address="local", namespace=settings.ray_namespace, include_dashboard=False,
                 _node_ip_address="127.0.0.1",
                 logging_level=logging.WARNING, log_to_driver=False, configure_logging=False)
        return True
    ray.init(address=settings.ray_address, namespace=settings.ray_namespace, logging_level=logging.WARNING,
             log_to_driver=False, configure_logging=False)
    return False


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    rt: Runtime = app.state.splitkey
    settings = rt.settings
    started = init_ray(settings)
    detached = settings.ray_address is not None
    pool = await WorkerPool.start(settings, detached=detached)
    orch = Orchestrator(pool, fanin=settings.merge_fanin, remote_merge_bytes=settings.remote_merge_bytes)
    directory = await Directory.connect(settings, pool, detached=detached)
    rt.pool = pool
    rt.contexts = ContextService(settings, pool, directory)
    rt.attention = AttentionService(settings, orch, rt.contexts)
    rt.metrics.workers.labels(state="alive").set(pool.size)
    log.info("splitkey ready: %d %s workers", pool.size, pool.device)
    healer = asyncio.create_task(heal_forever(pool, settings.heal_interval_s))
    try:
        yield
    finally:
        healer.cancel()
        pool.shutdown()
        if started:
            ray.shutdown()


async def heal_forever(pool: WorkerPool, interval_s: float) -> None:
    """Replace workers that were found dead (their resident shards are gone; replicas cover them)."""
    while True:
        await asyncio.sleep(interval_s)
        if any(not s.alive for s in pool.slots):
            try:
                replaced = await pool.heal()
                if replaced:
                    log.warning("replaced dead workers: %s", ", ".join(replaced))
            except Exception:  # the loop must outlive one failed attempt
                log.exception("healing the worker pool failed")


def create_app(settings: ServiceSettings | None = None) -> FastAPI:
    settings = settings or ServiceSettings()
    metrics = Metrics()
    app = FastAPI(
        title="splitkey",
        version="0.1.0",
        summary="Exact split-key attention over HTTP.",
        description="See README.md and docs/SERVICE.md. Errors are JSON {detail, code}.",
        lifespan=lifespan,
    )
    app.state.splitkey = Runtime(settings=settings, metrics=metrics)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Any:
        return _error_response(exc)

    @app.exception_handler(ray.exceptions.RayError)
    async def _ray_error(_: Request, exc: ray.exceptions.RayError) -> Any:
        # A worker or actor failure that no layer below turned into a contract error:
        # the cluster is at fault, not the client, so 503 rather than 500.
        log.warning("Ray error reached the route: %s", exc)
        return _error_response(ApiError("workers_unavailable", f"the cluster must answer, got {type(exc).__name__}"))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Any:
        first = exc.errors()[0] if exc.errors() else {"loc": ["body"], "msg": "invalid"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
        return _error_response(ApiError("invalid_option", f"{where or 'request'} must be valid: {first.get('msg')}"))

    from service.routes import attention, contexts, kserve, ops  # here: the routes import this module's types

    app.include_router(ops.router)
    app.include_router(attention.router)
    app.include_router(contexts.router)
    app.include_router(kserve.router)
    app.add_middleware(ServiceMiddleware, api_key=settings.api_key(), max_inflight=settings.max_inflight,
                       retry_after_s=settings.retry_after_s, metrics=metrics)
    return app


def _error_response(exc: ApiError) -> Response:
    return Response(content=error_body(exc), status_code=exc.status, media_type="application/json",
                    headers=exc.headers)
