"""POST /v1/attention: q over inline k, v and/or resident contexts."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response

from service.core.errors import error_responses
from service.routes.common import Exchange, answer_limit, decode_body, encode_result, off_loop
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
               **error_responses(400, 401, 404, 408, 413, 415, 422, 429, 503, 504)},
    openapi_extra=BODY_DOC,
)
async def attention(request: Request) -> Response:
    ex = Exchange.begin(request)
    fmt = request_format(request.headers.get("content-type"))
    resp_fmt = response_format(request.headers.get("accept"), fmt)
    body = await ex.body(fmt)
    req = await off_loop(len(body), _decode, fmt, body, request.query_params, ex.state.limits)
    ex.timings.add("parse", time.perf_counter() - ex.t0)
    json_limit = answer_limit(ex.state.limits, resp_fmt)
    out, lse = await ex.within(lambda: ex.rt.attention.attention(req, ex.timings, json_limit))
    return ex.finish(ROUTE, await encode_result(resp_fmt, out, lse, ex.timings))
