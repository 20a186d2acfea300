"""A body in either ``/v1`` format to the typed request it carries (what the routes call)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from service.wire.json_codec import decode_json_request
from service.wire.negotiation import Format
from service.wire.request import AttentionRequest, ContextWrite, Decoded, attention_request, context_write
from service.wire.rules import ATTENTION, BodyKind, Limits
from service.wire.safetensors import decode_binary_request

Query = Mapping[str, str] | Iterable[tuple[str, str]]


def decode(fmt: Format, body: bytes | bytearray | memoryview, query: Query, kind: BodyKind, limits: Limits) -> Decoded:
    """The tensors and options of a body: JSON fields, or safetensors with options in the URL query."""
    if fmt == "json":
        return decode_json_request(body, limits, kind)
    return decode_binary_request(body, query, kind, limits)


def decode_attention(fmt: Format, body: bytes | bytearray | memoryview, query: Query,
                     limits: Limits) -> AttentionRequest:
    """``POST /v1/attention``: the checked request."""
    return attention_request(decode(fmt, body, query, ATTENTION, limits))


def decode_context_write(fmt: Format, body: bytes | bytearray | memoryview, query: Query, kind: BodyKind,
                         limits: Limits) -> ContextWrite:
    """``POST /v1/contexts`` and ``/v1/contexts/{id}/append``: the checked keys and values."""
    return context_write(decode(fmt, body, query, kind, limits))
