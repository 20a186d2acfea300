"""Operations: liveness, readiness, Prometheus metrics, cluster view, request limits."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from service.core.errors import error_responses
from service.core.metrics import build_labels
from service.routes.common import app_state
from service.runtime import AppState

router = APIRouter(tags=["operations"])
#: The content type of Prometheus' text format, as ``generate_latest`` writes it.
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


#: How long a probe (``/readyz``, ``/v2/health/ready``, ``/v1/cluster``) waits for the workers' pings. A
#: worker that has not answered by then (a hung one) is reported as its last ping found it, and the round
#: goes on without the probe: a probe must answer within an orchestrator's probe timeout (Kubernetes: 1 to
#: a few seconds, deploy/k8s/frontend.yaml), and every front end pinging the same hung worker must not
#: take every front end out of its Service.
PROBE_WAIT_S = 1.0
#: A probe's ping round: one at a time per pool, shared by the probes that come while it runs (pings to a
#: hung worker do not pile up), each ping bounded as the repair loop's are.
PROBE_PING_S = 5.0
_ROUNDS: weakref.WeakKeyDictionary[Any, asyncio.Future] = weakref.WeakKeyDictionary()


async def workers_ready(request: Request) -> tuple[int, int]:
    """``(alive, total)`` workers, pinging each first (``PROBE_WAIT_S`` at most; ``(0, 0)`` before the
    workers start)."""
    rt = app_state(request).runtime
    if rt is None:
        return 0, 0
    await pinged(rt.pool)
    return len(rt.pool.alive), rt.pool.size


async def pinged(pool: Any) -> None:
    """Wait up to ``PROBE_WAIT_S`` for a round of pings of ``pool`` (the one running, or a new one)."""
    round_ = _ROUNDS.get(pool)
    if round_ is None or round_.done():
        round_ = _ROUNDS[pool] = asyncio.ensure_future(pool.refresh(timeout_s=PROBE_PING_S))
        round_.add_done_callback(lambda f: f.cancelled() or f.exception())  # logged by refresh; never "unretrieved"
    await asyncio.wait({round_}, timeout=PROBE_WAIT_S)


@router.get("/healthz", summary="The process is alive")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


def can_serve(alive: int, total: int) -> bool:
    """Whether this front end can answer: Ray connected and a worker answering. One worker lost of several
    leaves inline requests and every context with a live replica servable, so readiness holds; what was
    lost is reported beside it (``degraded``, ``/metrics``), not by taking every front end out of service."""
    return total > 0 and alive > 0


#: The 503 of a readiness probe: its own body, not an error's (``ready`` false).
NOT_READY: dict[int | str, dict[str, Any]] = {503: {"description": "not ready (no worker answers, or the server is draining): the same body, "
                                  "with ready false"}}


@router.get("/readyz", summary="Ray is connected and a worker answers; lost capacity reported beside it",
            responses=NOT_READY)
async def readyz(request: Request) -> JSONResponse:
    alive, total = await workers_ready(request)
    state = app_state(request)
    draining = state.drain.draining
    ready = can_serve(alive, total) and not draining
    lost = state.runtime.repair.stats.lost_shards if state.runtime is not None else 0
    body = {"ready": ready, "workers": total, "alive": alive, "degraded": alive < total or lost > 0,
            "lost_shards": lost, **({"draining": True} if draining else {})}
    return JSONResponse(body, status_code=200 if ready else 503)


async def render_metrics(state: AppState) -> bytes:
    """The Prometheus text of this front end, with the cluster's state (workers, contexts, repair loop, record
    cache) read now: for ``/metrics`` and the separate metrics listener (service.metrics_listener)."""
    m, rt = state.metrics, state.runtime
    if rt is not None:
        alive = len(rt.pool.alive)
        m.workers.labels(state="alive").set(alive)
        m.workers.labels(state="dead").set(rt.pool.size - alive)
        for s in rt.pool.slots:
            m.worker_bytes.labels(worker=s.name).set(s.held.get("bytes_held", 0))
            m.worker_expired.set(s.held.get("expired", 0), s.name)
            if s.held.get("cpu_kernels") is not None:
                for kernel in ("numpy", "fused"):
                    m.worker_kernel.labels(worker=s.name, kernel=kernel).set(float(s.held["cpu_kernels"] == kernel))
                m.worker_kernel_since.labels(worker=s.name).set(s.held.get("cpu_kernels_since") or 0)
        m.contexts.set(await rt.contexts.count())
        stats = rt.repair.stats
        m.shards.labels(state="under_replicated").set(stats.under_replicated_shards)
        m.shards.labels(state="lost").set(stats.lost_shards)
        m.repairs.set(stats.replicas_rebuilt)
        m.repair_rounds.set(stats.rounds)
        cache = rt.contexts.cache
        m.record_cache_lookups.set(cache.hits, "hit")
        m.record_cache_lookups.set(cache.misses, "miss")
        m.record_cache_stale.set(cache.stale)
        m.record_cache_entries.set(len(cache))
    return m.render()


@router.get("/metrics", summary="Prometheus metrics (text format)", responses=error_responses(401))
async def metrics(request: Request) -> Response:
    return Response(await render_metrics(app_state(request)), media_type=METRICS_TYPE)


@router.get("/v1/cluster", summary="Workers, nodes, devices and bytes held",
            responses={**error_responses(401), 503: {"description": "no workers yet (starting or stopping): "
                                                                     "the same body, with no workers and no nodes"}})
async def cluster(request: Request) -> JSONResponse:
    rt = app_state(request).runtime
    if rt is None:
        return JSONResponse({"workers": [], "nodes": [], "device": None}, status_code=503)
    await pinged(rt.pool)
    pool = rt.pool
    workers = [{"name": s.name, "alive": s.alive, "node_id": s.node_id, "device": pool.device,
                "bytes_held": s.held.get("bytes_held", 0), "budget_bytes": s.info.get("budget_bytes", 0),
                "shards": s.held.get("shards", 0), "outstanding": s.outstanding,
                "calls": s.held.get("calls", 0), "channel_calls": s.held.get("channel_calls", 0),
                "channel": s.channel is not None and not s.channel.closed, "batches": s.held.get("batches", 0),
                "expired": s.held.get("expired", 0), "cancelled": s.held.get("cancelled", 0),
                "cpu_kernels": s.held.get("cpu_kernels"), "cpu_kernels_since": s.held.get("cpu_kernels_since")}
               for s in pool.slots]
    nodes = sorted({s.node_id for s in pool.slots if s.node_id})
    return JSONResponse({
        "version": build_labels()["version"],
        "device": pool.device,
        "workers": workers,
        "nodes": nodes,
        "bytes_held": sum(w["bytes_held"] for w in workers),
        "contexts": await rt.contexts.count(),
        "repair": rt.repair.stats.to_json(),
    })


@router.get("/v1/limits", summary="The request limits this server enforces", responses=error_responses(401))
async def limits(request: Request) -> JSONResponse:
    """docs/API.md section 8, as numbers: clients size their upload chunks from it."""
    return JSONResponse(app_state(request).limits.to_json())
