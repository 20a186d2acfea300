"""Batch bodies (``POST /v1/attention/batch``, docs/API.md section 10): many attention items in one request.

Each item is an attention request of its own (its ``q``, contexts, inline keys,
positions and options) and gets an answer of its own: ``out`` and ``lse``, or the
error it alone caused. A body that cannot be read as a batch at all (malformed,
too many items, a tensor named for no item) is refused whole.

safetensors: tensors are named ``{i}.{name}`` (``0.q``, ``0.q_pos``, ``3.k``, ...)
for item ``i``; ``__metadata__["items"]`` is a JSON array with one object of
options per item (``scale``, ``causal``, ``window``, ``softcap``, ``contexts``; ``{}``
for none), and its length is the item count. The answer is safetensors too:
``{i}.out`` and ``{i}.lse`` for each item answered, and ``__metadata__["items"]``
a JSON array of ``{"status": 200}`` or ``{"status", "code", "detail"}`` per item.

JSON: ``{"items": [{...}, ...]}``, each item the fields of a JSON attention body;
the answer ``{"items": [{"out", "lse"} or {"error": {"status", "code", "detail"}}]}``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.core import request_id
from service.core.errors import ERRORS, BodyTooLarge, InvalidBody, InvalidOption, InvalidTensor, ServiceError, internals
from service.wire.json_codec import decode_json_object
from service.wire.request import AttentionRequest, Decoded, attention_request
from service.wire.rules import (
    ATTENTION,
    DEFAULT_LIMITS,
    Limits,
    check_options,
    check_present,
    show,
    sorted_names,
)
from service.wire.safetensors import (
    TensorInfo,
    encode_safetensors,
    header_span,
    peek_safetensors_header,
)
from service.wire.json_text import JsonArray
from service.wire.values import from_bytes, load_json

log = logging.getLogger(__name__)

#: A tensor name of a batch body: the item's index, a dot, the attention tensor's name.
_ITEM_TENSOR = re.compile(r"(0|[1-9][0-9]{0,5})\.([a-z_]+)")


@dataclass(frozen=True, eq=False)
class ItemError:
    """An item refused alone: its HTTP status, the contract's error code and a message naming the field."""

    status: int
    code: str
    detail: str

    @classmethod
    def of(cls, index: int, exc: ServiceError) -> ItemError:
        """Item ``index``'s error; a detail with machine internals is logged and withheld, as
        ``service.core.errors.render`` does for a whole request."""
        kind = ERRORS[type(exc)]
        detail = exc.detail
        leak = internals(detail)
        if leak is not None:
            rid = request_id.current()
            log.warning("request %s item %d: %s detail withheld from the client (it held %s): %s",
                        rid, index, kind.code, leak, detail)
            detail = f"{kind.code.replace('_', ' ')}: the server log has the details under request id {rid}"
        return cls(kind.status, kind.code, f"items[{index}]: {detail}")

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "code": self.code, "detail": self.detail}


#: One item as decoded: a checked request, or why it was refused.
Item = AttentionRequest | ItemError


def _count(n: Any, limits: Limits) -> int:
    if type(n) is not int or not 1 <= n <= limits.max_batch_items:
        raise InvalidOption(f"items must be a list of 1 to {limits.max_batch_items} items, got {show(n)}")
    return n


def _item(index: int, decode: Any) -> Item:
    """``decode()`` as a checked request, or the item's error (a mistake in this item alone: 422, or 413
    for a tensor over the limits)."""
    try:
        return attention_request(decode())
    except ServiceError as exc:
        return ItemError.of(index, exc)


def decode_json_batch(body: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> list[Item]:
    """The items of a JSON batch body."""
    if len(body) > limits.max_json_body_bytes:
        raise BodyTooLarge(f"JSON body must be at most {limits.max_json_body_bytes} bytes, got {len(body)}; "
                           "send larger tensors as safetensors")
    obj = load_json(body, "JSON body")
    if type(obj) is not dict or set(obj) != {"items"}:
        raise InvalidBody(f"JSON batch body must be an object with the one field items, got {show(obj)}")
    items = obj["items"]
    if type(items) is not list:
        raise InvalidOption(f"items must be a list of 1 to {limits.max_batch_items} items, got {show(items)}")
    _count(len(items), limits)
    for i, item in enumerate(items):  # what makes a body a batch: a list of objects (their fields: each item's own)
        if type(item) is not dict:
            raise InvalidBody(f"items[{i}] must be a JSON object, got {show(item)}")
    return [_item(i, lambda item=item: decode_json_object(item, limits, ATTENTION)) for i, item in enumerate(items)]


def _item_names(mv: memoryview, limits: Limits) -> tuple[dict[str, tuple[int, str]], Any]:
    """Each tensor name of a batch body's header as ``(item, attention name)``, and the raw items option
    array; 400/422 for a header or name that is not a batch's."""
    span = header_span(mv, len(mv), limits)
    obj = load_json(mv[8:span], "safetensors header")
    if type(obj) is not dict:
        raise InvalidBody(f"safetensors header must be a JSON object, got {show(obj)}")
    meta = obj.get("__metadata__")
    text = meta.get("items") if type(meta) is dict else None
    if type(text) is not str:
        raise InvalidBody('__metadata__ must hold "items": a string of JSON text, an array of one options '
                          f"object per item (safetensors metadata values are strings), got {show(meta)}")
    names: dict[str, tuple[int, str]] = {}
    for full in obj:
        if full == "__metadata__":
            continue
        m = _ITEM_TENSOR.fullmatch(full)
        if m is None or m.group(2) not in ATTENTION.tensors:
            raise InvalidTensor(f"tensor names must be ITEM.NAME with NAME among {sorted_names(ATTENTION.tensors)}, "
                                f"got {show(full)}")
        names[full] = (int(m.group(1)), m.group(2))
    return names, load_json(text.encode(), '__metadata__["items"]')


def decode_binary_batch(body: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> list[Item]:
    """The items of a safetensors batch body (module doc)."""
    mv = memoryview(body).cast("B")
    names, raw = _item_names(mv, limits)
    if type(raw) is not list:
        raise InvalidOption(f"items must be a list of 1 to {limits.max_batch_items} items, got {show(raw)}")
    n = _count(len(raw), limits)
    for i, opts in enumerate(raw):
        if type(opts) is not dict:
            raise InvalidBody(f'__metadata__["items"][{i}] must be a JSON object of options, got {show(opts)}')
    for full, (i, _) in names.items():
        if i >= n:
            raise InvalidTensor(f"tensor {full} must name one of the {n} items of __metadata__, got item {i}")
    # Dtypes, shapes, sizes, offsets; a tensor we do not take is its item's error, the framing the body's.
    header = peek_safetensors_header(mv, len(mv), limits, names, refuse_alone=True)
    infos: list[dict[str, tuple[str, TensorInfo]]] = [{} for _ in range(n)]
    for full, info in header.tensors.items():
        i, name = names[full]
        infos[i][name] = (full, info)
    refused: dict[int, tuple[type[ServiceError], str]] = {}
    for full in sorted(header.refused):
        refused.setdefault(names[full][0], header.refused[full])

    def one(i: int) -> Item:
        def decode() -> Decoded:
            if i in refused:
                cls, detail = refused[i]
                raise cls(detail)
            mine = {name: from_bytes(mv, info.wire, info.shape, header.data_start + info.begin)
                    for name, (_, info) in infos[i].items()}
            options = check_options(raw[i], ATTENTION, limits, alibi_slopes=mine.get("alibi_slopes"))
            check_present(mine, options.contexts, ATTENTION)
            return Decoded(mine, options)
        return _item(i, decode)

    return [one(i) for i in range(n)]


#: One item's answer: ``(out, lse)``, or its error.
Answer = tuple[np.ndarray, np.ndarray] | ItemError


def encode_binary_batch(answers: Sequence[Answer]) -> list[bytes | memoryview]:
    tensors: dict[str, np.ndarray] = {}
    status: list[dict[str, Any]] = []
    for i, a in enumerate(answers):
        if isinstance(a, ItemError):
            status.append(a.to_json())
            continue
        tensors[f"{i}.out"], tensors[f"{i}.lse"] = a
        status.append({"status": 200})
    return encode_safetensors(tensors, {"items": json.dumps(status, separators=(",", ":"))})


def json_batch(answers: Sequence[Answer]) -> dict[str, Any]:
    """The document ``{"items": [...]}`` of a batch's answers (``json_text.write_json`` writes it)."""
    items: list[Mapping[str, Any]] = []
    for a in answers:
        if isinstance(a, ItemError):
            items.append({"error": a.to_json()})
        else:
            items.append({"out": JsonArray("out", a[0]), "lse": JsonArray("lse", a[1])})
    return {"items": items}
