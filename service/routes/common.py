"""What every route shares: the runtime, body reading, decoding, encoding, deadlines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request, Response

from service.body import declared_length, read_into_buffer
from service.codec import BodyKind, Limits
from service.errors import ApiError
from service.json_codec import decode_json_request, encode_json_result
from service.negotiation import request_format, response_format
from service.orchestrator import ShardLost, Timings
from service.pool import WorkerUnavailable
from service.safetensors_codec import decode_binary_request, encode_safetensors, to_bytes

T = TypeVar("T")

MEDIA = {"json": "application/json", "safetensors": "application/octet-stream"}


def runtime(request: Request) -> Any:
    rt = request.app.state.splitkey
    if rt.pool is None:
        raise ApiError("workers_unavailable", "workers must be started before requests are served, got none yet")
    return rt


def limits_of(rt: Any) -> Limits:
    s = rt.settings
    return Limits(max_body_bytes=s.max_body_bytes, max_json_body_bytes=min(s.max_body_bytes, Limits().max_json_body_bytes))


async def read_request(request: Request, kind: BodyKind, timings: Timings) -> tuple[str, dict, dict, int]:
    """Read and decode a body of ``kind``: ``(format, tensors, options, body bytes)``."""
    rt = runtime(request)
    t0 = time.perf_counter()
    fmt = request_format(request.headers.get("content-type"))
    limits = limits_of(rt)
    limit = limits.max_json_body_bytes if fmt == "json" else limits.max_body_bytes
    length = declared_length(request.headers.get("content-length"), limit)
    body = await read_into_buffer(request.stream(), length, limit)
    rt.metrics.bytes_in.labels(route=request.url.path if kind.name == "attention" else "/v1/contexts").inc(len(body))
    if fmt == "json":
        tensors, options = decode_json_request(body, limits, kind)
    else:
        tensors, options = decode_binary_request(body, request.query_params, kind, limits)
    timings.add("parse", time.perf_counter() - t0)
    return fmt, tensors, options, len(body)


def encode_result(request: Request, fmt: str, out: Any, lse: Any, timings: Timings) -> Response:
    t0 = time.perf_counter()
    resp_fmt = response_format(request.headers.get("accept"), fmt)
    if resp_fmt == "json":
        content = encode_json_result(out, lse)
    else:
        content = to_bytes(encode_safetensors({"out": out, "lse": lse}))
    timings.add("encode", time.perf_counter() - t0)
    return Response(content=content, media_type=MEDIA[resp_fmt], headers={"Server-Timing": timings.header()})


async def with_deadline(work: Awaitable[T], seconds: float) -> T:
    """Run a read (a query) within the request deadline; map worker failures to the contract's codes."""
    try:
        return await asyncio.wait_for(work, seconds)
    except TimeoutError:
        raise ApiError("deadline_exceeded", f"the request must finish within {seconds} s, got longer") from None
    except ShardLost as exc:
        raise ApiError("context_lost" if exc.context else "workers_unavailable", str(exc)) from None
    except WorkerUnavailable as exc:
        raise ApiError("workers_unavailable", str(exc)) from None


async def without_deadline(work: Awaitable[T]) -> T:
    """Run a context write to its end: cancelling it half way would leave replicas
    out of step, so writes are not cut by the request deadline (their size is
    bounded by the body limit instead). Worker failures map as for reads."""
    try:
        return await asyncio.shield(work)
    except ShardLost as exc:
        raise ApiError("context_lost" if exc.context else "workers_unavailable", str(exc)) from None
    except WorkerUnavailable as exc:
        raise ApiError("workers_unavailable", str(exc)) from None
