"""Operations: liveness, readiness, Prometheus metrics, cluster view."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

router = APIRouter(tags=["operations"])


@router.get("/healthz", summary="The process is alive")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz", summary="Ray is connected and every worker answers")
async def readyz(request: Request) -> JSONResponse:
    rt = request.app.state.splitkey
    if rt.pool is None:
        return JSONResponse({"ready": False, "workers": 0, "alive": 0}, status_code=503)
    await rt.pool.refresh(timeout_s=5.0)
    alive = sum(s.alive for s in rt.pool.slots)
    ready = alive == rt.pool.size
    return JSONResponse({"ready": ready, "workers": rt.pool.size, "alive": alive}, status_code=200 if ready else 503)


@router.get("/metrics", summary="Prometheus metrics (text format)")
async def metrics(request: Request) -> Response:
    rt = request.app.state.splitkey
    if rt.pool is not None:
        alive = sum(s.alive for s in rt.pool.slots)
        rt.metrics.workers.labels(state="alive").set(alive)
        rt.metrics.workers.labels(state="dead").set(rt.pool.size - alive)
        for s in rt.pool.slots:
            rt.metrics.worker_bytes.labels(worker=s.name).set(s.info.get("bytes_held", 0))
    return Response(rt.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/cluster", summary="Workers, nodes, devices and bytes held")
async def cluster(request: Request) -> JSONResponse:
    rt = request.app.state.splitkey
    if rt.pool is None:
        return JSONResponse({"workers": [], "nodes": [], "device": None}, status_code=503)
    await rt.pool.refresh(timeout_s=5.0)
    workers = [{"name": s.name, "alive": s.alive, "node_id": s.node_id, "device": rt.pool.device,
                "bytes_held": s.info.get("bytes_held", 0), "budget_bytes": s.info.get("budget_bytes", 0),
                "shards": s.info.get("shards", 0), "outstanding": s.outstanding} for s in rt.pool.slots]
    nodes = sorted({s.node_id for s in rt.pool.slots if s.node_id})
    return JSONResponse({
        "device": rt.pool.device,
        "workers": workers,
        "nodes": nodes,
        "bytes_held": sum(w["bytes_held"] for w in workers),
        "contexts": len(await rt.contexts.list()) if rt.contexts is not None else 0,
    })
