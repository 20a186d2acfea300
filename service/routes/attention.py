"""POST /v1/attention: q over inline k, v and/or resident contexts."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response

from service.core.errors import error_responses
from service.core.metrics import Timings
from service.routes.common import (
    app_state,
    body_limit,
    client_timeout,
    client_waits,
    decode_body,
    answer_limit,
    encode_result,
    off_loop,
    query_deadline,
    read_body,
    runtime,
    with_deadline,
)
from service.wire.json_codec import AttentionRequestModel, AttentionResult
from service.wire.negotiation import Format, request_format, response_format
from service.wire.request import AttentionRequest, attention_request
from service.wire.rules import ATTENTION, Limits

router = APIRouter(tags=["attention"])

ROUTE = "/v1/attention"
BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": AttentionRequestModel.model_json_schema()},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary",
                                                    "description": "safetensors: q, k, v, q_pos, k_pos, alibi_slopes; "
                                                                   "options as query parameters"}},
        },
    },
    "parameters": [
        {"name": n, "in": "query", "required": False, "schema": {"type": "string"}, "description": d}
        for n, d in (("scale", "e.g. 0.125"), ("causal", "true|false"), ("softcap", "e.g. 30"),
                     ("window", "LEFT,RIGHT, a side empty for unbounded"), ("contexts", "ID1,ID2"))
    ],
}


def _decode(fmt: Format, body: memoryview, query: object, limits: Limits) -> AttentionRequest:
    return attention_request(decode_body(fmt, body, query, ATTENTION, limits))


@router.post(
    ROUTE,
    summary="Exact attention of q over inline keys and/or resident contexts",
    responses={200: {"content": {"application/json": {"schema": AttentionResult.model_json_schema()},
                                 "application/octet-stream": {}},
                     "description": "out [n_q, h_q, d_v] and lse [n_q, h_q] (natural log; null for -inf in JSON)"},
               **error_responses(400, 401, 404, 413, 415, 422, 429, 503, 504)},
    openapi_extra=BODY_DOC,
)
async def attention(request: Request) -> Response:
    state, rt = app_state(request), runtime(request)
    t0 = time.perf_counter()
    timings = Timings()
    fmt = request_format(request.headers.get("content-type"))
    resp_fmt = response_format(request.headers.get("accept"), fmt)
    client = client_timeout(request)
    body = await read_body(request, body_limit(state.limits, fmt), ROUTE)
    req = await off_loop(len(body), _decode, fmt, body, request.query_params, state.limits)
    timings.add("parse", time.perf_counter() - t0)
    seconds = query_deadline(state.settings.request_timeout_s, client, t0)
    await client_waits(request)
    out, lse = await with_deadline(rt.attention.attention(req, timings, answer_limit(state.limits, resp_fmt)), seconds)
    await client_waits(request)
    response = await encode_result(resp_fmt, out, lse, timings)
    timings.add("total", time.perf_counter() - t0)
    response.headers["Server-Timing"] = timings.header()
    state.metrics.observe_stages(ROUTE, timings)
    return response
