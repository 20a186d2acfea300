"""Resident contexts: create, append, list, describe, delete (docs/CONTEXTS.md)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.codec import CONTEXT_APPEND, CONTEXT_CREATE, CONTEXT_ID
from service.errors import ApiError, error_responses
from service.json_codec import ContextAppendRequest, ContextCreateRequest
from service.orchestrator import Timings
from service.routes.common import read_request, runtime, without_deadline

router = APIRouter(tags=["contexts"])


def _body_doc(model: type) -> dict:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()},
        "application/octet-stream": {"schema": {"type": "string", "format": "binary",
                                                "description": "safetensors: k, v, optional k_pos"}}}}}


def _check_id(ctx_id: str) -> str:
    if not CONTEXT_ID.fullmatch(ctx_id) or len(ctx_id) > 128:
        raise ApiError("context_not_found", f"id must name an existing context, got {ctx_id[:64]!r}")
    return ctx_id


@router.post("/v1/contexts", status_code=201, summary="Store k, v on the workers",
             responses=error_responses(400, 401, 413, 415, 422, 429, 503, 507), openapi_extra=_body_doc(ContextCreateRequest))
async def create_context(request: Request) -> JSONResponse:
    rt = runtime(request)
    _, tensors, options, _ = await read_request(request, CONTEXT_CREATE, Timings())
    desc = await without_deadline(rt.contexts.create(tensors["k"], tensors["v"], tensors.get("k_pos"),
                                                     replicas=options.get("replicas"), shards=options.get("shards")))
    return JSONResponse(desc, status_code=201, headers={"Location": f"/v1/contexts/{desc['id']}"})


@router.post("/v1/contexts/{ctx_id}/append", summary="Append k, v to a context",
             responses=error_responses(400, 401, 404, 413, 415, 422, 429, 503, 507), openapi_extra=_body_doc(ContextAppendRequest))
async def append_context(ctx_id: str, request: Request) -> JSONResponse:
    rt = runtime(request)
    _check_id(ctx_id)
    _, tensors, _, _ = await read_request(request, CONTEXT_APPEND, Timings())
    desc = await without_deadline(rt.contexts.append(ctx_id, tensors["k"], tensors["v"], tensors.get("k_pos")))
    return JSONResponse(desc)


@router.get("/v1/contexts", summary="List contexts", responses=error_responses(401))
async def list_contexts(request: Request) -> JSONResponse:
    return JSONResponse({"contexts": await runtime(request).contexts.list()})


@router.get("/v1/contexts/{ctx_id}", summary="Describe a context", responses=error_responses(401, 404))
async def get_context(ctx_id: str, request: Request) -> JSONResponse:
    return JSONResponse(await runtime(request).contexts.get(_check_id(ctx_id)))


@router.delete("/v1/contexts/{ctx_id}", summary="Free a context", responses=error_responses(401, 404))
async def delete_context(ctx_id: str, request: Request) -> JSONResponse:
    rt = runtime(request)
    desc = await without_deadline(rt.contexts.delete(_check_id(ctx_id)))
    return JSONResponse({"id": desc["id"], "deleted": True, "length": desc["length"]})
