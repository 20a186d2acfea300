"""POST /v1/attention: q over inline k, v and/or resident contexts."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response

from service.attention import AttentionCall
from service.codec import ATTENTION, attention_options
from service.errors import ApiError, error_responses
from service.json_codec import AttentionRequest, AttentionResult
from service.orchestrator import Timings
from service.routes.common import encode_result, read_request, runtime, with_deadline

router = APIRouter(tags=["attention"])

BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": AttentionRequest.model_json_schema()},
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


@router.post(
    "/v1/attention",
    summary="Exact attention of q over inline keys and/or resident contexts",
    responses={200: {"content": {"application/json": {"schema": AttentionResult.model_json_schema()},
                                 "application/octet-stream": {}},
                     "description": "out [n_q, h_q, d_v] and lse [n_q, h_q] (natural log; null for -inf in JSON)"},
               **error_responses(400, 401, 404, 413, 415, 422, 429, 503, 504)},
    openapi_extra=BODY_DOC,
)
async def attention(request: Request) -> Response:
    rt = runtime(request)
    t0 = time.perf_counter()
    timings = Timings()
    fmt, tensors, options, _ = await read_request(request, ATTENTION, timings)
    try:
        opts = attention_options(options, tensors.get("alibi_slopes"))
    except ValueError as exc:
        raise ApiError("invalid_option", str(exc)) from None
    call = AttentionCall(q=tensors["q"], k=tensors.get("k"), v=tensors.get("v"), q_pos=tensors.get("q_pos"),
                         k_pos=tensors.get("k_pos"), options=opts, contexts=options.get("contexts", []))
    out, lse = await with_deadline(rt.attention.attention(call, timings), rt.settings.request_timeout_s)
    response = encode_result(request, fmt, out, lse, timings)
    timings.add("total", time.perf_counter() - t0)
    response.headers["Server-Timing"] = timings.header()
    rt.metrics.observe_stages("/v1/attention", timings.stages)
    return response
