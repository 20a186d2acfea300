"""Content negotiation: which codec reads a request body and which one writes the response.

Two formats, ``"json"`` and ``"safetensors"`` (docs/API.md section 6). The request's
``Content-Type`` must name one of them (else 415). The response follows ``Accept``
(RFC 9110 media ranges with q-values; the most specific range decides a format's q),
defaulting to the request's format and preferring it on ties. An ``Accept`` that allows
neither format does not fail: the contract has no 406, and RFC 9110 section 12.5.1
lets a server disregard ``Accept``, so the response falls back to the request's format.
"""

from __future__ import annotations

import functools
from typing import Literal

from service.core.errors import UnsupportedMediaType
from service.wire.rules import show

Format = Literal["json", "safetensors"]

#: Media types read as each format. Responses are written with the first one.
MEDIA_TYPES: dict[Format, tuple[str, ...]] = {
    "json": ("application/json",),
    "safetensors": ("application/octet-stream", "application/vnd.safetensors"),
}
#: ``Accept`` values up to this long are negotiated once and remembered (:func:`response_format`).
MEMO_ACCEPT_CHARS = 256
_FORMAT_OF: dict[str, Format] = {media: fmt for fmt, medias in MEDIA_TYPES.items() for media in medias}


def content_type(fmt: Format) -> str:
    """The ``Content-Type`` of a response in ``fmt``."""
    return MEDIA_TYPES[fmt][0]


def _split(value: str) -> tuple[str, dict[str, str]]:
    """``'Application/JSON; charset="UTF-8"'`` -> ``('application/json', {'charset': 'UTF-8'})``."""
    media, *raw_params = value.split(";")
    params = {}
    for p in raw_params:
        key, sep, val = p.partition("=")
        if sep:
            params[key.strip().lower()] = val.strip().strip('"')
    return media.strip().lower(), params


def request_format(content_type_header: str | None) -> Format:
    """The format of a request body from its ``Content-Type``; 415 naming the media type otherwise.

    Parameters are allowed; a JSON body's ``charset``, if given, must be utf-8.
    """
    accepted = ", ".join(_FORMAT_OF)
    if not content_type_header or not content_type_header.strip():
        raise UnsupportedMediaType(f"Content-Type must be one of {accepted}, got none")
    media, params = _split(content_type_header)
    fmt = _FORMAT_OF.get(media)
    if fmt is None:
        raise UnsupportedMediaType(f"Content-Type must be one of {accepted}, got {show(media)}")
    charset = params.get("charset")
    if fmt == "json" and charset is not None and charset.lower() not in ("utf-8", "utf8"):
        raise UnsupportedMediaType(f"Content-Type charset must be utf-8, got {show(charset)}")
    return fmt


def _quality(params: dict[str, str]) -> float | None:
    """The q-value of a media range (1 when absent); None when malformed (the range is ignored)."""
    text = params.get("q", "1")
    try:
        q = float(text)
    except ValueError:
        return None
    return q if 0 <= q <= 1 else None


def response_format(accept: str | None, request_fmt: Format) -> Format:
    """The response format for ``Accept``: the best q > 0, ties and no match going to ``request_fmt``.

    A function of its arguments alone: an ``Accept`` of up to ``MEMO_ACCEPT_CHARS`` is
    negotiated once (a client sends the same one with every request; 64 kept at most).
    """
    if not accept or not accept.strip():
        return request_fmt
    if len(accept) <= MEMO_ACCEPT_CHARS:
        return _negotiate_memo(accept, request_fmt)
    return _negotiate(accept, request_fmt)


def _negotiate(accept: str, request_fmt: Format) -> Format:
    best: dict[str, tuple[int, float]] = {}  # format -> (specificity, q) of its most specific range
    for item in accept.split(","):
        media, params = _split(item)
        q = _quality(params)
        if q is None or "/" not in media:
            continue
        kind, _, sub = media.partition("/")
        for fmt, medias in MEDIA_TYPES.items():
            for candidate in medias:
                c_kind = candidate.partition("/")[0]
                if media == candidate:
                    spec = 2
                elif kind == c_kind and sub == "*":
                    spec = 1
                elif media == "*/*":
                    spec = 0
                else:
                    continue
                if fmt not in best or spec > best[fmt][0] or (spec == best[fmt][0] and q > best[fmt][1]):
                    best[fmt] = (spec, q)
    other: Format = "safetensors" if request_fmt == "json" else "json"
    q_request = best.get(request_fmt, (0, 0.0))[1]
    q_other = best.get(other, (0, 0.0))[1]
    if q_other > q_request:
        return other
    return request_fmt


_negotiate_memo = functools.lru_cache(maxsize=64)(_negotiate)
