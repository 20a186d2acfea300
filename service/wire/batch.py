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

An item may carry keys to append to its one context before it is answered
(:class:`AppendThenQuery`): the body of ``POST /v1/contexts/{id}/append`` as its field
``append`` (JSON: ``{"k", "v", "k_pos", "after", "upload", "continues"}``, in the item's
``dtype`` unless it names its own; safetensors: tensors ``{i}.append.k``, ``{i}.append.v``,
``{i}.append.k_pos`` and the options object ``"append"`` in the item's options).
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
from service.wire.request import AttentionRequest, ContextWrite, Decoded, attention_request, context_write
from service.wire.rules import (
    ATTENTION,
    CONTEXT_APPEND,
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

#: A tensor name of a batch body: the item's index, a dot, the attention tensor's name (``append.`` and an
#: append's tensor name for the keys the item appends).
_ITEM_TENSOR = re.compile(r"(0|[1-9][0-9]{0,5})\.((?:append\.)?[a-z_]+)")
#: The prefix of an item's field (JSON) or tensor names (safetensors) that carry its append.
APPEND = "append"


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


@dataclass(frozen=True, eq=False)
class AppendThenQuery:
    """An item that appends ``write`` to its one context and, once that is committed, is answered as ``req``."""

    write: ContextWrite
    req: AttentionRequest

    @property
    def context_id(self) -> str:
        return self.req.contexts[0]


#: One item as decoded: a checked request (that may append first), or why it was refused.
Item = AttentionRequest | AppendThenQuery | ItemError
#: One item once its append is done: a query, or why it was refused.
Query = AttentionRequest | ItemError

#: What an item's decoder gives: its attention body, and its append's (None: it appends nothing).
DecodedItem = tuple[Decoded, Decoded | None]


def _count(n: Any, limits: Limits) -> int:
    if type(n) is not int or not 1 <= n <= limits.max_batch_items:
        raise InvalidOption(f"items must be a list of 1 to {limits.max_batch_items} items, got {show(n)}")
    return n


def _item(index: int, decode: Any) -> Item:
    """``decode()`` (a :data:`DecodedItem`) as a checked request, or the item's error (a mistake in this item
    alone: 422, or 413 for a tensor over the limits)."""
    try:
        query, append = decode()
        req = attention_request(query)
        if append is None:
            return req
        if len(req.contexts) != 1:
            raise InvalidOption(f"contexts must name the one context an item's append goes to, got {len(req.contexts)}")
        return AppendThenQuery(context_write(append), req)
    except ServiceError as exc:
        return ItemError.of(index, exc)


def _append_needs_a_context(raw: Mapping[str, Any], appends: bool) -> None:
    """An item that appends must name its one context (:func:`_item` counts them once checked): one that
    names none is refused for that (422 ``invalid_option``), before its missing ``k`` and ``v`` are."""
    if appends and not raw.get("contexts"):
        raise InvalidOption("contexts must name the one context an item's append goes to, got 0")


def _json_item(item: dict, limits: Limits) -> DecodedItem:
    """A JSON item's attention fields and its ``append`` (in the item's dtype unless it names its own)."""
    _append_needs_a_context(item, item.get(APPEND) is not None)
    query = decode_json_object({k: v for k, v in item.items() if k != APPEND}, limits, ATTENTION)
    append = item.get(APPEND)
    if append is None:
        return query, None
    if type(append) is not dict:
        raise InvalidOption(f"append must be an object of an append's fields, got {show(append)}")
    dtype = {"dtype": item["dtype"]} if "dtype" in item else {}
    return query, decode_json_object({**dtype, **append}, limits, CONTEXT_APPEND)


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
    return [_item(i, lambda item=item: _json_item(item, limits)) for i, item in enumerate(items)]


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
        if m is None or not _is_item_tensor(m.group(2)):
            raise InvalidTensor(f"tensor names must be ITEM.NAME with NAME among {sorted_names(ATTENTION.tensors)}, "
                                f"or ITEM.append.NAME with NAME among {sorted_names(CONTEXT_APPEND.tensors)}, "
                                f"got {show(full)}")
        names[full] = (int(m.group(1)), m.group(2))
    return names, load_json(text.encode(), '__metadata__["items"]')


def _is_item_tensor(name: str) -> bool:
    head, _, tail = name.partition(".")
    return tail in CONTEXT_APPEND.tensors if head == APPEND else name in ATTENTION.tensors


def _binary_item(tensors: Mapping[str, np.ndarray], raw: dict, limits: Limits) -> DecodedItem:
    """A safetensors item's attention tensors and options, and its append's (``append.*`` tensors, options
    ``raw["append"]``)."""
    mine = {name: t for name, t in tensors.items() if not name.startswith(APPEND + ".")}
    _append_needs_a_context(raw, raw.get(APPEND) is not None or len(mine) < len(tensors))
    options = check_options({k: v for k, v in raw.items() if k != APPEND}, ATTENTION, limits,
                            alibi_slopes=mine.get("alibi_slopes"))
    check_present(mine, options.contexts, ATTENTION)
    appended = {name.partition(".")[2]: t for name, t in tensors.items() if name.startswith(APPEND + ".")}
    append_options = raw.get(APPEND)
    if append_options is None and not appended:
        return Decoded(mine, options), None
    if type(append_options) is not dict and append_options is not None:
        raise InvalidOption(f"append must be an object of an append's options, got {show(append_options)}")
    write_options = check_options(append_options or {}, CONTEXT_APPEND, limits)
    check_present(appended, (), CONTEXT_APPEND)
    return Decoded(mine, options), Decoded(appended, write_options)


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
        def decode() -> DecodedItem:
            if i in refused:
                cls, detail = refused[i]
                raise cls(detail)
            mine = {name: from_bytes(mv, info.wire, info.shape, header.data_start + info.begin)
                    for name, (_, info) in infos[i].items()}
            return _binary_item(mine, raw[i], limits)
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
