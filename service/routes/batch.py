"""POST /v1/attention/batch: many independent attention items in one request (service.batch)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from service.cluster.channel import staged_writes
from service.core.errors import error_responses
from service.routes.common import Exchange, answer_limit, off_loop, to_completion
from service.wire.batch import (
    AppendThenQuery,
    Item,
    ItemError,
    decode_binary_batch,
    decode_json_batch,
    encode_binary_batch,
    json_batch,
)
from service.wire.json_text import write_json
from service.wire.negotiation import Format, content_type, request_format, response_format
from service.wire.rules import Limits, refuse_query
from service.wire.safetensors import to_bytes

router = APIRouter(tags=["attention"])

ROUTE = "/v1/attention/batch"


class BatchRequestModel(BaseModel):
    """``POST /v1/attention/batch`` with ``Content-Type: application/json`` (documentation only)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # Each item is checked on its own and a bad one is answered on its own (200): the schema of an item is
    # AttentionRequestModel, but for the batch only "an object" is a rule of the whole body.
    items: list[dict[str, Any]] = Field(min_length=1, max_length=Limits().max_batch_items,
                                        description="1 to max_batch_items objects, each the body of POST "
                                                    "/v1/attention (AttentionRequestModel); each answered or "
                                                    "refused on its own")


class ItemErrorModel(BaseModel):
    status: int
    code: str
    detail: str


class BatchItemResult(BaseModel):
    out: list[list[list[float | None]]] | None = None
    lse: list[list[float | None]] | None = None
    error: ItemErrorModel | None = None


class BatchResult(BaseModel):
    items: list[BatchItemResult]


BODY_DOC = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": BatchRequestModel.model_json_schema()},
    "application/octet-stream": {"schema": {"type": "string", "format": "binary", "description":
                                            "safetensors: tensors ITEM.NAME (0.q, 0.q_pos, ...); "
                                            "__metadata__.items: JSON array of each item's options"}}}}}


def _decode(fmt: Format, body: memoryview, query: Mapping[str, str], limits: Limits) -> list[Item]:
    refuse_query(query, "a batch request")
    return decode_json_batch(body, limits) if fmt == "json" else decode_binary_batch(body, limits)


@router.post(
    ROUTE,
    summary="Many attention items in one request, each answered (or refused) on its own",
    responses={200: {"content": {"application/json": {"schema": BatchResult.model_json_schema()},
                                 "application/octet-stream": {}},
                     "description": "per item: out and lse, or its error"},
               **error_responses(400, 401, 408, 413, 415, 422, 429, 503, 504)},
    openapi_extra=BODY_DOC,
)
async def attention_batch(request: Request) -> Response:
    ex = Exchange.begin(request)
    state, rt, timings = ex.state, ex.rt, ex.timings
    fmt = request_format(request.headers.get("content-type"))
    resp_fmt = response_format(request.headers.get("accept"), fmt)
    body = await ex.body(fmt)
    items = await off_loop(len(body), _decode, fmt, body, request.query_params, state.limits)
    timings.add("parse", time.perf_counter() - ex.t0)
    if any(isinstance(it, AppendThenQuery) for it in items):
        with staged_writes():  # context writes, never cut by the deadline (to_completion)
            queries = await to_completion(rt.batch.append(items, timings))
    else:
        queries = [it for it in items if not isinstance(it, AppendThenQuery)]  # all of them
    json_limit = answer_limit(state.limits, resp_fmt)
    answers = await ex.within(lambda: rt.batch.run(queries, timings, json_limit))
    t1 = time.perf_counter()
    if resp_fmt == "json":  # on the loop in pieces (service.wire.json_text), as a single answer
        content = await write_json(json_batch(answers))
    else:
        nbytes = sum(a.nbytes for answer in answers if not isinstance(answer, ItemError) for a in answer)
        content = await off_loop(nbytes, lambda: to_bytes(encode_binary_batch(answers)))
    timings.add("encode", time.perf_counter() - t1)
    state.metrics.count_batch_items(a.status if isinstance(a, ItemError) else 200 for a in answers)
    return ex.finish(ROUTE, Response(content=content, media_type=content_type(resp_fmt)))
