"""Resident contexts: create, append, list, describe, delete (docs/CONTEXTS.md)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.cluster.channel import staged_writes
from service.core.errors import ContextNotFound, InvalidOption, error_responses
from service.routes.common import Exchange, app_state, decode_body, off_loop, runtime, to_completion
from service.runtime import AppState
from service.wire.json_codec import ContextAppendRequestModel, ContextCreateRequestModel, ContextWriteModel
from service.wire.negotiation import Format, request_format
from service.wire.request import ContextWrite, context_write
from service.wire.rules import CONTEXT_APPEND, CONTEXT_CREATE, UPLOAD_ID, BodyKind, Limits, is_context_id, show

router = APIRouter(tags=["contexts"])

ROUTE = "/v1/contexts"
APPEND_ROUTE = ROUTE + "/{id}/append"  #: as ``service.middleware.route_label`` names it


def _body_doc(model: type[ContextWriteModel]) -> dict:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()},
        "application/octet-stream": {"schema": {"type": "string", "format": "binary",
                                                "description": "safetensors: k, v, optional k_pos"}}}}}


#: Characters of an invalid context id that a 404's detail quotes.
ID_SHOWN = 64


def _check_id(state: AppState, ctx_id: str) -> str:
    if not is_context_id(ctx_id, state.limits):
        cut = f"... ({len(ctx_id)} characters)" if len(ctx_id) > ID_SHOWN else ""  # a long id is cut, and says so
        raise ContextNotFound(f"id must name an existing context, got {ctx_id[:ID_SHOWN]!r}{cut}")
    return ctx_id


async def _write(ex: Exchange, kind: BodyKind) -> ContextWrite:
    with ex.timings.measure("parse"):
        fmt = request_format(ex.request.headers.get("content-type"))
        body = await ex.body(fmt)
        return await off_loop(len(body), _decode, fmt, body, ex.request.query_params, kind, ex.state.limits)


def _decode(fmt: Format, body: memoryview, query: object, kind: BodyKind, limits: Limits) -> ContextWrite:
    return context_write(decode_body(fmt, body, query, kind, limits))


@router.post(ROUTE, status_code=201, summary="Store k, v on the workers",
             responses=error_responses(400, 401, 408, 413, 415, 422, 429, 503, 507),
             openapi_extra=_body_doc(ContextCreateRequestModel))
async def create_context(request: Request) -> JSONResponse:
    ex = Exchange.begin(request, read=False)
    write = await _write(ex, CONTEXT_CREATE)
    with staged_writes():  # the keys go to the workers over their write channels (service.cluster.pool.Staged)
        desc = await to_completion(ex.rt.contexts.create(write, ex.timings))
    return ex.finish(ROUTE, JSONResponse(desc, status_code=201, headers={"Location": f"{ROUTE}/{desc['id']}"}))


@router.post(ROUTE + "/{ctx_id}/append", summary="Append k, v to a context",
             responses=error_responses(400, 401, 404, 408, 409, 413, 415, 422, 429, 503, 507),
             openapi_extra=_body_doc(ContextAppendRequestModel))
async def append_context(ctx_id: str, request: Request) -> JSONResponse:
    ex = Exchange.begin(request, read=False)
    _check_id(ex.state, ctx_id)
    write = await _write(ex, CONTEXT_APPEND)
    with staged_writes():
        desc = await to_completion(ex.rt.contexts.append(ctx_id, write, ex.timings))
    return ex.finish(APPEND_ROUTE, JSONResponse(desc))


@router.get(ROUTE, summary="List contexts", responses=error_responses(401))
async def list_contexts(request: Request) -> JSONResponse:
    return JSONResponse({"contexts": await runtime(request).contexts.describe_all()})


@router.get(ROUTE + "/{ctx_id}", summary="Describe a context", responses=error_responses(401, 404, 422))
async def get_context(ctx_id: str, request: Request) -> JSONResponse:
    """``?upload=ID`` adds where that chunked upload's keys are (docs/CONTEXTS.md, "Uploading long contexts")."""
    upload = request.query_params.get("upload")
    if upload is not None and not UPLOAD_ID.fullmatch(upload):
        raise InvalidOption(f"upload must be 1 to 64 characters A-Z a-z 0-9 _ -, got {show(upload)}")
    return JSONResponse(await runtime(request).contexts.get(_check_id(app_state(request), ctx_id), upload))


@router.delete(ROUTE + "/{ctx_id}", summary="Free a context", responses=error_responses(401, 404))
async def delete_context(ctx_id: str, request: Request) -> JSONResponse:
    desc = await to_completion(runtime(request).contexts.delete(_check_id(app_state(request), ctx_id)))
    return JSONResponse({"id": desc["id"], "deleted": True, "length": desc["length"]})
