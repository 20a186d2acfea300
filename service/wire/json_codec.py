"""JSON bodies (``application/json``): strict fields, tensors from nested lists, results as nested lists.

Validation is hand-written rather than done by pydantic: it bounds sizes before
building arrays, checks a nested list level by level at C speed (``map``/``set``)
instead of per element in Python, and words every error "field must be X, got Y"
with the index where a list is ragged. The pydantic models at the end describe the
same bodies for OpenAPI only (``openapi_extra``); tests keep both in step.

Rules: unknown fields are 422; ``null`` means "not given"; no bool for a number,
no number for a bool, no string for a number; tensors are rectangular nested lists
of numbers (``int`` only for ``q_pos``/``k_pos``); NaN, Infinity and values that
overflow ``dtype`` are 422. ``q``, ``k``, ``v`` are cast to ``dtype`` (default
float32), positions are int64, ``alibi_slopes`` float64.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from service.core.errors import BodyTooLarge, InvalidBody, InvalidOption, InvalidTensor
from service.wire.request import Decoded
from service.wire.rules import (
    ATTENTION,
    DEFAULT_LIMITS,
    TENSOR_RULES,
    BodyKind,
    Limits,
    TensorRule,
    check_options,
    check_present,
    show,
    sorted_names,
)
from service.wire.json_text import JsonArray
from service.wire.values import load_json, numbers_to_array
from workers.dtypes import DTYPES, FLOAT64

#: What JSON integers become.
INT64 = np.dtype(np.int64)


def _path(name: str, flat_index: int, shape: list[int]) -> str:
    """``q[1][0][2]``: where flat (C-order) element ``flat_index`` of a ``shape`` nest sits."""
    if not shape:
        return name
    return name + "".join(f"[{int(i)}]" for i in np.unravel_index(flat_index, shape))


def _walk(name: str, value: Any, rule: TensorRule) -> tuple[list[int], list[Any]]:
    """Shape and C-order leaves of a rectangular nest of ``rule.rank`` lists; 422 if ragged."""
    if type(value) is not list:
        raise InvalidTensor(f"{name} must be a nested list of numbers {rule.layout}, got {show(value)}")
    shape: list[int] = []
    level = [value]
    for depth in range(rule.rank):
        if set(map(type, level)) != {list}:
            i = next(i for i, node in enumerate(level) if type(node) is not list)
            raise InvalidTensor(f"{_path(name, i, shape)} must be a list ({name} is {rule.layout}), "
                                f"got {show(level[i])}")
        n = len(level[0])
        if len(set(map(len, level))) > 1:
            i = next(i for i, node in enumerate(level) if len(node) != n)
            raise InvalidTensor(f"{name} must be rectangular: {_path(name, i, shape)} must have length "
                                f"{n} like {_path(name, 0, shape)}, got length {len(level[i])}")
        if n == 0 and depth < rule.rank - 1:
            raise InvalidTensor(f"{_path(name, 0, shape)} must not be empty ({name} is {rule.layout}; "
                                f"JSON cannot give the shape of an empty tensor, send safetensors), got []")
        shape.append(n)
        level = list(chain.from_iterable(level))
    return shape, level


def _tensor(name: str, value: Any, dtype: np.dtype, limits: Limits) -> np.ndarray:
    rule = TENSOR_RULES[name]
    shape, leaves = _walk(name, value, rule)
    if len(leaves) > limits.max_elements:
        raise BodyTooLarge(f"{name} must have at most {limits.max_elements} elements, got {len(leaves)}")
    integer = rule.kind == "int"
    target = INT64 if integer else dtype
    return numbers_to_array(leaves, shape, target, integer=integer,
                            where=lambda i: _path(name, i, shape), label=target.name)


def decode_json_request(body: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS,
                        kind: BodyKind = ATTENTION) -> Decoded:
    """The tensors and options of a JSON body of ``kind``."""
    if len(body) > limits.max_json_body_bytes:
        raise BodyTooLarge(f"JSON body must be at most {limits.max_json_body_bytes} bytes, "
                           f"got {len(body)}; send larger tensors as safetensors")
    obj = load_json(body, "JSON body")
    if type(obj) is not dict:
        raise InvalidBody(f"JSON body must be an object, got {show(obj)}")
    return decode_json_object(obj, limits, kind)


def decode_json_object(obj: dict, limits: Limits = DEFAULT_LIMITS, kind: BodyKind = ATTENTION) -> Decoded:
    """The tensors and options of one parsed JSON object of ``kind`` (a body, or an item of a batch)."""
    fields = kind.tensors | kind.options | {"dtype"}
    for name in obj:
        if name not in fields:
            error = InvalidTensor if name in TENSOR_RULES else InvalidOption
            raise error(f"{name} is not a field of {kind.name} requests; fields must be among "
                        f"{sorted_names(fields)}, got {show(name)}")
    dtype_name = obj.get("dtype")
    if dtype_name is None:
        dtype_name = "float32"
    if type(dtype_name) is not str or dtype_name not in DTYPES:
        raise InvalidOption(f"dtype must be one of {', '.join(DTYPES)}, got {show(dtype_name)}")
    tensors = {}
    for name in sorted(kind.tensors):
        if obj.get(name) is not None:
            target = DTYPES[dtype_name] if name in ("q", "k", "v") else FLOAT64
            tensors[name] = _tensor(name, obj[name], target, limits)
    options = check_options({name: obj[name] for name in kind.options if name in obj}, kind, limits,
                            alibi_slopes=tensors.get("alibi_slopes"))
    check_present(tensors, options.contexts, kind)
    return Decoded(tensors, options)


def json_result(out: np.ndarray, lse: np.ndarray) -> dict[str, JsonArray]:
    """The document ``{"out": [[[...]]], "lse": [[...]]}`` (``json_text.write_json`` writes it); an lse of
    -inf (fully masked row) is ``null``.

    Any other non-finite value (possible only when inputs overflow float32/float64) is
    ``null`` too, since JSON has no infinities or NaN.
    """
    if out.ndim != 3 or lse.shape != out.shape[:2]:
        raise ValueError(f"out and lse must be [n_q, h_q, d_v] and [n_q, h_q], got {out.shape} and {lse.shape}")
    return {"out": JsonArray("out", out), "lse": JsonArray("lse", lse)}


# -- OpenAPI descriptions of the same bodies (documentation only; decode_json_request validates) --

_STRICT = ConfigDict(extra="forbid", strict=True)
Tensor3 = list[list[list[float]]]
Dtype = Literal["float16", "bfloat16", "float32", "float64"]


class AttentionRequestModel(BaseModel):
    """``POST /v1/attention`` with ``Content-Type: application/json``."""

    model_config = _STRICT
    q: Tensor3 = Field(description="queries [n_q, h_q, d]")
    k: Tensor3 | None = Field(None, description="keys [n_k, h_kv, d]; with v, or use contexts")
    v: Tensor3 | None = Field(None, description="values [n_k, h_kv, d_v]")
    q_pos: list[int] | None = Field(None, description="query positions [n_q]; default the last n_q of the keys")
    k_pos: list[int] | None = Field(None, description="key positions [n_k]; default 0..n_k-1")
    alibi_slopes: list[float] | None = Field(None, description="ALiBi slopes [h_q]")
    dtype: Dtype = Field("float32", description="what q, k and v are cast to")
    scale: float | None = Field(None, gt=0, description="score scale; default 1/sqrt(d)")
    causal: bool | None = Field(None, description="mask keys after the query (default false)")
    window: tuple[int | None, int | None] | None = Field(None, description="[left, right], null = unbounded")
    softcap: float | None = Field(None, ge=0, description="softcap * tanh(s / softcap); 0 or null: off")
    contexts: list[str] | None = Field(None, description="ids of stored contexts whose keys join k, v")


class ContextWriteModel(BaseModel):
    """The fields every context write takes (create and append)."""

    model_config = _STRICT
    k: Tensor3 = Field(description="keys [n_k, h_kv, d]")
    v: Tensor3 = Field(description="values [n_k, h_kv, d_v]")
    dtype: Dtype = Field("float32", description="what k and v are cast to")


class ContextAppendRequestModel(ContextWriteModel):
    """``POST /v1/contexts/{id}/append`` with ``Content-Type: application/json``."""

    k_pos: list[int] | None = Field(None, description="key positions [n_k]; default continues the context")
    after: int | None = Field(None, ge=0, description="append only if the context holds exactly this many keys "
                                                      "(409 length_mismatch otherwise)")
    upload: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$",
                               description="the id of the chunked upload this append belongs to (with after)")
    continues: bool = Field(False, description="append only if the context's last append was this upload's "
                                               "(409 length_mismatch otherwise)")


class ContextCreateRequestModel(ContextWriteModel):
    """``POST /v1/contexts`` with ``Content-Type: application/json``."""

    k_pos: list[int] | None = Field(None, description="key positions [n_k]; default 0..n_k-1")
    replicas: int | None = Field(None, ge=1, description="copies of each shard")
    shards: int | None = Field(None, ge=1, description="shards the keys are split into")
    expected_length: int | None = Field(None, ge=1, description="keys the context will hold once every chunk is "
                                                                "appended; sizes its shards for them")


class AttentionResult(BaseModel):
    """JSON result: ``out [n_q, h_q, d_v]`` and ``lse [n_q, h_q]`` (null where -inf: a fully masked row)."""

    out: list[list[list[float | None]]]
    lse: list[list[float | None]]
