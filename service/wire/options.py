"""Options of a request, from JSON values or URL query text, checked into one typed object.

JSON bodies carry options as fields; binary bodies carry them as URL query
parameters (``scale=0.125``, ``causal=true``, ``window=LEFT,RIGHT``,
``contexts=ID1,ID2``; docs/API.md section 6); the Open Inference Protocol as
request parameters. Each form is read into JSON-typed values, and
:func:`check_options` checks those values once and builds the request's
:class:`workers.options.AttentionOptions` (the only place it is built).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from service.errors import InvalidOption
from service.wire.rules import ATTENTION, DEFAULT_LIMITS, BodyKind, Limits, is_context_id, show, sorted_names
from workers.options import AttentionOptions


@dataclass(frozen=True, eq=False)
class RequestOptions:
    """The options of one request, checked; unused ones keep their defaults."""

    attention: AttentionOptions = field(default_factory=AttentionOptions)  #: with alibi_slopes when sent
    contexts: tuple[str, ...] = ()  #: ids of stored contexts whose keys join the inline ones
    replicas: int | None = None  #: copies of each shard of a new context (None: the default)
    shards: int | None = None  #: shards a new context is cut into (None: the default)


def _number(name: str, value: Any) -> Any:
    if type(value) not in (int, float):
        raise InvalidOption(f"{name} must be a number, got {show(value)}")
    return value  # finite and in range: AttentionOptions


def _count(name: str, value: Any, most: int) -> int:
    if type(value) is not int or not 1 <= value <= most:
        raise InvalidOption(f"{name} must be an int in [1, {most}], got {show(value)}")
    return value


def _window(value: Any) -> Any:
    if type(value) not in (list, tuple) or len(value) != 2 or any(b is not None and type(b) is not int for b in value):
        raise InvalidOption(f"window must be [left, right], each null or an int in [0, 2**62], got {show(value)}")
    return value  # bounds: AttentionOptions


def _contexts(value: Any, limits: Limits) -> tuple[str, ...]:
    if type(value) is not list or not 1 <= len(value) <= limits.max_contexts:
        raise InvalidOption(f"contexts must be a list of 1 to {limits.max_contexts} ids, got {show(value)}")
    for i, cid in enumerate(value):
        if not is_context_id(cid, limits):
            raise InvalidOption(f"contexts[{i}] must be an id of 1 to {limits.max_context_id_chars} characters "
                                f"A-Z a-z 0-9 . _ ~ -, got {show(cid)}")
        if cid in value[:i]:
            raise InvalidOption(f"contexts must not repeat an id, got {show(cid)} twice")
    return tuple(value)


def check_options(raw: Mapping[str, Any], kind: BodyKind, limits: Limits = DEFAULT_LIMITS,
                  alibi_slopes: Any = None) -> RequestOptions:
    """Check JSON-typed option values of a ``kind`` request; ``None`` means "not given".

    ``alibi_slopes`` (a tensor of the same request) joins the attention options;
    its shape is checked with the other tensors.
    """
    for name in raw:
        if name not in kind.options:
            raise InvalidOption(f"{name} is not an option of {kind.name} requests; "
                                f"options must be among {sorted_names(kind.options)}, got {name!r}")
    given = {name: value for name, value in raw.items() if value is not None}
    if "causal" in given and type(given["causal"]) is not bool:
        raise InvalidOption(f"causal must be true or false, got {show(given['causal'])}")
    try:
        attention = AttentionOptions(
            scale=_number("scale", given["scale"]) if "scale" in given else None,
            causal=given.get("causal", False),
            window=_window(given["window"]) if "window" in given else None,
            softcap=_number("softcap", given["softcap"]) if "softcap" in given else None,
            alibi_slopes=alibi_slopes,
        )
    except ValueError as exc:
        raise InvalidOption(str(exc)) from None
    return RequestOptions(
        attention=attention,
        contexts=_contexts(given["contexts"], limits) if "contexts" in given else (),
        replicas=_count("replicas", given["replicas"], limits.max_replicas) if "replicas" in given else None,
        shards=_count("shards", given["shards"], limits.max_shards) if "shards" in given else None,
    )


# -- options as URL query parameters ---------------------------------------------------------

#: A JSON number: no "nan", "inf", "0x10", "1_000", "+1", ".5" or surrounding spaces.
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]{0,40})(?:\.[0-9]{1,40})?(?:[eE][+-]?[0-9]{1,4})?")
_BOUND = re.compile(r"(?:0|[1-9][0-9]{0,20})?")
_COUNT = re.compile(r"[1-9][0-9]{0,9}")


def query_value(name: str, text: str) -> Any:
    """One option's query text as its JSON value (``window=128,`` -> ``[128, None]``), or 422."""
    if name in ("scale", "softcap"):
        if not _NUMBER.fullmatch(text):
            raise InvalidOption(f"{name} must be a number, got {show(text)}")
        return float(text)
    if name == "causal":
        if text not in ("true", "false"):
            raise InvalidOption(f"causal must be true or false, got {show(text)}")
        return text == "true"
    if name == "window":
        sides = text.split(",")
        if len(sides) != 2 or not all(_BOUND.fullmatch(s) for s in sides):
            raise InvalidOption("window must be LEFT,RIGHT with each side empty (unbounded) "
                                f"or an int >= 0, got {show(text)}")
        return [int(s) if s else None for s in sides]
    if name == "contexts":
        return text.split(",")
    if not _COUNT.fullmatch(text):  # replicas, shards
        raise InvalidOption(f"{name} must be an int >= 1, got {show(text)}")
    return int(text)


def _query_items(params: Mapping[str, str] | Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    multi = getattr(params, "multi_items", None)
    if multi is not None:  # Starlette's QueryParams keeps repeated keys
        return list(multi())
    if isinstance(params, Mapping):
        return list(params.items())
    return list(params)


def parse_query_options(params: Mapping[str, str] | Iterable[tuple[str, str]], kind: BodyKind = ATTENTION,
                        limits: Limits = DEFAULT_LIMITS, alibi_slopes: Any = None) -> RequestOptions:
    """Options of a binary body from URL query parameters, each at most once, checked as :func:`check_options`."""
    raw: dict[str, Any] = {}
    for name, text in _query_items(params):
        if name not in kind.options:
            raise InvalidOption(f"query parameters of {kind.name} requests must be among "
                                f"{sorted_names(kind.options)}, got {show(name)}")
        if name in raw:
            raise InvalidOption(f"{name} must be given once, got it twice")
        raw[name] = query_value(name, text)
    return check_options(raw, kind, limits, alibi_slopes)
