"""What both body formats share: size limits, body kinds, tensor rules and the options.

A request is a set of named tensors plus options. JSON bodies carry both
(:mod:`service.json_codec`); safetensors bodies carry the tensors and the URL query
carries the options (:mod:`service.safetensors_codec`, :func:`parse_query_options`).
Either way the result is the same pair ``(tensors, options)``:

* ``tensors``: ``{name: np.ndarray}``, names from :attr:`BodyKind.tensors`;
* ``options``: only the options the client gave, normalised: ``scale`` (float),
  ``causal`` (bool), ``window`` (``(left|None, right|None)``), ``softcap`` (float > 0;
  ``softcap=0`` means "off" and is dropped), ``contexts`` (list of ids), ``replicas``
  and ``shards`` (int). :func:`attention_options` turns them into
  :class:`workers.options.AttentionOptions`.

Every client mistake raises :class:`service.errors.ApiError` whose detail reads
"field must be X, got Y".
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from service.errors import ApiError
from workers.options import MAX_POSITION, AttentionOptions


@dataclass(frozen=True)
class Limits:
    """Bounds checked before anything is allocated for a request."""

    max_body_bytes: int = 2**30  #: a whole binary body
    max_json_body_bytes: int = 64 * 2**20  #: a whole JSON body (parsing costs ~10x its size)
    max_header_bytes: int = 2**20  #: the JSON header of a safetensors body
    max_elements: int = 2**28  #: elements of one tensor
    max_dims: int = 3  #: dims of one tensor (tensors with a rule in TENSOR_RULES have their own rank)
    max_contexts: int = 64  #: context ids in one attention request
    max_context_id_chars: int = 128  #: characters of one context id
    max_shards: int = 1024  #: shards of one context
    max_replicas: int = 64  #: replicas of one context

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{f.name} must be an int >= 1, got {value!r}")


#: The limits used when a caller gives none.
DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class TensorRule:
    """The rank, element kind (``"float"`` or ``"int"``) and layout of one named tensor."""

    rank: int
    kind: str
    layout: str


#: The contract's tensors (CONTRACT section 2).
TENSOR_RULES: Mapping[str, TensorRule] = {
    "q": TensorRule(3, "float", "[n_q, h_q, d]"),
    "k": TensorRule(3, "float", "[n_k, h_kv, d]"),
    "v": TensorRule(3, "float", "[n_k, h_kv, d_v]"),
    "q_pos": TensorRule(1, "int", "[n_q]"),
    "k_pos": TensorRule(1, "int", "[n_k]"),
    "alibi_slopes": TensorRule(1, "float", "[h_q]"),
}


@dataclass(frozen=True)
class BodyKind:
    """Which tensors and options one endpoint's body may carry, and which tensors it must."""

    name: str
    tensors: frozenset[str]
    options: frozenset[str]
    required: frozenset[str]


ATTENTION = BodyKind(
    "attention",
    tensors=frozenset({"q", "k", "v", "q_pos", "k_pos", "alibi_slopes"}),
    options=frozenset({"scale", "causal", "window", "softcap", "contexts"}),
    required=frozenset({"q"}),
)
CONTEXT_CREATE = BodyKind(
    "context", tensors=frozenset({"k", "v", "k_pos"}), options=frozenset({"replicas", "shards"}),
    required=frozenset({"k", "v"}),
)
CONTEXT_APPEND = BodyKind(
    "append", tensors=frozenset({"k", "v", "k_pos"}), options=frozenset(), required=frozenset({"k", "v"}),
)

#: Context ids: URL-unreserved characters only, so they travel unescaped in paths and in
#: ``contexts=ID1,ID2`` (no commas).
CONTEXT_ID = re.compile(r"[A-Za-z0-9._~-]+")


def show(value: Any, limit: int = 60) -> str:
    """A short rendering of a client value for "got ..." (JSON where possible)."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):  # not JSON, or an int too long to print
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sorted_names(names: Iterable[str]) -> str:
    return ", ".join(sorted(names)) or "(none)"


def load_json(data: bytes | bytearray | memoryview, what: str) -> Any:
    """Parse UTF-8 JSON, rejecting duplicate object keys; 400 ``invalid_body`` if unparseable.

    NaN and Infinity literals parse to floats here; the field checks reject them by name.
    """
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in items:
            if key in obj:
                raise ApiError("invalid_body", f"{what} must not repeat a key, got {show(key)} twice")
            obj[key] = value
        return obj

    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError("invalid_body", f"{what} must be UTF-8, got byte 0x{data[e.start]:02x} at {e.start}") from None
    try:
        return json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise ApiError("invalid_body", f"{what} must be valid JSON, got {e.msg} at {where}") from None
    except RecursionError:
        raise ApiError("invalid_body", f"{what} must be valid JSON, got lists or objects nested too deeply") from None
    except ValueError as e:  # e.g. an integer literal with thousands of digits
        raise ApiError("invalid_body", f"{what} must be valid JSON, got {e}") from None


# -- options ---------------------------------------------------------------------------------

def _number(name: str, value: Any) -> float:
    if type(value) not in (int, float):
        raise ApiError("invalid_option", f"{name} must be a number, got {show(value)}")
    try:
        return float(value)
    except OverflowError:  # an int beyond float64
        raise ApiError("invalid_option", f"{name} must be a finite number, got {show(value)}") from None


def _count(name: str, value: Any, most: int) -> int:
    if type(value) is not int or not 1 <= value <= most:
        raise ApiError("invalid_option", f"{name} must be an int in [1, {most}], got {show(value)}")
    return value


def _contexts(value: Any, limits: Limits) -> list[str]:
    if type(value) is not list or not 1 <= len(value) <= limits.max_contexts:
        raise ApiError("invalid_option",
                       f"contexts must be a list of 1 to {limits.max_contexts} ids, got {show(value)}")
    seen: set[str] = set()
    for i, cid in enumerate(value):
        if type(cid) is not str or len(cid) > limits.max_context_id_chars or not CONTEXT_ID.fullmatch(cid):
            raise ApiError(
                "invalid_option",
                f"contexts[{i}] must be an id of 1 to {limits.max_context_id_chars} characters "
                f"A-Z a-z 0-9 . _ ~ -, got {show(cid)}",
            )
        if cid in seen:
            raise ApiError("invalid_option", f"contexts must not repeat an id, got {show(cid)} twice")
        seen.add(cid)
    return list(value)


def check_options(raw: Mapping[str, Any], kind: BodyKind, limits: Limits) -> dict[str, Any]:
    """Check option values (strict JSON types) for ``kind``; return them normalised.

    ``None`` values mean "not given" and are dropped.
    """
    for name in raw:
        if name not in kind.options:
            raise ApiError("invalid_option", f"{name} is not an option of {kind.name} requests; "
                           f"options must be among {sorted_names(kind.options)}, got {name!r}")
    opts = {name: value for name, value in raw.items() if value is not None}
    for name in ("scale", "softcap"):
        if name in opts:
            opts[name] = _number(name, opts[name])
    if "causal" in opts and type(opts["causal"]) is not bool:
        raise ApiError("invalid_option", f"causal must be true or false, got {show(opts['causal'])}")
    if "window" in opts:
        w = opts["window"]
        if type(w) not in (list, tuple) or len(w) != 2 or any(
                b is not None and (type(b) is not int or not 0 <= b <= MAX_POSITION) for b in w):
            raise ApiError("invalid_option",
                           f"window must be [left, right], each null or an int in [0, 2**62], got {show(w)}")
    try:
        checked = AttentionOptions(scale=opts.get("scale"), causal=opts.get("causal", False),
                                   window=opts.get("window"), softcap=opts.get("softcap"))
    except ValueError as e:
        raise ApiError("invalid_option", str(e)) from None
    for name in ("scale", "causal", "window", "softcap"):
        if name in opts:
            opts[name] = getattr(checked, name)
    if "softcap" in opts and opts["softcap"] is None:  # softcap 0: off
        del opts["softcap"]
    if "contexts" in opts:
        opts["contexts"] = _contexts(opts["contexts"], limits)
    if "replicas" in opts:
        _count("replicas", opts["replicas"], limits.max_replicas)
    if "shards" in opts:
        _count("shards", opts["shards"], limits.max_shards)
    return opts


def attention_options(options: Mapping[str, Any], alibi_slopes: Any = None) -> AttentionOptions:
    """The :class:`AttentionOptions` of checked ``options`` (and the ``alibi_slopes`` tensor)."""
    return AttentionOptions(scale=options.get("scale"), causal=options.get("causal", False),
                            window=options.get("window"), softcap=options.get("softcap"),
                            alibi_slopes=alibi_slopes)


# -- options as URL query parameters ---------------------------------------------------------

#: A JSON number: no "nan", "inf", "0x10", "1_000", "+1", ".5" or surrounding spaces.
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]{0,40})(?:\.[0-9]{1,40})?(?:[eE][+-]?[0-9]{1,4})?")
_BOUND = re.compile(r"(?:0|[1-9][0-9]{0,20})?")
_COUNT = re.compile(r"[1-9][0-9]{0,9}")


def _query_value(name: str, text: str) -> Any:
    if name in ("scale", "softcap"):
        if not _NUMBER.fullmatch(text):
            raise ApiError("invalid_option", f"{name} must be a number, got {show(text)}")
        return float(text)
    if name == "causal":
        if text not in ("true", "false"):
            raise ApiError("invalid_option", f"causal must be true or false, got {show(text)}")
        return text == "true"
    if name == "window":
        sides = text.split(",")
        if len(sides) != 2 or not all(_BOUND.fullmatch(s) for s in sides):
            raise ApiError("invalid_option", "window must be LEFT,RIGHT with each side empty (unbounded) "
                           f"or an int >= 0, got {show(text)}")
        return [int(s) if s else None for s in sides]
    if name == "contexts":
        return text.split(",")
    if not _COUNT.fullmatch(text):  # replicas, shards
        raise ApiError("invalid_option", f"{name} must be an int >= 1, got {show(text)}")
    return int(text)


def _query_items(params: Mapping[str, str] | Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    if hasattr(params, "multi_items"):  # Starlette's QueryParams keeps repeated keys
        return list(params.multi_items())
    if isinstance(params, Mapping):
        return list(params.items())
    return list(params)


def parse_query_options(params: Mapping[str, str] | Iterable[tuple[str, str]], kind: BodyKind = ATTENTION,
                        limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Options of a binary body from URL query parameters (strings), checked as :func:`check_options`.

    Syntax: ``scale=0.125`` and ``softcap=30`` (JSON numbers), ``causal=true|false`` (only
    these two words), ``window=LEFT,RIGHT`` (a side may be empty: unbounded),
    ``contexts=ID1,ID2``, ``replicas=N``, ``shards=N``. Each parameter at most once.
    """
    raw: dict[str, Any] = {}
    for name, text in _query_items(params):
        if name not in kind.options:
            raise ApiError("invalid_option", f"query parameters of {kind.name} requests must be among "
                           f"{sorted_names(kind.options)}, got {show(name)}")
        if name in raw:
            raise ApiError("invalid_option", f"{name} must be given once, got it twice")
        raw[name] = _query_value(name, text)
    return check_options(raw, kind, limits)


# -- whole requests --------------------------------------------------------------------------

def check_request(tensors: Mapping[str, Any], options: Mapping[str, Any], kind: BodyKind) -> None:
    """The tensors ``kind`` requires are there; attention has keys (inline k and v, or contexts)."""
    for name in sorted(kind.required):
        if name not in tensors:
            raise ApiError("invalid_tensor", f"{name} is required in {kind.name} requests, got no tensor {name}")
    if kind is ATTENTION:
        if ("k" in tensors) != ("v" in tensors):
            given, missing = ("k", "v") if "k" in tensors else ("v", "k")
            raise ApiError("invalid_tensor", f"{missing} must be given with {given}, got {given} alone")
        if "k" not in tensors and not options.get("contexts"):
            raise ApiError("invalid_tensor", "k and v must be given when no contexts are, got neither")
