"""The Open Inference Protocol (KServe v2) for Triton and KServe clients; see docs/KSERVE.md.

One model, ``attention`` (version ``1``), over the same :class:`AttentionService` as
``POST /v1/attention``. Decoding and encoding are in :mod:`service.kserve_codec`.
Errors from these routes carry the protocol's ``error`` key besides the contract's
``detail`` and ``code``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable

import ray
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from service.attention import AttentionCall
from service.body import declared_length, read_into_buffer
from service.codec import attention_options
from service.errors import ApiError, error_responses
from service.kserve_codec import (
    MODEL_NAME,
    MODEL_VERSION,
    decode_infer_request,
    encode_infer_response,
    error_body,
    header_length,
    model_metadata,
)
from service.orchestrator import Timings
from service.routes.common import limits_of, runtime, with_deadline

router = APIRouter(tags=["kserve"])

ROUTE = "/v2/models/attention/infer"
#: The binary tensor extension's header: bytes of JSON at the start of the body.
HEADER = "Inference-Header-Content-Length"
MODEL = f"/v2/models/{MODEL_NAME}"
VERSIONED = f"{MODEL}/versions/{MODEL_VERSION}"
SERVER_NAME = "splitkey"
EXTENSIONS = ["binary_tensor_data"]

Handler = Callable[[Request], Awaitable[Response]]
log = logging.getLogger(__name__)


def _error(err: ApiError) -> Response:
    return Response(content=error_body(err), status_code=err.status, media_type="application/json",
                    headers=err.headers)


def kserve_errors(handler: Handler) -> Handler:
    """Answer an :class:`ApiError` (and a stray Ray error, 503) with ``{"error", "detail", "code"}``.

    KServe clients read ``error``; the contract's ``detail`` and ``code`` come along.
    """

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as err:
            return _error(err)
        except ray.exceptions.RayError as exc:  # as the app's handler: the cluster's fault, 503 not 500
            log.warning("Ray error reached the KServe route: %s", exc)
            return _error(ApiError("workers_unavailable", f"the cluster must answer, got {type(exc).__name__}"))

    return wrapped


async def _ready(request: Request) -> bool:
    """Ray connected and every worker answering a ping (as ``GET /readyz``)."""
    rt = request.app.state.splitkey
    if rt.pool is None:
        return False
    await rt.pool.refresh(timeout_s=5.0)
    return all(s.alive for s in rt.pool.slots)


@router.get("/v2", summary="Server metadata (KServe v2)")
async def server_metadata(request: Request) -> JSONResponse:
    return JSONResponse({"name": SERVER_NAME, "version": request.app.version, "extensions": EXTENSIONS})


@router.get("/v2/health/live", summary="The process is alive (KServe v2)")
async def live() -> JSONResponse:
    return JSONResponse({"live": True})


@router.get("/v2/health/ready", summary="Every worker answers (KServe v2)")
async def ready(request: Request) -> JSONResponse:
    ok = await _ready(request)
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


@router.get(f"{MODEL}/ready", summary="The attention model is ready (KServe v2)")
@router.get(f"{VERSIONED}/ready", include_in_schema=False)
async def model_ready(request: Request) -> JSONResponse:
    ok = await _ready(request)
    return JSONResponse({"name": MODEL_NAME, "ready": ok}, status_code=200 if ok else 503)


@router.get(MODEL, summary="Model metadata: inputs, outputs, datatypes (KServe v2)")
@router.get(VERSIONED, include_in_schema=False)
async def metadata() -> JSONResponse:
    return JSONResponse(model_metadata())


@router.post(
    f"{MODEL}/infer",
    summary="Attention through the Open Inference Protocol, with the binary tensor extension",
    responses={200: {"content": {"application/json": {}, "application/octet-stream": {}},
                     "description": "outputs out [n_q, h_q, d_v] and lse [n_q, h_q]; see docs/KSERVE.md"},
               **error_responses(400, 401, 404, 413, 415, 422, 429, 503, 504)},
    openapi_extra={"parameters": [{"name": HEADER, "in": "header", "required": False, "schema": {"type": "integer"},
                                   "description": "bytes of JSON at the start of a body with binary tensors"}]},
)
@router.post(f"{VERSIONED}/infer", include_in_schema=False)
@kserve_errors
async def infer(request: Request) -> Response:
    rt = runtime(request)
    t0 = time.perf_counter()
    timings = Timings()
    encoding = request.headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() != "identity":
        raise ApiError("unsupported_media_type", f"Content-Encoding must be identity (send the request "
                       f"uncompressed), got {encoding!r}")
    limits = limits_of(rt)
    declared_header = request.headers.get(HEADER)
    limit = limits.max_json_body_bytes if declared_header is None else limits.max_body_bytes
    length = declared_length(request.headers.get("content-length"), limit)
    if length is not None:
        header_length(declared_header, length)  # refuse a bad header before reading the body
    body = await read_into_buffer(request.stream(), length, limit)
    rt.metrics.bytes_in.labels(route=ROUTE).inc(len(body))
    parsed = decode_infer_request(body, header_length(declared_header, len(body)), limits)
    try:
        opts = attention_options(parsed.options, parsed.tensors.get("alibi_slopes"))
    except ValueError as exc:
        raise ApiError("invalid_option", str(exc)) from None
    t = parsed.tensors
    call = AttentionCall(q=t["q"], k=t.get("k"), v=t.get("v"), q_pos=t.get("q_pos"), k_pos=t.get("k_pos"),
                         options=opts, contexts=parsed.options.get("contexts", []))
    timings.add("parse", time.perf_counter() - t0)
    deadline = rt.settings.request_timeout_s
    if parsed.timeout_s is not None:
        deadline = min(deadline, parsed.timeout_s)
    out, lse = await with_deadline(rt.attention.attention(call, timings), deadline)
    t1 = time.perf_counter()
    buffers, json_len = encode_infer_response(parsed.id, {"out": out, "lse": lse}, parsed.outputs)
    content = b"".join(buffers)
    timings.add("encode", time.perf_counter() - t1)
    timings.add("total", time.perf_counter() - t0)
    headers = {"Server-Timing": timings.header()}
    media = "application/json"
    if json_len is not None:
        headers[HEADER] = str(json_len)
        media = "application/octet-stream"
    rt.metrics.observe_stages(ROUTE, timings.stages)
    return Response(content=content, media_type=media, headers=headers)
