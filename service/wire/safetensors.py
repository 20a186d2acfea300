"""safetensors bodies: the header checked before any tensor memory, zero-copy decode, buffer-list encode.

Layout (https://huggingface.co/docs/safetensors): a u64 little-endian header length
``n``, ``n`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``
with an optional ``"__metadata__"`` (string to string), then the data section of raw
little-endian C-order bytes, offsets relative to its start.

Errors: a body that is not a well-formed safetensors file (truncated, bad JSON,
duplicate keys, offsets that overlap, leave gaps or run out of bounds, a byte count
that does not match the shape, ...) is 400 ``invalid_body``; a well-formed one with
a tensor we do not take (unknown name, unsupported dtype, wrong rank or element
kind) is 422 ``invalid_tensor``; sizes over :class:`service.wire.rules.Limits` are 413
``body_too_large``. Tensor values are not scanned here (``service.wire.request`` does).
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from service.core.errors import BodyTooLarge, InvalidBody, InvalidTensor, ServiceError
from service.wire.request import Decoded
from service.wire.rules import (
    ATTENTION,
    DEFAULT_LIMITS,
    TENSOR_RULES,
    BodyKind,
    Limits,
    check_extent,
    check_present,
    parse_query_options,
    show,
    sorted_names,
)
from service.wire.values import SAFETENSORS, WireDtype, array_bytes, from_bytes, load_json, wire_of

_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})
#: Headers up to this many bytes are checked once and remembered (:func:`peek_safetensors_header`):
#: a decode query's header is ~100 bytes; the bound keeps the memo at most ``MEMO_HEADERS`` KiB.
MEMO_HEADER_BYTES = 1024
#: Checked headers remembered, least recently used dropped first (and as many encoded ones).
MEMO_HEADERS = 256
#: Encoded headers of at most this many tensors are remembered (:func:`encode_safetensors`).
MEMO_TENSORS = 8


@dataclass(frozen=True)
class TensorInfo:
    """One header entry, checked. Offsets are relative to the data section."""

    wire: WireDtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def count(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """A checked header: the tensors, the metadata and where the data section starts."""

    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    data_start: int
    body_len: int
    #: With ``refuse_alone``: each tensor that is well framed but not one we take (an unsupported
    #: dtype, rank or element kind, over the element limit), its error's class and detail.
    refused: Mapping[str, tuple[type[ServiceError], str]] = field(default_factory=lambda: MappingProxyType({}))


def header_span(prefix: bytes | bytearray | memoryview, body_len: int, limits: Limits) -> int:
    """Bytes the length field and the JSON header take (``8 + n``): what :func:`peek_safetensors_header` needs.

    ``prefix`` must hold at least the first 8 bytes of a body of ``body_len`` bytes.
    """
    if body_len > limits.max_body_bytes:
        raise BodyTooLarge(f"body must be at most {limits.max_body_bytes} bytes, got {body_len}")
    if body_len < 8:
        raise InvalidBody(f"safetensors body must start with an 8-byte header length, got {body_len} bytes")
    if len(prefix) < 8:
        raise ValueError(f"prefix must hold the first 8 bytes of the body, got {len(prefix)}")
    (n,) = struct.unpack_from("<Q", prefix)
    if n > body_len - 8:
        raise InvalidBody(f"safetensors header length must be at most the {body_len - 8} bytes after it, got {n}")
    if n > limits.max_header_bytes:
        raise BodyTooLarge(f"safetensors header must be at most {limits.max_header_bytes} bytes, got {n}")
    return 8 + n


def _frame(name: str, entry: Any) -> tuple[Any, list[int], list[int]]:
    """``(dtype, shape, data_offsets)`` of one header entry, as a safetensors file must frame them
    (400 if not); whether the tensor is one we take is :func:`_entry`'s question."""
    if type(entry) is not dict or entry.keys() != _ENTRY_KEYS:
        raise InvalidBody(f"{name} must be an object with keys dtype, shape, data_offsets, got {show(entry)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if type(shape) is not list or any(type(s) is not int or s < 0 for s in shape):
        raise InvalidBody(f"{name} shape must be a list of ints >= 0, got {show(shape)}")
    if type(offsets) is not list or len(offsets) != 2 or any(type(o) is not int for o in offsets) \
            or not 0 <= offsets[0] <= offsets[1]:
        raise InvalidBody(f"{name} data_offsets must be [begin, end] with 0 <= begin <= end, got {show(offsets)}")
    return dtype, shape, offsets


#: The safetensors dtypes a tensor of each kind (``TENSOR_RULES``) may have, as the 422s name them.
KIND_DTYPES = {"int": "I32 or I64", "float": "F16, BF16, F32 or F64"}


def _entry(name: str, entry: Any, allowed: Iterable[str], limits: Limits) -> TensorInfo:
    """Check one header entry; everything but its place in the data section."""
    if name not in allowed:
        raise InvalidTensor(f"tensor names must be among {sorted_names(allowed)}, got {show(name)}")
    dtype, shape, offsets = _frame(name, entry)
    rule = TENSOR_RULES.get(name.rpartition(".")[2])  # a batch's "ITEM.NAME" is held to NAME's rule
    if type(dtype) is not str or dtype not in SAFETENSORS:  # the tensor's own choices where it has a rule
        wanted = f"one of {sorted_names(SAFETENSORS)}" if rule is None else KIND_DTYPES[rule.kind]
        raise InvalidTensor(f"{name} dtype must be {wanted}, got {show(dtype)}")
    wire = SAFETENSORS[dtype]
    if rule is not None and len(shape) != rule.rank:
        raise InvalidTensor(f"{name} must be {rule.layout} ({rule.rank} dims), got shape {show(shape)}")
    if len(shape) > limits.max_dims:
        raise InvalidTensor(f"{name} must have at most {limits.max_dims} dims, got shape {show(shape)}")
    if rule is not None and (rule.kind == "int") != wire.integer:
        raise InvalidTensor(f"{name} dtype must be {KIND_DTYPES[rule.kind]}, got {dtype}")
    nbytes = math.prod(shape) * wire.bits.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise InvalidBody(f"{name} data_offsets must span prod(shape) * itemsize = {nbytes} bytes for shape {shape} "
                          f"{dtype}, got {show(offsets)} ({offsets[1] - offsets[0]} bytes)")
    check_extent(name, shape, limits)
    return TensorInfo(wire, tuple(shape), offsets[0], offsets[1])


def _check_coverage(spans: Mapping[str, tuple[int, int]], data_len: int) -> None:
    """The tensors' ``[begin, end)`` tile the data section exactly: no overlap, no gap, nothing out of bounds."""
    expected, previous = 0, None
    for name, (begin, end) in sorted(spans.items(), key=lambda item: item[1]):
        if end > data_len:
            raise InvalidBody(f"{name} data_offsets must end within the {data_len} data bytes, got [{begin}, {end}]")
        if begin < expected:
            raise InvalidBody(f"{name} data_offsets must not overlap {previous} (which ends at {expected}), "
                              f"got [{begin}, {end}]")
        if begin > expected:
            raise InvalidBody(f"data bytes [{expected}, {begin}) must belong to a tensor, got a gap before {name}")
        expected, previous = end, name
    if expected != data_len:
        raise InvalidBody(f"data bytes [{expected}, {data_len}) must belong to a tensor, got trailing bytes")


def peek_safetensors_header(prefix: bytes | bytearray | memoryview, body_len: int, limits: Limits,
                            allowed: Iterable[str], *, refuse_alone: bool = False) -> Header:
    """Check the whole header of a ``body_len``-byte body from its first bytes only.

    ``prefix`` must hold at least :func:`header_span` bytes (the rest is not read). On
    return the data section is known to be exactly tiled by tensors named in
    ``allowed`` with supported dtypes and bounded sizes: nothing about it can fail later.

    A header of at most ``MEMO_HEADER_BYTES`` is checked once per (text, body length,
    limits, names): the answer is a function of those alone, and an engine's decode loop
    sends (and gets back) the same header byte for byte at every step. A header that
    fails is never kept; at most ``MEMO_HEADERS`` are.

    ``refuse_alone``: a well-framed tensor we do not take is left out of ``tensors`` and named
    in ``refused`` instead of refusing the body (a batch refuses it for its item alone); the
    body's framing is checked all the same, its bytes included.
    """
    span = header_span(prefix, body_len, limits)
    if len(prefix) < span:
        raise ValueError(f"prefix must hold the first {span} bytes (length and header), got {len(prefix)}")
    text = bytes(memoryview(prefix)[8:span])
    allowed = frozenset(allowed)
    if span - 8 <= MEMO_HEADER_BYTES:
        return _memo_header(text, body_len, limits, allowed, refuse_alone)
    return _check_header(text, body_len, limits, allowed, refuse_alone)


def _check_header(text: bytes, body_len: int, limits: Limits, allowed: frozenset[str],
                  refuse_alone: bool = False) -> Header:
    """The checked header of a ``body_len``-byte body whose JSON header is ``text`` (length field excluded)."""
    obj = load_json(text, "safetensors header")
    if type(obj) is not dict:
        raise InvalidBody(f"safetensors header must be a JSON object, got {show(obj)}")
    metadata = obj.pop("__metadata__", {})
    if type(metadata) is not dict or any(type(v) is not str for v in metadata.values()):
        raise InvalidBody(f"__metadata__ must map strings to strings, got {show(metadata)}")
    tensors: dict[str, TensorInfo] = {}
    refused: dict[str, tuple[type[ServiceError], str]] = {}
    spans: dict[str, tuple[int, int]] = {}
    for name, entry in obj.items():
        try:
            info = tensors[name] = _entry(name, entry, allowed, limits)
            spans[name] = (info.begin, info.end)
        except (InvalidTensor, BodyTooLarge) as exc:
            if not refuse_alone or name not in allowed:
                raise
            _, _, offsets = _frame(name, entry)  # framed as the body's: its bytes are checked below
            refused[name] = (type(exc), exc.detail)
            spans[name] = (offsets[0], offsets[1])
    _check_coverage(spans, body_len - 8 - len(text))
    # Read-only: a memoized header is shared by every body that has it.
    return Header(tensors=MappingProxyType(tensors), metadata=MappingProxyType(metadata), data_start=8 + len(text),
                  body_len=body_len, refused=MappingProxyType(refused))


_memo_header = functools.lru_cache(maxsize=MEMO_HEADERS)(_check_header)


def decode_safetensors(buf: bytes | bytearray | memoryview, allowed: Iterable[str],
                       limits: Limits = DEFAULT_LIMITS) -> dict[str, np.ndarray]:
    """Tensors of a whole safetensors body as zero-copy views (read-only for ``bytes``).

    BF16 comes back as ``ml_dtypes.bfloat16``. Never unpickles or evaluates anything.
    """
    mv = memoryview(buf).cast("B")
    return tensors_of(mv, peek_safetensors_header(mv, len(mv), limits, allowed))


def tensors_of(body: memoryview, header: Header) -> dict[str, np.ndarray]:
    """The tensors of a whole body (bytes) whose header was checked: zero-copy views."""
    return {name: from_bytes(body, info.wire, info.shape, header.data_start + info.begin)
            for name, info in header.tensors.items()}


def _wire(name: Any, a: Any) -> tuple[WireDtype, np.ndarray]:
    """The wire dtype of ``a`` and its little-endian bytes as a flat uint8 array."""
    if type(name) is not str or not name or name == "__metadata__":
        raise ValueError(f"tensor names must be non-empty strings other than __metadata__, got {name!r}")
    wire = wire_of(name, a)
    return wire, array_bytes(a, wire)


def encode_safetensors(tensors: Mapping[str, np.ndarray],
                       metadata: Mapping[str, str] | None = None) -> list[bytes | memoryview]:
    """A safetensors body as a list of buffers (length, header, one per tensor), for sending unjoined.

    The layout matches ``safetensors.numpy.save`` byte for byte: tensors ordered by
    dtype (widest first) then name, so each one starts aligned to its item size, and
    the header padded with spaces to a multiple of 8 bytes.
    """
    if metadata is not None and (not isinstance(metadata, Mapping)
                                 or any(type(k) is not str or type(v) is not str for k, v in metadata.items())):
        raise ValueError(f"metadata must map strings to strings, got {metadata!r}")
    wired = sorted(((wire, name, data, tuple(a.shape))
                    for name, a in tensors.items() for wire, data in [_wire(name, a)]),
                   key=lambda item: (-item[0].write_rank, item[1]))
    entries = tuple((name, wire.safetensors, shape, data.nbytes) for wire, name, data, shape in wired)
    # Without metadata a header is a function of its entries alone: a few tensors' is remembered (decode
    # queries and their answers repeat it at every step); a batch's hundreds, or metadata, are not.
    if metadata is None and len(entries) <= MEMO_TENSORS:
        text = _header_text(entries)
    else:
        text = _json_header(_header(entries, None if metadata is None else dict(metadata)))
    buffers: list[bytes | memoryview] = [struct.pack("<Q", len(text)), text]
    return buffers + [data.data for _, _, data, _ in wired if data.nbytes]


Entries = tuple[tuple[str, str, tuple[int, ...], int], ...]  #: (name, safetensors dtype, shape, bytes), in file order


def _header(entries: Entries, metadata: dict[str, str] | None) -> dict[str, Any]:
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return header


@functools.lru_cache(maxsize=MEMO_HEADERS)
def _header_text(entries: Entries) -> bytes:
    return _json_header(_header(entries, None))


def _json_header(header: Mapping[str, Any]) -> bytes:
    """Compact JSON as the reference writes it, padded with spaces to a multiple of 8 bytes."""
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return text + b" " * (-len(text) % 8)


def to_bytes(buffers: Iterable[bytes | memoryview]) -> bytes:
    """Join the buffers of :func:`encode_safetensors` into one ``bytes``."""
    return b"".join(buffers)


def decode_binary_request(body: bytes | bytearray | memoryview, query: Mapping[str, str] | Iterable[tuple[str, str]],
                          kind: BodyKind = ATTENTION, limits: Limits = DEFAULT_LIMITS) -> Decoded:
    """The tensors and options of a safetensors body with its options in the URL query."""
    tensors = decode_safetensors(body, kind.tensors, limits)
    options = parse_query_options(query, kind, limits, alibi_slopes=tensors.get("alibi_slopes"))
    check_present(tensors, options.contexts, kind)
    return Decoded(tensors, options)

