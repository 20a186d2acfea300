"""The Open Inference Protocol (KServe v2) for Triton and KServe clients; see docs/KSERVE.md.

One model, ``attention`` (version ``1``), over the same ``AttentionService`` as
``POST /v1/attention``. Decoding and encoding are in ``service.wire.kserve``;
errors are written by ``service.core.errors.render``, which adds the protocol's
``error`` key on these routes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from service.attention import KSERVE_BINARY, JsonAnswerLimit
from service.core.errors import error_responses
from service.routes.common import Exchange, app_state, off_loop
from service.routes.ops import NOT_READY, can_serve, workers_ready
from service.wire.json_text import write_json
from service.wire.kserve import (
    MODEL_NAME,
    MODEL_VERSION,
    InferRequest,
    decode_infer_request,
    header_length,
    infer_response,
    model_metadata,
    response_body,
    server_metadata as metadata_of_server,
)
from service.wire.request import AttentionRequest, attention_request
from service.wire.rules import Limits, refuse_query

router = APIRouter(tags=["kserve"])

ROUTE = "/v2/models/attention/infer"
#: The binary tensor extension's header: bytes of JSON at the start of the body.
HEADER = "Inference-Header-Content-Length"
MODEL = f"/v2/models/{MODEL_NAME}"
VERSIONED = f"{MODEL}/versions/{MODEL_VERSION}"
#: The versioned inference path (``ROUTE`` is the unversioned one, and the metrics' label of both).
VERSIONED_INFER = f"{VERSIONED}/infer"


def _decode(body: memoryview, header_len: int | None, query: Mapping[str, str], limits: Limits
            ) -> tuple[InferRequest, AttentionRequest]:
    refuse_query(query, "a KServe infer request")  # its parameters travel in the body
    parsed = decode_infer_request(body, header_len, limits)
    return parsed, attention_request(parsed.decoded)


async def _ready(request: Request) -> bool:
    """Ray connected, a worker answering a ping and the server not draining (as ``GET /readyz``,
    ``service.routes.ops.can_serve``): a load balancer stops sending to a server that drains."""
    alive, total = await workers_ready(request)
    return can_serve(alive, total) and not app_state(request).drain.draining


@router.get("/v2", summary="Server metadata (KServe v2)", responses=error_responses(401))
async def server_metadata() -> JSONResponse:
    return JSONResponse(metadata_of_server())


@router.get("/v2/health/live", summary="The process is alive (KServe v2)")
async def live() -> JSONResponse:
    return JSONResponse({"live": True})


@router.get("/v2/health/ready", summary="A worker answers (KServe v2)", responses=NOT_READY)
async def ready(request: Request) -> JSONResponse:
    ok = await _ready(request)
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


@router.get(f"{MODEL}/ready", summary="The attention model is ready (KServe v2)",
            responses={**error_responses(401), **NOT_READY})
@router.get(f"{VERSIONED}/ready", summary="Version 1 of the attention model is ready (KServe v2)",
            responses={**error_responses(401), **NOT_READY})
async def model_ready(request: Request) -> JSONResponse:
    ok = await _ready(request)
    return JSONResponse({"name": MODEL_NAME, "ready": ok}, status_code=200 if ok else 503)


@router.get(MODEL, summary="Model metadata: inputs, outputs, datatypes (KServe v2)", responses=error_responses(401))
@router.get(VERSIONED, summary="Metadata of version 1 of the model (KServe v2)", responses=error_responses(401))
async def metadata() -> JSONResponse:
    return JSONResponse(model_metadata())


#: What both infer paths declare in /openapi.json.
INFER_DOC: dict[str, Any] = {
    "responses": {200: {"content": {"application/json": {}, "application/octet-stream": {}},
                        "description": "outputs out [n_q, h_q, d_v] and lse [n_q, h_q]; see docs/KSERVE.md"},
                  **error_responses(400, 401, 404, 408, 413, 415, 422, 429, 503, 504)},
    "openapi_extra": {"parameters": [{"name": HEADER, "in": "header", "required": False, "schema": {"type": "integer"},
                                      "description": "bytes of JSON at the start of a body with binary tensors"}]},
}


@router.post(ROUTE, summary="Attention through the Open Inference Protocol, with the binary tensor extension",
             **INFER_DOC)
@router.post(VERSIONED_INFER, summary="Attention through version 1 of the model (KServe v2)", **INFER_DOC)
async def infer(request: Request) -> Response:
    ex = Exchange.begin(request)
    state, timings = ex.state, ex.timings
    declared_header = request.headers.get(HEADER)
    limit = state.limits.max_json_body_bytes if declared_header is None else state.limits.max_body_bytes

    def check_header(body_len: int) -> None:  # refuse a bad header before reading the body
        header_length(declared_header, body_len)

    body = await ex.body(limit=limit, before_read=check_header)
    parsed, req = await off_loop(len(body), _decode, body, header_length(declared_header, len(body)),
                                 request.query_params, state.limits)
    timings.add("parse", time.perf_counter() - ex.t0)
    out_json = any(o.name == "out" and not o.binary for o in parsed.outputs)
    json_limit = JsonAnswerLimit(state.limits.max_json_answer_elements, KSERVE_BINARY) if out_json else None
    out, lse = await ex.within(lambda: ex.rt.attention.attention(req, timings, json_limit), parsed.timeout_s)
    t1 = time.perf_counter()
    doc, raw = infer_response(parsed.id, {"out": out, "lse": lse}, parsed.outputs)
    content, json_len = response_body(await write_json(doc), raw)  # JSON outputs on the loop in pieces
    timings.add("encode", time.perf_counter() - t1)
    headers = {}
    media = "application/json"
    if json_len is not None:
        headers[HEADER] = str(json_len)
        media = "application/octet-stream"
    return ex.finish(ROUTE, Response(content=content, media_type=media, headers=headers))
